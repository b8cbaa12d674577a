"""attnkit.dsa.flash_mla_with_kvcache (FlashMLA's contract: sparse over the 656-byte V3.2 fp8
cache, dense over a bf16 or V3.2 paged cache) and quantize_v32_kv, against the float64
references in dsa_reference.py, on FlashMLA's test grid (page sizes 2, 61, 64, 69; s_q 1 and
3; zero-length rows; all-invalid indices; sinks on and off). Every cache row a call does not
reference is NaN, as in FlashMLA's test, so reading one shows in the result.

Tolerances (dsa_reference.py): out bf16 rtol 1e-2 + atol 1e-4·max|V| + 2^-8·Σp|V|/Σp (P is
rounded to bf16 before P·V on avx512bf16, as FlashMLA does); lse float32 1e-5 relative +
1e-5·(logit magnitude + 1).
"""

import numpy as np
import pytest

import attnkit
from attnkit import dsa
import dsa_reference as D
import sparse_mla_reference as R

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

INT32_MAX, INT32_MIN = 2**31 - 1, -2**31


def bf16(x):
    return np.asarray(x, dtype=np.float32).astype(R.bf16_dtype())


def tt(x):
    if x is None:
        return None
    if x.dtype == R.bf16_dtype():
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def f64(x):
    return R.f64(x)


def check(out, lse, ref, vmax, mag):
    ref_out, ref_lse, pv_abs = ref
    out, lse = f64(out), f64(lse)
    atol = D.OUT_ATOL_PER_V * max(vmax, 1e-30) + D.PV_ROUNDING * pv_abs
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    err = np.abs(out - ref_out) - (atol + D.OUT_RTOL * np.abs(ref_out))
    assert err.max() <= 0, f"out off by {np.abs(out - ref_out).max()}"
    fin = np.isfinite(ref_lse)
    assert (lse[~fin] == ref_lse[~fin]).all()
    tol = D.LSE_ATOL * (mag + 1.0) + D.LSE_RTOL * np.abs(np.where(fin, ref_lse, 0))
    assert (np.abs(lse[fin] - ref_lse[fin]) <= tol[fin]).all(), np.abs(lse[fin] - ref_lse[fin]).max()


class SparseCase:
    """A V3.2 fp8 paged cache, random indices into it (with -1, out-of-range and extreme
    values), topk_length, a sink; unreferenced rows NaN."""

    def __init__(self, rng, b, s_q, h_q, s_k, topk, page, sink=False, tl=True, all_invalid=False):
        blocks_per_seq = -(-s_k // page)
        self.num_blocks = b * blocks_per_seq + 3
        self.page, self.s_q = page, s_q
        # values of all tokens (then quantised), allocated with one spare token per block so
        # the block stride is not page·656 (FlashMLA's test does the same)
        kv = rng.standard_normal((self.num_blocks, page + 1, 1, 576)).astype(np.float32)
        kv *= np.exp2(rng.uniform(-2, 2, size=(self.num_blocks, 1, 1, 576))).astype(np.float32)
        full = attnkit.dsa.quantize_v32_kv(bf16(kv))
        # per batch: its pages are a random choice of blocks; it has s_k tokens
        perm = rng.permutation(self.num_blocks)
        table = perm[:b * blocks_per_seq].reshape(b, blocks_per_seq)
        idx = np.full((b, s_q, topk), -1, dtype=np.int64)
        for bi in range(b):
            seqlen = int(rng.integers(1, s_k + 1))
            for i in range(s_q):
                n = min(topk, seqlen)
                tok = rng.permutation(seqlen)[:n]
                idx[bi, i, :n] = table[bi, tok // page] * page + tok % page
                idx[bi, i] = idx[bi, i, rng.permutation(topk)]
        u = rng.random(idx.shape)
        idx = np.where(u < 0.1, -1, idx)
        idx = np.where((u >= 0.1) & (u < 0.15), rng.choice([INT32_MAX, INT32_MIN, -2, self.num_blocks * page,
                                                               self.num_blocks * page + 5], size=idx.shape), idx)
        if all_invalid:
            idx[:] = -1
        self.indices = idx.astype(np.int32)
        self.topk_length = None
        if tl:
            tlen = rng.integers(0, topk + 1, size=b)
            if b >= 2:
                tlen[0], tlen[1] = 0, topk
            self.topk_length = tlen.astype(np.int32)
        keep = set()
        for bi in range(b):
            for i in range(s_q):
                keep.update(D.rows_used(bi, i, s_q, page, self.num_blocks, self.indices, self.topk_length))
        D.poison_v32(full, keep)
        self.cache = full[:, :page]
        self.keep = keep
        self.q = bf16(rng.standard_normal((b, s_q, h_q, 576)) * 0.5)
        self.sink = (rng.standard_normal(h_q) * 2).astype(np.float32) if sink else None
        if sink and h_q >= 3:
            self.sink[0], self.sink[1] = np.inf, -np.inf

    def run(self, kind="numpy", **kw):
        conv = tt if kind == "torch" else (lambda x: x)
        args = dict(softmax_scale=None, is_fp8_kvcache=True, indices=conv(self.indices),
                    attn_sink=conv(self.sink), topk_length=conv(self.topk_length))
        args.update(kw)
        return dsa.flash_mla_with_kvcache(conv(self.q), conv(self.cache), None, None, 512, **args)

    def reference(self):
        ref = D.mla_decode_ref(self.q, self.cache, 512, is_fp8=True, indices=self.indices,
                               topk_length=self.topk_length, attn_sink=self.sink)
        used = lambda bi, i: D.rows_used(bi, i, self.s_q, self.page, self.num_blocks, self.indices, self.topk_length)
        mag = D.logit_magnitude(self.q, self.cache, True, used, 576 ** -0.5)
        vals = D.v32_dequant(self.cache[[k[0] for k in self.keep], [k[1] for k in self.keep], 0]) if self.keep else np.ones((1, 576))
        return ref, float(np.abs(vals[:, :512]).max()), mag


SPARSE_GRID = [  # (b, s_q, h_q, s_k, topk, page): FlashMLA's grid, smaller batches and heads
    (4, 1, 16, 512, 64, 2),
    (4, 3, 43, 512, 64, 69),
    (3, 1, 64, 512, 64, 64),
    (2, 3, 16, 1024, 576, 61),
    (2, 1, 128, 2046, 2048, 64),
    (5, 2, 7, 300, 128, 1),
]


@pytest.mark.parametrize("b,s_q,h_q,s_k,topk,page", SPARSE_GRID)
@pytest.mark.parametrize("sink", [False, True])
def test_sparse_decode_grid(b, s_q, h_q, s_k, topk, page, sink):
    rng = np.random.default_rng(hash((b, s_q, h_q, s_k, topk, page, sink)) % 2**32)
    c = SparseCase(rng, b, s_q, h_q, s_k, topk, page, sink=sink)
    out, lse = c.run()
    assert out.shape == (b, s_q, h_q, 512) and lse.shape == (b, h_q, s_q)
    ref, vmax, mag = c.reference()
    check(out, lse, ref, vmax, mag)
    if c.topk_length is not None and b >= 2:   # topk_length 0: empty row
        assert (f64(out)[0] == 0).all() and np.isinf(lse[0]).all()


def test_sparse_all_invalid_and_no_topk_length():
    rng = np.random.default_rng(1)
    c = SparseCase(rng, 3, 2, 16, 200, 64, 8, sink=True, tl=False, all_invalid=True)
    out, lse = c.run()
    assert (f64(out) == 0).all() and (lse == np.inf).all()


@pytest.mark.parametrize("scale", [2.0, -2.0, 1 / 24])
def test_sparse_logits_rising_across_tiles(scale):
    """Each row's indices ordered by head 0's logit, rising, so its max climbs over every
    64-row tile (at scale 2 by more than the fused softmax's lazy-max slack, ln 256;
    at the default 1/24 mostly by less); a negative scale takes the unfused softmax. Against
    float64, with a sink, one split (topk 1000) and the split-KV merge (b 1, topk 1100)."""
    rng = np.random.default_rng(17)
    for b, topk in ((3, 1000), (1, 1100)):
        c = SparseCase(rng, b, 1, 16, 1200, topk, 64, sink=True, tl=False)
        values = D.v32_dequant(c.cache[:, :, 0].reshape(-1, 656))
        slots = c.num_blocks * c.page
        for bi in range(b):
            row = c.indices[bi, 0]
            valid = np.flatnonzero((row >= 0) & (row < slots))
            logits = values[row[valid]] @ f64(c.q[bi, 0, 0])
            row[valid] = row[valid][np.argsort(logits * np.sign(scale), kind="stable")]
        out, lse = c.run(softmax_scale=scale)
        ref = D.mla_decode_ref(c.q, c.cache, 512, softmax_scale=scale, is_fp8=True, indices=c.indices,
                               attn_sink=c.sink)
        used = lambda bi, i: D.rows_used(bi, i, 1, c.page, c.num_blocks, c.indices, None)
        mag = D.logit_magnitude(c.q, c.cache, True, used, abs(scale))
        check(out, lse, ref, c.reference()[1], mag)


def test_sparse_torch_matches_numpy_and_threads():
    rng = np.random.default_rng(2)
    c = SparseCase(rng, 3, 3, 43, 700, 256, 61, sink=True)
    out, lse = c.run()
    out_t, lse_t = c.run("torch")
    assert lse_t.shape == (3, 43, 3) and not lse_t.is_contiguous()
    assert (out_t.view(torch.int16).numpy() == out.view(np.int16)).all()
    assert np.array_equal(lse_t.numpy(), lse)
    n = attnkit.get_num_threads()
    try:
        attnkit.set_num_threads(1)
        out1, lse1 = c.run()
    finally:
        attnkit.set_num_threads(n)
    assert (out1.view(np.int16) == out.view(np.int16)).all() and np.array_equal(lse1, lse)


@pytest.mark.parametrize("b,s_q,topk,tl,h_q", [(1, 1, 2048, False, 16), (1, 1, 1536, True, 16), (1, 1, 1100, True, 16),
                                               (1, 1, 2048, True, 43), (1, 2, 2048, True, 16), (3, 1, 1100, True, 16)])
def test_split_kv_exact_and_thread_independent(b, s_q, topk, tl, h_q):
    """A single query row splits its listed rows (split-KV, fixed ranges of 512+ rows) and
    merges the partials through their lse: within the reference tolerance, and bit-identical
    for any thread count (the cut depends on the shape only). topk_length may leave a split
    empty. 43 heads: head blocks of 43 or 21 (3 threads) merged 16 heads at a time, the last
    chunk of each block shorter. Two and three query rows run unsplit, in head blocks that
    depend on the thread count (2 or 3 threads: halved until the tasks spread evenly)."""
    rng = np.random.default_rng(hash((b, s_q, topk, tl, h_q)) % 2**32)
    c = SparseCase(rng, b, s_q, h_q, 2 * topk, topk, 64, sink=True, tl=tl)
    n = attnkit.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3):
            attnkit.set_num_threads(threads)
            runs.append(c.run())
    finally:
        attnkit.set_num_threads(n)
    ref, vmax, mag = c.reference()
    check(*runs[0], ref, vmax, mag)
    for out, lse in runs[1:]:
        assert (out.view(np.int16) == runs[0][0].view(np.int16)).all() and np.array_equal(lse, runs[0][1])


def test_split_kv_nan_reaches_row():
    """Split-KV: a NaN in one head's q reaches that head's merged out and lse, no other head's."""
    rng = np.random.default_rng(12)
    c = SparseCase(rng, 1, 1, 16, 4096, 2048, 64, tl=False)
    q = c.q.copy()
    q[0, 0, 3, 7] = np.nan
    out, lse = dsa.flash_mla_with_kvcache(q, c.cache, None, None, 512, is_fp8_kvcache=True, indices=c.indices)
    assert np.isnan(f64(out)[0, 0, 3]).all() and np.isnan(lse[0, 3, 0])
    others = np.arange(16) != 3
    assert np.isfinite(f64(out)[0, 0, others]).all() and np.isfinite(lse[0, others]).all()


def test_sparse_strided_q_and_indices():
    rng = np.random.default_rng(3)
    c = SparseCase(rng, 2, 3, 16, 400, 128, 64)
    out, lse = c.run()
    q_big = np.zeros((2, 3, 32, 600), dtype=R.bf16_dtype())
    q_big[:, :, ::2, 10:586] = c.q
    idx_big = np.zeros((2, 3, 256), dtype=np.int32)
    idx_big[..., ::2] = c.indices
    out2, lse2 = dsa.flash_mla_with_kvcache(q_big[:, :, ::2, 10:586], c.cache, None, None, 512, is_fp8_kvcache=True,
                                            indices=idx_big[..., ::2], topk_length=c.topk_length)
    assert (out2.view(np.int16) == out.view(np.int16)).all() and np.array_equal(lse2, lse)


def test_torch_opcheck():
    rng = np.random.default_rng(4)
    c = SparseCase(rng, 2, 1, 16, 200, 64, 64, sink=True)
    out = torch.empty((2, 1, 16, 512), dtype=torch.bfloat16)
    lse = torch.empty((2, 1, 16), dtype=torch.float32)
    import attnkit._torch_dsa  # noqa: F401
    torch.library.opcheck(torch.ops.attnkit.flash_mla_with_kvcache,
                          (tt(c.q), tt(c.cache), None, None, 512, None, False, True, tt(c.indices), tt(c.sink),
                           tt(c.topk_length), out, lse))


# --- quantiser ------------------------------------------------------------------------------

def test_quantize_matches_flashmla_quantiser():
    rng = np.random.default_rng(5)
    kv = (rng.standard_normal((37, 576)) * np.exp2(rng.uniform(-20, 12, size=(37, 1)))).astype(np.float32)
    kv[0, :128] = 0.0                      # all-zero tile: scale 2^ceil(log2(1e-4))
    kv[1, 128:256] = 448.0                 # amax exactly 448
    kv[2, 256:384] *= 1e-30                # tiny values (fp8 subnormals / zero)
    for src in (kv, bf16(kv)):
        got = dsa.quantize_v32_kv(src)
        assert got.dtype == np.uint8 and got.shape == (37, 656)
        assert np.array_equal(got, D.v32_quantize(src))
    scales = np.ascontiguousarray(got[:, 512:528]).view(np.float32)
    assert np.array_equal(np.exp2(np.round(np.log2(scales))), scales)  # powers of two
    assert scales[0, 0] == 2.0 ** -13
    # dequantised values are exact in bf16 and within the e4m3 step of the input
    deq = D.v32_dequant(got)
    src = f64(bf16(kv))
    step = np.repeat(scales, 128, axis=1).astype(np.float64)
    assert (np.abs(deq[:, :512] - src[:, :512]) <= np.maximum(np.abs(src[:, :512]) / 16, step * 2**-9)).all()
    assert np.array_equal(deq[:, 512:], src[:, 512:])


def test_quantize_torch_and_shape():
    rng = np.random.default_rng(6)
    kv = bf16(rng.standard_normal((3, 5, 1, 576)))
    got = dsa.quantize_v32_kv(tt(kv))
    assert isinstance(got, torch.Tensor) and tuple(got.shape) == (3, 5, 1, 656)
    assert np.array_equal(got.numpy(), D.v32_quantize(kv))
    with pytest.raises(ValueError, match="last dim of 576"):
        dsa.quantize_v32_kv(np.zeros((3, 512), np.float32))
    with pytest.raises(ValueError, match="kv must be bfloat16 or float32"):
        dsa.quantize_v32_kv(np.zeros((3, 576), np.float16))


def test_quantize_is_a_registered_op():
    """quantize_v32_kv is a torch.library op (opcheck passes; torch.compile with fullgraph
    traces it; an input that requires grad is refused)."""
    kv = tt(bf16(np.random.default_rng(7).standard_normal((4, 576))))
    dst = torch.empty((4, 656), dtype=torch.uint8)
    import attnkit._torch_dsa  # noqa: F401
    torch.library.opcheck(torch.ops.attnkit.quantize_v32_kv, (kv, dst))
    compiled = torch.compile(lambda x: dsa.quantize_v32_kv(x), fullgraph=True)
    assert torch.equal(compiled(kv), dsa.quantize_v32_kv(kv))
    with pytest.raises(ValueError, match="quantize_v32_kv has no backward yet, and kv requires grad"):
        dsa.quantize_v32_kv(kv.float().requires_grad_(True))


# --- dense ----------------------------------------------------------------------------------

class DenseCase:
    def __init__(self, rng, b, s_q, h_q, page, max_len, d_qk=576, d_v=512, fp8=False, causal=False):
        lens = rng.integers(0, max_len + 1, size=b)
        lens[0] = max_len
        if b > 1:
            lens[1] = 0
        if causal:
            lens = np.maximum(lens, s_q) if b == 1 else lens
        max_blocks = -(-max_len // page) + 1
        self.num_blocks = b * max_blocks + 2
        perm = rng.permutation(self.num_blocks)
        table = np.full((b, max_blocks), -1, dtype=np.int32)   # unused entries invalid ids
        for bi in range(b):
            nb = -(-int(lens[bi]) // page)
            table[bi, :nb] = perm[bi * max_blocks: bi * max_blocks + nb]
        self.block_table, self.cache_seqlens = table, lens.astype(np.int32)
        self.page, self.s_q, self.causal, self.fp8, self.d_v = page, s_q, causal, fp8, d_v
        keep = set()
        for bi in range(b):
            for i in range(s_q):
                keep.update(D.rows_used(bi, i, s_q, page, self.num_blocks, block_table=table,
                                        cache_seqlens=self.cache_seqlens, causal=causal))
        self.keep = keep
        if fp8:
            full = dsa.quantize_v32_kv(bf16(rng.standard_normal((self.num_blocks, page + 1, 1, 576))))
            D.poison_v32(full, keep)
        else:
            full = bf16(rng.standard_normal((self.num_blocks, page + 1, 1, d_qk)))
            D.poison_bf16(full, keep)
        self.cache = full[:, :page]
        self.q = bf16(rng.standard_normal((b, s_q, h_q, d_qk)) * 0.5)
        self.scale = 0.7 / np.sqrt(d_qk)

    def run(self, **kw):
        return dsa.flash_mla_with_kvcache(self.q, self.cache, self.block_table, self.cache_seqlens, self.d_v,
                                          softmax_scale=self.scale, causal=self.causal, is_fp8_kvcache=self.fp8, **kw)

    def check(self, out, lse):
        ref = D.mla_decode_ref(self.q, self.cache, self.d_v, self.scale, is_fp8=self.fp8,
                                            block_table=self.block_table, cache_seqlens=self.cache_seqlens,
                                            causal=self.causal)
        used = lambda bi, i: D.rows_used(bi, i, self.s_q, self.page, self.num_blocks, block_table=self.block_table,
                                         cache_seqlens=self.cache_seqlens, causal=self.causal)
        mag = D.logit_magnitude(self.q, self.cache, self.fp8, used, self.scale)
        keep = list(self.keep) or [(0, 0)]
        raw = self.cache[[k[0] for k in keep], [k[1] for k in keep], 0]
        vals = D.v32_dequant(raw) if self.fp8 else f64(raw)
        check(out, lse, ref, float(np.abs(vals[:, :self.d_v]).max()), mag)


@pytest.mark.parametrize("b,s_q,h_q,page,max_len,d_qk,d_v", [
    (3, 1, 16, 64, 300, 576, 512),
    (4, 3, 43, 61, 200, 576, 512),
    (2, 2, 128, 2, 129, 576, 512),
    (5, 1, 8, 1, 70, 576, 512),
    (2, 3, 5, 69, 150, 72, 40),      # any d_qk >= d_v on the bf16 cache
    (1, 2, 16, 64, 1500, 576, 512),  # long rows at batch 1: split-KV
])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_bf16_decode(b, s_q, h_q, page, max_len, d_qk, d_v, causal):
    rng = np.random.default_rng(hash((b, s_q, h_q, page, max_len, causal)) % 2**32)
    c = DenseCase(rng, b, s_q, h_q, page, max_len, d_qk, d_v, causal=causal)
    out, lse = c.run()
    c.check(out, lse)


@pytest.mark.parametrize("causal", [False, True])
def test_dense_over_v32_cache(causal):
    rng = np.random.default_rng(7)
    c = DenseCase(rng, 3, 2, 16, 64, 200, fp8=True, causal=causal)
    c.check(*c.run())


def test_dense_sink():
    rng = np.random.default_rng(8)
    c = DenseCase(rng, 2, 1, 8, 16, 50)
    sink = (rng.standard_normal(8)).astype(np.float32)
    out, lse = c.run(attn_sink=sink)
    out0, lse0 = c.run()
    assert np.array_equal(lse, lse0)
    fin = np.isfinite(lse0)
    factor = 1 / (1 + np.exp(sink[None, :, None] - lse0.astype(np.float64)))
    want = f64(out0) * np.where(fin, factor, 0).transpose(0, 2, 1)[..., None]
    assert np.allclose(f64(out), want, rtol=1e-2, atol=1e-3)


# --- errors ---------------------------------------------------------------------------------

def test_errors():
    rng = np.random.default_rng(9)
    c = SparseCase(rng, 2, 1, 16, 100, 64, 16)
    q, cache, idx = c.q, c.cache, c.indices
    call = lambda **kw: dsa.flash_mla_with_kvcache(**{**dict(q=q, k_cache=cache, block_table=None, cache_seqlens=None,
                                                            head_dim_v=512, is_fp8_kvcache=True, indices=idx), **kw})
    cases = [
        (dict(q=q.astype(np.float32)), "q must be bfloat16"),
        (dict(q=q[0]), "q must be a 4-d tensor"),
        (dict(is_fp8_kvcache=False), "is_fp8_kvcache must be True when sparse attention is enabled"),
        (dict(causal=True), "causal must be False when sparse attention is enabled"),
        (dict(head_dim_v=256), "Only head_size_v == 512 is supported for sparse decoding"),
        (dict(q=q[..., :512]), "Only head_size_k == 576"),
        (dict(k_cache=cache[..., :600]), "656-byte V3.2 tokens"),
        (dict(k_cache=cache.view(np.int8).astype(np.float32)), "key must have dtype fp8_e4m3fn, int8 or uint8"),
        (dict(k_cache=np.concatenate([cache, cache], axis=2)), "Currently only MQA"),
        (dict(k_cache=cache[:, ::2]), "The whole block must be contiguous"),
        (dict(indices=idx[:1]), r"indices must be int32 of shape \[2, 1, topk\]"),
        (dict(indices=idx.astype(np.int64)), "unsupported dtype|indices must be int32"),
        (dict(topk_length=np.zeros(3, np.int32)), r"topk_length must be int32 of shape \[2\]"),
        (dict(attn_sink=np.zeros(15, np.float32)), r"attn_sink must be float32 of shape \[16\]"),
        (dict(softmax_scale=float("nan")), "softmax_scale must be finite"),
        (dict(softmax_scale=1e39), r"softmax_scale must be finite, got 1e\+39 \(inf in float32"),
        (dict(softmax_scale="x"), "softmax_scale must be a float"),
        (dict(head_dim_v=-1), r"head_dim_v must be in \[1, head_dim=576\], got -1"),
        (dict(out=np.empty((2, 1, 16, 256), R.bf16_dtype())), r"out must have shape \[2, 1, 16, 512\]"),
        (dict(out=np.empty((2, 1, 16, 512), np.float32)), "out must be bfloat16"),
        (dict(extra_k_cache=cache), "extra_k_cache"),
        (dict(indices=tt(idx)), "indices must be a numpy array like q"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call(**kw)


def test_dense_errors():
    rng = np.random.default_rng(10)
    c = DenseCase(rng, 2, 1, 8, 16, 40)
    call = lambda **kw: dsa.flash_mla_with_kvcache(**{**dict(q=c.q, k_cache=c.cache, block_table=c.block_table,
                                                            cache_seqlens=c.cache_seqlens, head_dim_v=512), **kw})
    bad_table = c.block_table.copy()
    bad_table[0, 0] = c.num_blocks
    cases = [
        (dict(block_table=None), "block_table and cache_seqlens are required"),
        (dict(block_table=bad_table), r"block_table\[0, 0\] = .* is out of range"),
        (dict(cache_seqlens=np.array([10**6, 0], np.int32)), r"cache_seqlens\[0\] must be in"),
        (dict(cache_seqlens=np.array([-1, 0], np.int32)), r"cache_seqlens\[0\] must be in"),
        (dict(head_dim_v=577), "head_dim_v must be in"),
        (dict(head_dim_v=0), r"head_dim_v must be in \[1, head_dim=576\], got 0"),
        (dict(softmax_scale=-1e39), r"softmax_scale must be finite, got -1e\+39 \(inf in float32"),
        (dict(k_cache=c.cache[..., :100]), "k_cache head_dim must match"),
        (dict(k_cache=c.cache.astype(np.float32)), "k_cache must be bfloat16"),
        (dict(topk_length=np.zeros(2, np.int32)), "topk_length is only used with indices"),
        (dict(q=c.q[:, :0]), "seq_len_q >= 1"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call(**kw)


def test_each_isa(isa):
    """Sparse and dense decode on every compiled ISA (fp32 tiles where vdpbf16ps is absent)."""
    rng = np.random.default_rng(20)
    c = SparseCase(rng, 3, 3, 43, 500, 128, 61, sink=True)
    out, lse = c.run()
    ref, vmax, mag = c.reference()
    check(out, lse, ref, vmax, mag)
    d = DenseCase(rng, 2, 2, 16, 64, 150, causal=True)
    d.check(*d.run())


def test_out_must_not_alias_inputs():
    rng = np.random.default_rng(11)
    c = SparseCase(rng, 2, 1, 16, 100, 64, 16)
    buf = np.zeros(2 * 16 * 576 * 2, R.bf16_dtype())
    q = buf[:2 * 16 * 576].reshape(2, 1, 16, 576)
    q[...] = c.q
    with pytest.raises(ValueError, match="out must not alias q"):
        dsa.flash_mla_with_kvcache(q, c.cache, None, None, 512, is_fp8_kvcache=True, indices=c.indices,
                                   out=buf[1000:1000 + 2 * 16 * 512].reshape(2, 1, 16, 512))

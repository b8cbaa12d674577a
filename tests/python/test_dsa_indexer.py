"""attnkit.dsa's lightning indexer (DeepGEMM's fp8_mqa_logits / fp8_paged_mqa_logits), the
fused streaming top-k, and top-k with its ragged and paged transforms, against float64 /
exact references in dsa_reference.py.

Tolerances: logits (float32) 1e-5·|ref| + 1e-5·(Σ_h |w|·Σ_d |q k|·|scale|) (dsa_reference.py);
top-k is exact (compared with a sort of the kernel's own logits).
"""

import numpy as np
import pytest

import attnkit
from attnkit import dsa
import dsa_reference as D
import sparse_mla_reference as R

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

FP8 = R.fp8_dtype()


def fp8(rng, shape, scale=1.0):
    x = rng.standard_normal(shape) * scale * np.exp2(rng.uniform(-2, 2, size=shape))
    x = np.where(x == 0, 0.5, np.clip(x, -448, 448))
    return x.astype(FP8)


def tt(x):
    if x is None:
        return None
    if x.dtype == FP8:
        return torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(x)


def causal_ranges(rng, extends, seqlens):
    """SGLang's ks/ke over the batch's gathered KV (bottom-right causal per request)."""
    ks, ke, base = [], [], 0
    for ext, kv_len in zip(extends, seqlens):
        ks += [base] * ext
        ke += list(base + np.arange(kv_len - ext + 1, kv_len + 1))
        base += kv_len
    return np.array(ks, np.int32), np.array(ke, np.int32), base


def check_logits(got, ref, mag, inside, clean):
    got = np.asarray(got, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        diff = np.abs(got - ref)
    tol = D.LOGITS_ATOL * mag + D.LOGITS_RTOL * np.abs(np.where(inside, ref, 0))
    assert (diff[inside] <= tol[inside]).all(), diff[inside].max()
    if clean:
        assert (got[~inside] == -np.inf).all()
    else:
        assert np.isnan(got[~inside]).all()   # the poisoned caller buffer is left as it was


# (600, 64): one row's heads are wider than an AMX task's 512 columns
@pytest.mark.parametrize("H,D_", [(64, 128), (32, 64), (43, 128), (8, 32), (1, 64), (17, 128), (600, 64)])
@pytest.mark.parametrize("clean", [True, False])
def test_mqa_logits(H, D_, clean):
    rng = np.random.default_rng(hash((H, D_, clean)) % 2**32)
    ks, ke, S = causal_ranges(rng, [3, 70, 1], [10, 300, 129])
    ke[0] = ks[0]            # an empty row
    ks[1], ke[1] = -5, S + 9  # a range past both ends is clipped
    T = len(ks)
    q, kv = fp8(rng, (T, H, D_)), fp8(rng, (S, D_))
    kv_scale = rng.uniform(0.01, 0.1, S).astype(np.float32)
    w = rng.standard_normal((T, H)).astype(np.float32)
    out = np.full((T, S), np.nan, np.float32)
    got = dsa.fp8_mqa_logits(q, (kv, kv_scale), w, ks, ke, clean_logits=clean, out=out)
    assert got is out
    ref, mag, inside = D.mqa_logits_ref(q, kv, kv_scale, w, np.clip(ks, 0, S), np.clip(ke, 0, S))
    check_logits(got, ref, mag, inside, clean)


@pytest.mark.parametrize("layout", ["row_gap", "column_stride"])
def test_mqa_logits_strided_keys(layout):
    # keys whose rows are not adjacent: read key by key (adjacent rows are converted in runs)
    rng = np.random.default_rng(12)
    ks, ke, S = causal_ranges(rng, [3, 70], [90, 333])
    T, H, D_ = len(ks), 16, 64
    big = fp8(rng, (S, 2 * D_))
    kv = big[:, :D_] if layout == "row_gap" else big[:, ::2]
    kv_scale = rng.uniform(0.01, 0.1, S).astype(np.float32)
    q, w = fp8(rng, (T, H, D_)), rng.standard_normal((T, H)).astype(np.float32)
    got = dsa.fp8_mqa_logits(q, (kv, kv_scale), w, ks, ke, out=np.full((T, S), np.nan, np.float32))
    ref, mag, inside = D.mqa_logits_ref(q, kv, kv_scale, w, ks, ke)
    check_logits(got, ref, mag, inside, True)


def test_mqa_logits_compressed_strided_threads_torch():
    rng = np.random.default_rng(11)
    ks, ke, S = causal_ranges(rng, [40, 5], [300, 2100])
    T, H, D_ = len(ks), 64, 128
    q_big = fp8(rng, (T, H, 2 * D_))
    q = q_big[:, :, ::2]     # strided q
    kv, kv_scale = fp8(rng, (S, D_)), rng.uniform(0.01, 0.1, S).astype(np.float32)
    w = rng.standard_normal((T, H)).astype(np.float32)
    full = dsa.fp8_mqa_logits(q, (kv, kv_scale), w, ks, ke)
    ref, mag, inside = D.mqa_logits_ref(q, kv, kv_scale, w, ks, ke)
    check_logits(full, ref, mag, inside, True)
    width = int((ke - ks).max())
    comp = np.full((T, width), np.nan, np.float32)
    dsa.fp8_mqa_logits(q, (kv, kv_scale), w, ks, ke, clean_logits=False, max_seqlen_k=width, out=comp)
    for t in range(T):
        n = ke[t] - ks[t]
        assert np.array_equal(comp[t, :n], full[t, ks[t]:ke[t]]) and np.isnan(comp[t, n:]).all()
    narrow = width - 100     # longer rows keep their first `narrow` keys' logits
    comp = np.full((T, narrow + 7), np.nan, np.float32)[:, :narrow]
    dsa.fp8_mqa_logits(q, (kv, kv_scale), w, ks, ke, clean_logits=False, max_seqlen_k=narrow, out=comp)
    for t in range(T):
        n = min(ke[t] - ks[t], narrow)
        assert np.array_equal(comp[t, :n], full[t, ks[t]:ks[t] + n]) and np.isnan(comp.base[t, n:]).all()
    n = attnkit.get_num_threads()
    try:
        attnkit.set_num_threads(1)
        one = dsa.fp8_mqa_logits(q, (kv, kv_scale), w, ks, ke)
    finally:
        attnkit.set_num_threads(n)
    assert np.array_equal(one, full)
    t_out = dsa.fp8_mqa_logits(tt(np.ascontiguousarray(q)), (tt(kv), tt(kv_scale)), tt(w), tt(ks), tt(ke))
    assert np.array_equal(t_out.numpy(), full)


def test_negative_starts_count_from_ks():
    # ks < 0: the range is clipped to the keys that exist, but compressed columns and fused
    # offsets still count from ks[t] as given (column c is key ks[t] + c).
    rng = np.random.default_rng(18)
    T, H, D_, S = 6, 8, 64, 300
    ks = np.array([-7, -1, 0, 5, -300, -2], np.int32)
    ke = np.array([40, 1, 30, 320, 10, -1], np.int32)
    q, kv = fp8(rng, (T, H, D_)), fp8(rng, (S, D_))
    kv_scale = rng.uniform(0.01, 0.1, S).astype(np.float32)
    w = rng.standard_normal((T, H)).astype(np.float32)
    full = dsa.fp8_mqa_logits(q, (kv, kv_scale), w, ks, ke)
    lo, hi = np.clip(ks, 0, S), np.clip(ke, 0, S)
    width = 400
    comp = np.full((T, width), np.nan, np.float32)
    dsa.fp8_mqa_logits(q, (kv, kv_scale), w, ks, ke, clean_logits=False, max_seqlen_k=width, out=comp)
    for t in range(T):
        keys = ks[t] + np.arange(width)
        valid = (keys >= lo[t]) & (keys < hi[t])
        assert np.array_equal(comp[t, valid], full[t, keys[valid]]) and np.isnan(comp[t, ~valid]).all(), t
    hi = np.maximum(hi, lo)
    plain = dsa.topk(full, (hi - lo).astype(np.int32), 50, row_starts=lo.astype(np.int32))
    fused = dsa.fp8_mqa_topk(q, (kv, kv_scale), w, ks, ke, 50)
    assert np.array_equal(fused, np.where(plain >= 0, plain + (lo - ks)[:, None], -1))
    with pytest.raises(ValueError, match=r"cu_seq_len_k_start\[0\] = -2147483648: the fused top-k's offsets"):
        dsa.fp8_mqa_topk(q[:1], (kv, kv_scale), w[:1], np.array([-2**31], np.int32), np.array([5], np.int32), 3)


def test_fused_topk_equals_topk_of_logits():
    rng = np.random.default_rng(12)
    ks, ke, S = causal_ranges(rng, [30, 3], [2000, 4500])
    T, H, D_ = len(ks), 16, 64
    q, kv = fp8(rng, (T, H, D_)), fp8(rng, (S, D_))
    kv_scale = rng.uniform(0.01, 0.1, S).astype(np.float32)
    w = rng.standard_normal((T, H)).astype(np.float32)
    kv[100:400] = kv[0]      # repeated keys with equal scales: exact ties
    kv_scale[100:400] = kv_scale[0]
    logits = dsa.fp8_mqa_logits(q, (kv, kv_scale), w, ks, ke)
    for k in (1, 64, 700, 2048, 5000):
        fused = dsa.fp8_mqa_topk(q, (kv, kv_scale), w, ks, ke, k)
        plain = dsa.topk(logits, (ke - ks).astype(np.int32), k, row_starts=ks)
        assert np.array_equal(fused, plain), k
        assert np.array_equal(plain, D.topk_ref(logits, ke - ks, k, ks))


def test_fused_topk_rising_and_falling_rows():
    # logits ∝ w · kv_scale with one key row repeated: scales rising by a hair make every key
    # the new best (each must pass the streaming bar, just above it); w = -1 makes every key
    # worse than the last (each must be filtered, none lost)
    rng = np.random.default_rng(13)
    S, D_, k = 3000, 32, 64
    kv = np.repeat(fp8(rng, (1, D_)), S, axis=0)
    q = np.repeat(kv[None, :1], 2, axis=0)  # q·k = |k|² > 0
    kv_scale = (0.05 + 1e-6 * np.arange(S)).astype(np.float32)
    w = np.array([[1.0], [-1.0]], np.float32)
    ks, ke = np.zeros(2, np.int32), np.full(2, S, np.int32)
    logits = dsa.fp8_mqa_logits(q, (kv, kv_scale), w, ks, ke)
    assert (np.diff(logits[0]) > 0).all() and (np.diff(logits[1]) < 0).all()
    fused = dsa.fp8_mqa_topk(q, (kv, kv_scale), w, ks, ke, k)
    assert np.array_equal(fused, dsa.topk(logits, ke - ks, k, row_starts=ks))
    assert np.array_equal(fused, D.topk_ref(logits, ke - ks, k, ks))


def paged_case(rng, B, next_n, H, D_, page, max_len):
    lens = rng.integers(0, max_len + 1, size=(B, next_n)).astype(np.int32)
    lens[0, :] = max_len
    max_blocks = -(-max_len // page) + 1
    num_blocks = B * max_blocks + 2
    kfull = rng.standard_normal((num_blocks * page, D_)).astype(np.float32)
    cache, kfp8, kscale = dsa.quantize_index_k_cache(kfull, page)
    # a spare block-stride gap: cache view of a bigger allocation
    big = np.full((num_blocks, page * (D_ + 4) + 64), 0xFF, np.uint8)
    big[:, :page * (D_ + 4)] = cache.reshape(num_blocks, -1)
    cache_view = np.lib.stride_tricks.as_strided(big, (num_blocks, page, 1, D_ + 4),
                                                 (big.strides[0], D_ + 4, D_ + 4, 1))
    perm = rng.permutation(num_blocks).astype(np.int32)
    table = np.full((B, max_blocks), -1, np.int32)
    for b in range(B):
        nb = -(-int(lens[b].max()) // page)
        table[b, :nb] = perm[b * max_blocks:b * max_blocks + nb]
    # NaN (fp8 code 0x7F, NaN scale) in every token no row of its batch reads, as FlashMLA's
    # tests poison unreferenced rows: a kernel that read one would show it.
    used = {(int(table[b, s // page]), s % page) for b in range(B) for s in range(int(lens[b].max()))}
    nan_scale = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    for block in range(num_blocks):
        for t in range(page):
            if (block, t) not in used:
                big[block, t * D_:(t + 1) * D_] = 0x7F
                big[block, page * D_ + 4 * t:page * D_ + 4 * t + 4] = nan_scale
    q = fp8(rng, (B, next_n, H, D_))
    w = rng.standard_normal((B * next_n, H)).astype(np.float32)
    return q, cache_view, kfp8, kscale, w, lens, table


@pytest.mark.parametrize("B,next_n,H,D_,page,max_len", [
    (3, 1, 64, 128, 64, 300), (2, 2, 32, 128, 61, 200), (4, 3, 43, 64, 2, 50), (1, 1, 8, 32, 1, 20)])
@pytest.mark.parametrize("clean", [True, False])
def test_paged_mqa_logits(B, next_n, H, D_, page, max_len, clean):
    rng = np.random.default_rng(hash((B, next_n, H, D_, page, clean)) % 2**32)
    q, cache, kfp8, kscale, w, lens, table = paged_case(rng, B, next_n, H, D_, page, max_len)
    width = max_len + 5
    out = np.full((B * next_n, width), np.nan, np.float32)
    dsa.fp8_paged_mqa_logits(q, cache, w, lens, table, None, width, clean, out=out)
    for b in range(B):
        tok = (table[b, :, None] * page + np.arange(page)[None, :]).reshape(-1)
        tok = np.where(np.repeat(table[b] >= 0, page), tok, 0)[:width]
        keys, sc = kfp8[tok], kscale[tok]
        for n in range(next_n):
            r = b * next_n + n
            ref, mag, _ = D.mqa_logits_ref(q[b, n:n + 1], keys, sc, w[r:r + 1], np.array([0]), np.array([lens[b, n]]))
            inside = np.arange(len(tok)) < lens[b, n]
            pad = width - len(tok)
            ref, mag, inside = (np.pad(ref[0], (0, pad), constant_values=-np.inf), np.pad(mag[0], (0, pad)),
                                np.pad(inside, (0, pad)))
            check_logits(out[r][None], ref[None], mag[None], inside[None], clean)


def test_paged_torch_and_errors():
    rng = np.random.default_rng(13)
    q, cache, kfp8, kscale, w, lens, table = paged_case(rng, 2, 1, 16, 128, 64, 100)
    want = dsa.fp8_paged_mqa_logits(q, cache, w, lens, table, None, 100, True)
    got = dsa.fp8_paged_mqa_logits(tt(q), torch.from_numpy(np.ascontiguousarray(cache)), tt(w), tt(lens), tt(table),
                                   None, 100, True)
    assert np.array_equal(got.numpy(), want)
    lens1 = lens[:, 0].copy()
    assert np.array_equal(dsa.fp8_paged_mqa_logits(q, cache, w, lens1, table, None, 100, True), want)  # 1-d lens
    bad = table.copy()
    bad[0, 0] = 10**6
    cases = [
        (dict(block_table=bad), r"block_table\[0, 0\] = 1000000 is out of range"),
        (dict(max_context_len=50), r"context_lens\[0, 0\] must be in"),
        (dict(max_context_len=None), "max_context_len is required"),
        (dict(q=q.astype(np.float32)), "q must be float8_e4m3fn"),
        (dict(kv_cache=np.zeros((3, 64, 1, 100), np.uint8)), r"kv_cache must have shape \[num_blocks, block_kv, 1, 132\]"),
        (dict(weights=w[:, :3]), "weights must be float32 of shape"),
        (dict(context_lens=lens.astype(np.float32)), "context_lens must be int32"),
    ]
    base = dict(q=q, kv_cache=cache, weights=w, context_lens=lens, block_table=table, schedule_meta=None,
                max_context_len=100, clean_logits=True)
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            dsa.fp8_paged_mqa_logits(**{**base, **kw})


def test_mqa_errors():
    rng = np.random.default_rng(14)
    q, kv = fp8(rng, (4, 8, 64)), fp8(rng, (20, 64))
    sc, w = np.ones(20, np.float32), np.ones((4, 8), np.float32)
    ks, ke = np.zeros(4, np.int32), np.full(4, 20, np.int32)
    base = dict(q=q, kv=(kv, sc), weights=w, cu_seq_len_k_start=ks, cu_seq_len_k_end=ke)
    cases = [
        (dict(q=fp8(rng, (4, 8, 48))), "q head dim D must be 32, 64 or 128, got 48"),
        (dict(kv=kv), "kv must be a pair"),
        (dict(kv=(kv[:, :32], sc)), "kv head dim must match"),
        (dict(kv=(kv, sc[:3])), r"kv_scale must be float32 of shape \[20\]"),
        (dict(weights=w.T.copy()), r"weights must be float32 of shape \[4, 8\]"),
        (dict(cu_seq_len_k_start=ks[:2]), r"cu_seq_len_k_start must be int32 of shape \[4\]"),
        (dict(max_seqlen_k=5), "requires clean_logits=False"),
        (dict(q=q.astype(np.float32)), "q must be float8_e4m3fn"),
        (dict(out=np.empty((4, 20), np.float32)[:, ::-1]), "contiguous last dim|must be float32"),
        (dict(cu_seq_len_k_end=tt(ke)), "must be a numpy array like q"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            dsa.fp8_mqa_logits(**{**base, **kw})
    with pytest.raises(ValueError, match="topk must be >= 1"):
        dsa.fp8_mqa_topk(q, (kv, sc), w, ks, ke, 0)
    with pytest.raises(ValueError, match="topk must fit int32, got 9223372036854775808"):
        dsa.fp8_mqa_topk(q, (kv, sc), w, ks, ke, 2**63)
    with pytest.raises(ValueError, match=r"out must have shape \[4, 3\], got \[4, 6\]"):
        dsa.fp8_mqa_topk(q, (kv, sc), w, ks, ke, 3, out=np.empty((4, 6), np.int32))
    with pytest.raises(ValueError, match="weights must be float32, got float64"):
        dsa.fp8_mqa_logits(q, (kv, sc), w.astype(np.float64), ks, ke)


def test_empty_rows_give_empty_logits():
    rng = np.random.default_rng(19)
    kv, sc = fp8(rng, (20, 64)), np.ones(20, np.float32)
    none = np.zeros(0, np.int32)
    got = dsa.fp8_mqa_logits(fp8(rng, (0, 8, 64)), (kv, sc), np.ones((0, 8), np.float32), none, none)
    assert got.shape == (0, 20)
    got = dsa.fp8_mqa_logits(fp8(rng, (0, 8, 64)), (kv, sc), np.ones((0, 8), np.float32), none, none,
                             clean_logits=False, max_seqlen_k=7)
    assert got.shape == (0, 7)
    cache = np.zeros((2, 16, 1, 64 + 4), np.uint8)
    got = dsa.fp8_paged_mqa_logits(fp8(rng, (0, 1, 8, 64)), cache, np.ones((0, 8), np.float32), none,
                                   np.zeros((0, 2), np.int32), max_context_len=32)
    assert got.shape == (0, 32)


# --- top-k ----------------------------------------------------------------------------------

def test_topk_ties_specials_and_determinism():
    rng = np.random.default_rng(15)
    N, L = 7, 5000
    logits = rng.integers(-20, 20, size=(N, L)).astype(np.float32)  # many exact ties
    logits[0, ::3] = -np.inf
    logits[1, 5:9] = np.nan
    logits[2, :] = -np.inf        # nothing selectable
    logits[3, 10] = np.inf
    logits[4, :] = 0.0            # -0.0 and 0.0 tie by index
    logits[4, ::2] = -0.0
    lengths = rng.integers(0, L + 1, size=N).astype(np.int32)
    lengths[[0, 1, 2, 3, 4]] = L
    lengths[5] = 0
    for k in (1, 17, 2048, 6000):
        got = dsa.topk(logits, lengths, k)
        assert np.array_equal(got, D.topk_ref(logits, lengths, k)), k
        n = attnkit.get_num_threads()
        try:
            attnkit.set_num_threads(1)
            assert np.array_equal(dsa.topk(logits, lengths, k), got)
        finally:
            attnkit.set_num_threads(n)
    assert (dsa.topk(logits, lengths, 10)[2] == -1).all() and (dsa.topk(logits, lengths, 10)[5] == -1).all()
    assert dsa.topk(logits, lengths, 1)[3, 0] == 10
    assert np.array_equal(dsa.topk(logits, lengths, 5)[4], [0, 1, 2, 3, 4])


def test_topk_row_starts_strided_and_torch():
    rng = np.random.default_rng(16)
    big = rng.standard_normal((6, 3000)).astype(np.float32)
    logits = big[:, ::2]
    starts = rng.integers(0, 500, size=6).astype(np.int32)
    lengths = rng.integers(0, 1000, size=6).astype(np.int32)
    got = dsa.topk(logits, lengths, 300, row_starts=starts)
    assert np.array_equal(got, D.topk_ref(logits, lengths, 300, starts))
    assert np.array_equal(dsa.topk(tt(np.ascontiguousarray(logits)), tt(lengths), 300, row_starts=tt(starts)).numpy(), got)


def test_ragged_and_paged_transforms():
    rng = np.random.default_rng(17)
    N, L, k = 5, 900, 256
    logits = rng.standard_normal((N, L)).astype(np.float32)
    lengths = np.array([0, 10, 256, 700, 900], np.int32)
    rel = D.topk_ref(logits, lengths, k)
    offsets = np.array([0, 5, 100, 1000, 4000], np.int32)
    got = dsa.topk_ragged_transform(logits, offsets, lengths, k)
    assert np.array_equal(got, np.where(rel >= 0, rel + offsets[:, None], -1))
    for page in (1, 2, 64, 61):
        max_pages = -(-L // page)
        table = rng.permutation(3 * max_pages)[:3 * max_pages].reshape(3, max_pages).astype(np.int32)
        r2b = np.array([2, 0, 1, 1, 2], np.int32)
        got = dsa.topk_page_table_transform(logits, table, lengths, k, row_to_batch=r2b, page_size=page)
        phys = table[r2b[:, None], np.maximum(rel, 0) // page] * page + np.maximum(rel, 0) % page
        assert np.array_equal(got, np.where(rel >= 0, phys, -1)), page
    table1 = rng.permutation(N * L).reshape(N, L).astype(np.int32)   # page size 1, row r -> batch r
    got = dsa.topk_page_table_transform(logits, table1, lengths, k)
    assert np.array_equal(got, np.where(rel >= 0, np.take_along_axis(table1, np.maximum(rel, 0), 1), -1))


def test_topk_errors():
    logits = np.zeros((3, 10), np.float32)
    lengths = np.array([1, 2, 3], np.int32)
    cases = [
        (lambda: dsa.topk(logits, lengths, 0), "topk must be >= 1"),
        (lambda: dsa.topk(logits, np.array([1, 2, 11], np.int32), 4), r"row 2: \[row_starts, row_starts \+ lengths\) = \[0, 11\)"),
        (lambda: dsa.topk(logits, lengths, 4, row_starts=np.array([0, 0, 8], np.int32)), "row 2"),
        (lambda: dsa.topk(logits, lengths[:2], 4), r"lengths must be int32 of shape \[3\]"),
        (lambda: dsa.topk(logits.astype(np.float16), lengths, 4), "logits must be float32"),
        (lambda: dsa.topk_page_table_transform(logits, np.zeros((2, 10), np.int32), lengths, 4),
         "one row per logits row"),
        (lambda: dsa.topk_page_table_transform(logits, np.zeros((3, 1), np.int32), lengths, 4, page_size=2),
         r"lengths\[2\] = 3 exceeds"),
        (lambda: dsa.topk_page_table_transform(logits, np.zeros((3, 10), np.int32), lengths, 4,
                                               row_to_batch=np.array([0, 1, 3], np.int32)), r"row_to_batch\[2\] = 3"),
        (lambda: dsa.topk_ragged_transform(logits, np.array([0, -1, 0], np.int32), lengths, 4), r"offsets\[1\]"),
        (lambda: dsa.topk(logits, lengths, 4, out=np.empty((3, 5), np.int32)), r"out must have shape \[3, 4\]"),
        (lambda: dsa.topk(logits, lengths, 2**63), "topk must fit int32"),
        (lambda: dsa.topk_page_table_transform(logits, np.array([[0, 1], [2, 3], [4, -1]], np.int32), lengths, 4,
                                               page_size=2), r"page_table\[2, 1\] = -1 must be >= 0"),
        (lambda: dsa.topk_page_table_transform(logits, np.array([[2**30, 0]] * 3, np.int32), lengths, 4,
                                               page_size=4), r"page_table\[0, 0\] = 1073741824 must be >= 0 with its "
                                                             r"slots \(page · page_size \+ offset, up to 4294967296\)"),
        (lambda: dsa.topk_page_table_transform(logits, np.zeros((3, 1), np.int32), lengths, 4, page_size=2**31),
         r"page_size must be in \[1, 2147483647\], got 2147483648"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()
    # -1 where no row's keys reach (row 1 has 2 keys: page 0 only) is never read
    got = dsa.topk_page_table_transform(logits, np.array([[0, 1], [2, -1], [4, 5]], np.int32), lengths, 4, page_size=2)
    assert np.array_equal(got[1], [4, 5, -1, -1])

def test_each_isa(isa):
    rng = np.random.default_rng(21)
    ks, ke, S = causal_ranges(rng, [5, 2], [300, 100])
    T, H, D_ = len(ks), 43, 128
    q, kv = fp8(rng, (T, H, D_)), fp8(rng, (S, D_))
    kv_scale = rng.uniform(0.01, 0.1, S).astype(np.float32)
    w = rng.standard_normal((T, H)).astype(np.float32)
    got = dsa.fp8_mqa_logits(q, (kv, kv_scale), w, ks, ke)
    ref, mag, inside = D.mqa_logits_ref(q, kv, kv_scale, w, ks, ke)
    check_logits(got, ref, mag, inside, True)
    assert np.array_equal(dsa.fp8_mqa_topk(q, (kv, kv_scale), w, ks, ke, 50),
                          D.topk_ref(got, ke - ks, 50, ks))
    lg = rng.standard_normal((2, 20001)).astype(np.float32)   # the vector histogram pass
    lg[1, ::7] = -0.0
    lg[1, 3::7] = np.nan
    lens = np.array([20001, 19999], np.int32)
    assert np.array_equal(dsa.topk(lg, lens, 300), D.topk_ref(lg, lens, 300))


def test_topk_long_rows():
    """Rows much longer than topk take the histogram pre-selection (its bar from a sample of
    the row's vectors, the whole row's histogram where the sample misleads): still exact."""
    rng = np.random.default_rng(18)
    logits = rng.standard_normal((5, 65536)).astype(np.float32)
    logits[1] = np.round(logits[1] * 4) / 4          # heavy ties inside the k-th bin
    logits[2, :60000] = -np.inf                      # few selectable values
    logits[3] = 1.0                                  # one value: ties decided by index
    # 512 large values, all where the sample (every 8th run of the SIMD width <= 16) looks:
    # it sees far more large ones than the row has, and its bar keeps fewer than k
    logits[4, np.arange(65536) % 128 < 4] += 100.0
    lengths = np.array([65536, 65536, 65536, 40007, 65536], np.int32)  # 40007: a tail past whole vectors
    for k in (1, 2048, 9000):
        assert np.array_equal(dsa.topk(logits, lengths, k), D.topk_ref(logits, lengths, k)), k


def test_outputs_must_not_alias_inputs():
    rng = np.random.default_rng(19)
    T, H, S = 4, 8, 16
    buf = np.zeros(T * S, np.float32)
    w = buf[:T * H].reshape(T, H)
    q, kv = fp8(rng, (T, H, 64)), fp8(rng, (S, 64))
    ks, ke = np.zeros(T, np.int32), np.full(T, S, np.int32)
    with pytest.raises(ValueError, match="logits must not alias weights"):
        dsa.fp8_mqa_logits(q, (kv, np.ones(S, np.float32)), w, ks, ke, out=buf.reshape(T, S))
    ints = np.full(20, 3, np.int32)
    with pytest.raises(ValueError, match="out must not alias lengths"):
        dsa.topk(np.zeros((4, 10), np.float32), ints[:4], 4, out=ints[2:18].reshape(4, 4))


def test_torch_opcheck_indexer_and_topk():
    import attnkit._torch_dsa  # noqa: F401
    rng = np.random.default_rng(20)
    T, H, S = 3, 8, 40
    q, kv = tt(fp8(rng, (T, H, 64))), tt(fp8(rng, (S, 64)))
    sc, w = torch.rand(S), torch.randn(T, H)
    ks, ke = torch.zeros(T, dtype=torch.int32), torch.full((T,), S, dtype=torch.int32)
    # test_schema compares inputs with float ops torch lacks for float8 tensors: the rest only
    fp8_utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.attnkit.fp8_mqa_logits, (q, kv, sc, w, ks, ke, True, 0, torch.empty(T, S)),
                          test_utils=fp8_utils)
    torch.library.opcheck(torch.ops.attnkit.fp8_mqa_topk, (q, kv, sc, w, ks, ke, torch.empty(T, 7, dtype=torch.int32)),
                          test_utils=fp8_utils)
    torch.library.opcheck(torch.ops.attnkit.topk_transform,
                          (torch.randn(T, S), torch.full((T,), S, dtype=torch.int32), 5, None, None, None, 1, None,
                           torch.empty(T, 5, dtype=torch.int32)))

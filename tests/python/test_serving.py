"""attnkit.varlen_attention, paged_attention and append_kv_cache against the float64 references
in serving_reference.py: random ragged batches (empty sequences, tile edges, GQA ratios),
shuffled and shared block tables with NaN in every unreferenced cache row, fp8 caches, strided
inputs, poisoned outputs, determinism across thread counts, and every validation error."""

import re

import numpy as np
import pytest

import attnkit
from conftest import DTYPES, assert_bits_equal, np_dtype, poison, randn, strided_like, to_torch
from reference import assert_close, tolerance, to_f64
from serving_reference import paged_ref, varlen_ref

ml_dtypes = pytest.importorskip("ml_dtypes")
FP8 = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def check(out, lse, ref, dtype, lse_too=True, extra_rtol=1.0):
    ref_out, ref_lse, mag = ref
    atol, rtol = tolerance(dtype, "out", scale=extra_rtol, magnitude=mag)
    assert_close(out, ref_out, atol, rtol, "out")
    if lse_too:
        atol, rtol = tolerance(dtype, "lse", scale=extra_rtol)
        assert_close(lse, ref_lse, atol, rtol, "lse")


def cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


# ---- varlen

VARLEN_CASES = [
    # lengths_q, lengths_k, Hq, Hkv, D, Dv
    ([5, 0, 17, 1], [5, 3, 40, 9], 4, 2, 16, 16),
    ([127, 128, 129], [127, 128, 129], 2, 1, 64, 48),   # tile edges (128 keys, 48 rows)
    ([1, 1, 1, 1, 1], [300, 7, 0, 129, 520], 8, 2, 32, 32),  # decode-like, long and empty keys
    ([33, 2, 60], [10, 50, 60], 3, 3, 7, 9),            # odd head dims, Sq > Sk (bottom-right)
    ([0, 0], [4, 0], 2, 2, 8, 8),                        # no query at all
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
def test_varlen_matches_reference(rng, dtype, causal, case, isa):
    lq, lk, hq, hkv, d, dv = VARLEN_CASES[case]
    cu_q, cu_k = cu(lq), cu(lk)
    q = randn(rng, (cu_q[-1], hq, d), dtype)
    k = randn(rng, (cu_k[-1], hkv, d), dtype)
    v = randn(rng, (cu_k[-1], hkv, dv), dtype)
    out = poison((cu_q[-1], hq, dv), dtype)
    got, lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, out=out)
    assert got is out
    check(out, lse, varlen_ref(q, k, v, cu_q, cu_k, causal), dtype)


def test_varlen_strided_and_scale(rng):
    cu_q, cu_k = cu([9, 30, 4]), cu([20, 30, 140])
    q = randn(rng, (cu_q[-1], 4, 24))
    k = randn(rng, (cu_k[-1], 2, 24))
    v = randn(rng, (cu_k[-1], 2, 20))
    qs, _ = strided_like(q, rng)
    ks, _ = strided_like(k, rng, allow_negative=True)
    vs, _ = strided_like(v, rng)
    out, _ = strided_like(poison((cu_q[-1], 4, 20), "float32"), rng)
    before = [x.copy() for x in (qs, ks, vs)]
    attnkit.varlen_attention(qs, ks, vs, cu_q, cu_k, causal=True, scale=0.3, out=out)
    for x, b in zip((qs, ks, vs), before):
        np.testing.assert_array_equal(x, b)
    check(out, None, varlen_ref(q, k, v, cu_q, cu_k, True, 0.3), "float32", lse_too=False)


def test_varlen_equals_dense_attention(rng):
    """Equal-length sequences: varlen is dense attention on [B, S, H, D]."""
    B, S, Sk, hq, hkv, d = 3, 50, 70, 4, 2, 32
    q = randn(rng, (B, S, hq, d))
    k = randn(rng, (B, Sk, hkv, d))
    v = randn(rng, (B, Sk, hkv, d))
    dense = attnkit.attention(q, k, v, causal="bottom_right", enable_gqa=True, layout="BSHD")
    packed = attnkit.varlen_attention(q.reshape(B * S, hq, d), k.reshape(B * Sk, hkv, d), v.reshape(B * Sk, hkv, d),
                                      cu([S] * B), cu([Sk] * B), causal=True)
    np.testing.assert_allclose(packed.reshape(B, S, hq, d), dense, rtol=1e-6, atol=1e-6)


# ---- paged

def make_cache(rng, num_blocks, block_size, hkv, d, dtype):
    """A cache full of NaN: only the rows a test writes hold values."""
    dt = FP8[dtype] if dtype in FP8 else np_dtype(dtype)
    return np.full((num_blocks, block_size, hkv, d), np.nan, dtype=dt)


def random_paged_batch(rng, q_lens, seq_lens, block_size, hkv, d, dv, dtype, share=True):
    """Caches (NaN outside the used rows), a shuffled block table with -1 padding, and
    (optionally) the first block of sequence 0 shared by sequence 1 (prefix sharing)."""
    used = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(used + [1]) + 2
    num_blocks = sum(used) + 5
    ids = rng.permutation(num_blocks).astype(np.int32)
    table = np.full((len(seq_lens), max_blocks), -1, dtype=np.int32)
    pos = 0
    for b, n in enumerate(used):
        table[b, :n] = ids[pos:pos + n]
        pos += n
    share = share and len(seq_lens) > 1 and seq_lens[0] >= block_size and used[1] > 0
    if share:
        table[1, 0] = table[0, 0]
    kc = make_cache(rng, num_blocks, block_size, hkv, d, dtype)
    vc = make_cache(rng, num_blocks, block_size, hkv, dv, dtype)
    src = "float32" if dtype in FP8 else dtype
    for b, n in enumerate(seq_lens):
        j = np.arange(n)
        blocks, offs = table[b, j // block_size], j % block_size
        if b == 1 and share:   # the shared block holds sequence 0's rows
            keep = j >= block_size
            blocks, offs = blocks[keep], offs[keep]
        scale = 4.0 if dtype in FP8 else 1.0
        kc[blocks, offs] = randn(rng, (len(blocks), hkv, d), src, scale).astype(kc.dtype)
        vc[blocks, offs] = randn(rng, (len(blocks), hkv, dv), src, scale).astype(vc.dtype)
    return kc, vc, table


PAGED_CASES = [
    # q_lens, seq_lens, block_size, Hq, Hkv, D, Dv
    ([1, 1, 1, 1], [40, 300, 17, 129], 16, 8, 2, 64, 64),       # decode
    ([12, 1, 0, 30], [100, 257, 9, 30], 7, 4, 2, 32, 16),        # mixed, an idle sequence
    ([64, 3], [64, 700], 1, 2, 2, 48, 48),                       # page size 1 (a token table)
    ([5, 1, 2], [133, 2100, 2], 64, 4, 1, 16, 24),               # MQA, a long decode (kv splits)
    ([0, 0, 1], [0, 0, 5], 16, 2, 2, 8, 8),                      # sequences with no keys
    ([1, 1, 2], [900, 31, 40], 16, 34, 17, 32, 40),              # decode tasks of 16 kv heads, then 1
    ([1, 1], [3000, 40], 16, 8, 2, 64, 64),                      # a long decode of 2 kv heads (kv splits)
    ([1, 2], [700, 45], 16, 17, 17, 64, 96),                     # 16 kv heads, then 1; 3 tiles of V columns
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", range(len(PAGED_CASES)))
def test_paged_matches_reference(rng, dtype, causal, case, isa):
    q_lens, seq_lens, bs, hq, hkv, d, dv = PAGED_CASES[case]
    kc, vc, table = random_paged_batch(rng, q_lens, seq_lens, bs, hkv, d, dv, dtype)
    cu_q, lens = cu(q_lens), np.array(seq_lens, dtype=np.int32)
    q = randn(rng, (cu_q[-1], hq, d), dtype)
    out = poison((cu_q[-1], hq, dv), dtype)
    _, lse = attnkit.paged_attention(q, kc, vc, table, lens, cu_q, causal=causal, return_lse=True, out=out)
    check(out, lse, paged_ref(q, kc, vc, table, lens, cu_q, causal), dtype)


@pytest.mark.parametrize("cache_dtype", list(FP8))
@pytest.mark.parametrize("q_dtype", DTYPES)
@pytest.mark.parametrize("per_head", [False, True])
def test_paged_fp8_cache(rng, cache_dtype, q_dtype, per_head, isa):
    q_lens, seq_lens, bs, hq, hkv, d = [1, 7, 1], [200, 50, 33], 16, 4, 2, 64
    kc, vc, table = random_paged_batch(rng, q_lens, seq_lens, bs, hkv, d, d, cache_dtype)
    k_scale = np.array([0.25, 0.5] if per_head else [0.3], dtype=np.float32)
    v_scale = np.array([2.0, 0.125] if per_head else 1.5, dtype=np.float32)
    cu_q, lens = cu(q_lens), np.array(seq_lens, dtype=np.int32)
    q = randn(rng, (cu_q[-1], hq, d), q_dtype)
    out = poison((cu_q[-1], hq, d), q_dtype)
    _, lse = attnkit.paged_attention(q, kc, vc, table, lens, cu_q, k_scale=k_scale, v_scale=v_scale,
                                     return_lse=True, out=out)
    ref = paged_ref(q, kc, vc, table, lens, cu_q, True, None, k_scale, v_scale)
    # Under bf16 queries the tile loop runs on bf16 pairs (P rounded to bf16, within the
    # reference's bf16 allowance); fp32 and fp16 queries take the float32 path.
    check(out, lse, ref, q_dtype)


# Decode over fp8 caches with bf16 queries: on avx512bf16 the K rows are converted exactly
# to bf16 pairs for vdpbf16ps (other variants widen to fp32); against the reference on the
# dequantised cache. Block sizes 1, 5, 7 and powers of two, odd Hkv, GQA ratios 1..8, head
# dims whole vectors of 32 elements, with a tail, odd, tail only.
FP8_DECODE_CASES = [
    # seq_lens, block_size, Hq, Hkv, D
    ([300, 17, 129], 16, 8, 8, 128),   # GQA 1
    ([70, 1, 45], 1, 6, 3, 40),        # block size 1, odd Hkv, GQA 2
    ([200, 33], 7, 15, 3, 33),         # GQA 5, odd D
    ([64, 3, 100], 5, 9, 3, 7),        # GQA 3, D below one vector
    ([150, 129], 64, 8, 2, 96),        # GQA 4
    ([90, 40], 16, 6, 1, 64),          # GQA 6
    ([2100, 5], 128, 8, 1, 64),        # GQA 8, a long decode (kv splits)
    ([33, 61], 3, 14, 2, 16),          # GQA 7
]


@pytest.mark.parametrize("cache_dtype", list(FP8))
@pytest.mark.parametrize("case", range(len(FP8_DECODE_CASES)))
def test_paged_fp8_decode_bf16_queries(rng, cache_dtype, case, isa):
    seq_lens, bs, hq, hkv, d = FP8_DECODE_CASES[case]
    q_lens = [1] * len(seq_lens)
    kc, vc, table = random_paged_batch(rng, q_lens, seq_lens, bs, hkv, d, d, cache_dtype)
    k_scale = (rng.uniform(0.1, 0.6, hkv) if case % 2 else rng.uniform(0.1, 0.6, 1)).astype(np.float32)
    cu_q, lens = cu(q_lens), np.array(seq_lens, dtype=np.int32)
    q = randn(rng, (cu_q[-1], hq, d), "bfloat16")
    out = poison((cu_q[-1], hq, d), "bfloat16")
    _, lse = attnkit.paged_attention(q, kc, vc, table, lens, cu_q, k_scale=k_scale, v_scale=0.5,
                                     return_lse=True, out=out)
    check(out, lse, paged_ref(q, kc, vc, table, lens, cu_q, True, None, k_scale, 0.5), "bfloat16")


@pytest.mark.parametrize("cache_dtype", list(FP8))
def test_paged_fp8_decode_strided_cache(rng, cache_dtype, isa):
    """A cache whose head dim is strided (every other element): the conversion's scalar path,
    bit-identical to the vector path on the contiguous cache. On avx512amx with one kv head
    (MQA), so both run one head at a time: kv heads side by side run on AMX tiles there, a
    strided cache's cannot."""
    seq_lens, bs, hq, d = [100, 37], 16, 8, 48
    hkv = 1 if isa == "avx512amx" else 2
    kc, vc, table = random_paged_batch(rng, [1, 1], seq_lens, bs, hkv, d, d, cache_dtype)
    wide = np.full(kc.shape[:3] + (2 * d,), np.nan, dtype=kc.dtype)
    wide[..., ::2] = kc
    cu_q, lens = cu([1, 1]), np.array(seq_lens, dtype=np.int32)
    q = randn(rng, (2, hq, d), "bfloat16")
    got = attnkit.paged_attention(q, wide[..., ::2], vc, table, lens, cu_q, k_scale=0.3)
    np.testing.assert_array_equal(got, attnkit.paged_attention(q, kc, vc, table, lens, cu_q, k_scale=0.3))
    check(got, None, paged_ref(q, kc, vc, table, lens, cu_q, True, None, 0.3), "bfloat16", lse_too=False)


# Prefill chunks over fp8 caches with bf16 queries: the tile loop converts each K and V
# tile exactly to bf16 pairs (avx512bf16; others widen to fp32). Odd D, a V wider than
# twice D, block sizes 1 and 7 (key pairs split across pages), kv splits, a strided V.
FP8_PREFILL_CASES = [
    # q_lens, seq_lens, block_size, Hq, Hkv, D, Dv, strided V
    ([40, 1, 130], [300, 5, 130], 7, 8, 2, 33, 40, False),
    ([64, 9], [64, 20], 1, 4, 4, 128, 128, True),
    ([20, 3], [2100, 3], 64, 4, 1, 16, 256, False),
]


@pytest.mark.parametrize("cache_dtype", list(FP8))
@pytest.mark.parametrize("case", range(len(FP8_PREFILL_CASES)))
def test_paged_fp8_prefill_bf16_queries(rng, cache_dtype, case, isa):
    q_lens, seq_lens, bs, hq, hkv, d, dv, strided = FP8_PREFILL_CASES[case]
    kc, vc, table = random_paged_batch(rng, q_lens, seq_lens, bs, hkv, d, dv, cache_dtype)
    if strided:
        wide = np.full(vc.shape[:3] + (2 * dv,), np.nan, dtype=vc.dtype)
        wide[..., ::2] = vc
        v_in = wide[..., ::2]
    else:
        v_in = vc
    cu_q, lens = cu(q_lens), np.array(seq_lens, dtype=np.int32)
    q = randn(rng, (cu_q[-1], hq, d), "bfloat16")
    out = poison((cu_q[-1], hq, dv), "bfloat16")
    _, lse = attnkit.paged_attention(q, kc, v_in, table, lens, cu_q, k_scale=0.25, v_scale=0.5,
                                     return_lse=True, out=out)
    check(out, lse, paged_ref(q, kc, vc, table, lens, cu_q, True, None, 0.25, 0.5), "bfloat16")


@pytest.mark.parametrize("cache_dtype", list(FP8))
@pytest.mark.parametrize("isa_name", [i for i in attnkit.supported_isas() if i in ("avx512bf16", "avx512amx")])
def test_paged_fp8_cache_runs_the_bf16_path(rng, cache_dtype, isa_name, restore_runtime):
    """With bf16 queries an fp8 cache is converted exactly to bf16 and runs the bf16 cache's
    path (decode's key blocks; the tile loop, on AMX tiles on avx512amx): in a mixed batch
    its out and lse are bit-identical to those over a bf16 cache holding the same values."""
    import ml_dtypes
    attnkit.set_isa(isa_name)
    q_lens, seq_lens = [1, 37, 1, 300], [700, 37, 2000, 900]
    kc, vc, table = random_paged_batch(rng, q_lens, seq_lens, 16, 2, 128, 128, cache_dtype)
    cu_q, lens = cu(q_lens), np.array(seq_lens, dtype=np.int32)
    q = randn(rng, (cu_q[-1], 8, 128), "bfloat16")
    got = attnkit.paged_attention(q, kc, vc, table, lens, cu_q, k_scale=1.0, v_scale=1.0, return_lse=True)
    kb, vb = (x.astype(np.float32).astype(ml_dtypes.bfloat16) for x in (kc, vc))
    want = attnkit.paged_attention(q, kb, vb, table, lens, cu_q, return_lse=True)
    for a, b in zip(got, want):
        assert_bits_equal(a, b, f"{cache_dtype} vs bf16 cache on {isa_name}")


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e5m2"])
def test_paged_nonfinite_value_stays_in_its_column(rng, cache_dtype, isa):
    """A non-finite V value reaches only its own column of the output, as in exact P·V (on
    AMX tiles decode pairs each key's P with two of V's columns, and attends again with them
    apart where an output holds a NaN)."""
    q_lens, seq_lens = [1, 1, 3], [300, 40, 77]
    kc, vc, table = random_paged_batch(rng, q_lens, seq_lens, 16, 2, 64, 64, cache_dtype)
    vc[table[0, 100 // 16], 100 % 16, 0, 5] = np.inf   # sequence 0, key 100, kv head 0
    vc[table[2, 0], 3, 1, 10] = np.nan                 # sequence 2, key 3, kv head 1
    cu_q, lens = cu(q_lens), np.array(seq_lens, dtype=np.int32)
    q = randn(rng, (cu_q[-1], 4, 64), "bfloat16")
    out = poison((cu_q[-1], 4, 64), "bfloat16")
    _, lse = attnkit.paged_attention(q, kc, vc, table, lens, cu_q, return_lse=True, out=out)
    check(out, lse, paged_ref(q, kc, vc, table, lens, cu_q), "bfloat16")
    o = to_f64(out)
    assert np.isposinf(o[0, :2, 5]).all() and np.isnan(o[2:, 2:, 10]).all()
    assert np.isfinite(np.delete(o[0, :2], 5, axis=-1)).all() and np.isfinite(np.delete(o[2:, 2:], 10, axis=-1)).all()


def test_paged_float_scale_and_torch(rng):
    torch = pytest.importorskip("torch")
    kc, vc, table = random_paged_batch(rng, [3, 1], [20, 70], 16, 2, 32, 32, "float8_e4m3fn")
    cu_q, lens = cu([3, 1]), np.array([20, 70], dtype=np.int32)
    q = randn(rng, (4, 4, 32))
    want = attnkit.paged_attention(q, kc, vc, table, lens, cu_q, k_scale=0.5, v_scale=2.0)
    tkc = torch.from_numpy(kc.view(np.uint8)).view(torch.float8_e4m3fn)
    tvc = torch.from_numpy(vc.view(np.uint8)).view(torch.float8_e4m3fn)
    got, lse = attnkit.paged_attention(torch.from_numpy(q), tkc, tvc, torch.from_numpy(table), torch.from_numpy(lens),
                                       torch.from_numpy(cu_q), k_scale=0.5, v_scale=2.0, return_lse=True)
    assert isinstance(got, torch.Tensor) and lse.shape == (4, 4)
    np.testing.assert_array_equal(got.numpy(), want)


def test_torch_compile_traces_serving_ops(rng):
    torch = pytest.importorskip("torch")
    cu_q, cu_k = torch.tensor(cu([3, 5])), torch.tensor(cu([4, 9]))
    q, k, v = (torch.from_numpy(randn(rng, s)) for s in ((8, 2, 16), (13, 1, 16), (13, 1, 16)))

    def f(q, k, v):
        return attnkit.varlen_attention(q, k, v, cu_q, cu_k, causal=True) * 2

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v), rtol=0, atol=0)
    out, lse = torch.ops.attnkit.varlen_attention(q, k, v, cu_q, cu_k, None, None, True, None)
    torch.library.opcheck(torch.ops.attnkit.varlen_attention.default, (q, k, v, cu_q, cu_k, None, None, True, None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_deterministic_across_threads(rng, dtype, restore_runtime):
    q_lens, seq_lens = [1, 1, 40], [3000, 600, 200]
    kc, vc, table = random_paged_batch(rng, q_lens, seq_lens, 16, 2, 64, 64, dtype)
    cu_q, lens = cu(q_lens), np.array(seq_lens, dtype=np.int32)
    q = randn(rng, (cu_q[-1], 8, 64), dtype)
    results = []
    for n in (1, 2):
        attnkit.set_num_threads(n)
        results.append(attnkit.paged_attention(q, kc, vc, table, lens, cu_q, return_lse=True))
    for a, b in zip(*results):
        np.testing.assert_array_equal(to_f64(a), to_f64(b))



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_varlen_deterministic_across_threads(rng, dtype, restore_runtime):
    q_lens, k_lens = [1, 300, 40, 0, 129], [2000, 300, 700, 5, 129]
    q = randn(rng, (sum(q_lens), 8, 64), dtype)
    k, v = randn(rng, (sum(k_lens), 2, 64), dtype), randn(rng, (sum(k_lens), 2, 48), dtype)
    results = []
    for n in (1, 2, 3):
        attnkit.set_num_threads(n)
        results.append(attnkit.varlen_attention(q, k, v, cu(q_lens), cu(k_lens), causal=True, return_lse=True))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(to_f64(a), to_f64(b))


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_paged_read_ahead_ways_agree(rng, cache_dtype, isa, monkeypatch):
    # Decode over grouped kv heads reads ahead into L2 share by share (ATTNKIT_READ_AHEAD=l2,
    # Zen 4's rule) or the next block by loads / L1 prefetches, timed (next): timing only, so
    # both give the same bits. 1500 keys pass the timed trials (36 blocks of 16 keys).
    q_dtype = "bfloat16" if cache_dtype.startswith("float8") else cache_dtype
    q_lens, seq_lens = [1, 1, 2], [1500, 37, 700]
    kc, vc, table = random_paged_batch(rng, q_lens, seq_lens, 16, 4, 64, 64, cache_dtype)
    cu_q, lens = cu(q_lens), np.array(seq_lens, dtype=np.int32)
    q = randn(rng, (cu_q[-1], 8, 64), q_dtype)
    results = []
    for way in ("l2", "next"):
        monkeypatch.setenv("ATTNKIT_READ_AHEAD", way)
        out = poison((cu_q[-1], 8, 64), q_dtype)
        results.append(attnkit.paged_attention(q, kc, vc, table, lens, cu_q, return_lse=True, out=out))
    for a, b in zip(*results):
        assert_bits_equal(a, b)
    check(*results[0], paged_ref(q, kc, vc, table, lens, cu_q, True), q_dtype)


# ---- score modifiers

MODS = [
    dict(window=(7, 0)),
    dict(window=(129, 3)),
    dict(softcap=2.5),
    dict(alibi=True),
    dict(sinks=True),
    dict(window=(40, -1), softcap=4.0, alibi=True, sinks=True),
]


def _mods(rng, hq, batch, spec):
    kw = {k: v for k, v in spec.items() if k in ("window", "softcap")}
    if spec.get("alibi"):
        kw["alibi_slopes"] = (rng.random((batch, hq)) * 0.5).astype(np.float32)
    if spec.get("sinks"):
        kw["sinks"] = randn(rng, (hq,))
    return kw


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spec", range(len(MODS)))
def test_varlen_score_modifiers(rng, dtype, causal, spec):
    lq, lk, hq, hkv, d = [5, 0, 130, 1], [9, 4, 300, 140], 4, 2, 32
    cu_q, cu_k = cu(lq), cu(lk)
    q = randn(rng, (cu_q[-1], hq, d), dtype)
    k = randn(rng, (cu_k[-1], hkv, d), dtype)
    v = randn(rng, (cu_k[-1], hkv, d), dtype)
    kw = _mods(rng, hq, len(lq), MODS[spec])
    out = poison((cu_q[-1], hq, d), dtype)
    _, lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, out=out, **kw)
    check(out, lse, varlen_ref(q, k, v, cu_q, cu_k, causal, **kw), dtype)


@pytest.mark.parametrize("spec", range(len(MODS)))
def test_paged_score_modifiers(rng, spec, isa):
    q_lens, seq_lens, bs, hq, hkv, d = [1, 12, 1], [700, 100, 33], 16, 4, 2, 32
    kc, vc, table = random_paged_batch(rng, q_lens, seq_lens, bs, hkv, d, d, "float32")
    cu_q, lens = cu(q_lens), np.array(seq_lens, dtype=np.int32)
    q = randn(rng, (cu_q[-1], hq, d))
    kw = _mods(rng, hq, len(q_lens), MODS[spec])
    out = poison((cu_q[-1], hq, d), "float32")
    _, lse = attnkit.paged_attention(q, kc, vc, table, lens, cu_q, return_lse=True, out=out, **kw)
    check(out, lse, paged_ref(q, kc, vc, table, lens, cu_q, True, **kw), "float32")


def test_serving_modifier_errors(rng):
    args = _varlen_args(rng)
    for change, message in ((dict(window=(-3, 0)), "window left must be -1 (unbounded) or >= 0, got -3"),
                            (dict(softcap=0.0), "softcap must be a finite number > 0"),
                            (dict(alibi_slopes=np.ones(3, np.float32)), "alibi_slopes must be float32 of shape [4]"),
                            (dict(sinks=np.ones((2, 4), np.float32)), "sinks must be float32 of shape [4]")):
        with pytest.raises(ValueError, match=re.escape(message)):
            attnkit.varlen_attention(**args, **change)


# ---- append_kv_cache

@pytest.mark.parametrize("cache_dtype", DTYPES + list(FP8))
def test_append_writes_slots(rng, cache_dtype):
    T, hkv, d, nb, bs = 9, 2, 12, 4, 5
    k = randn(rng, (T, hkv, d), "float32", 3.0)
    v = randn(rng, (T, hkv, d), "float32", 3.0)
    k[0, 0, 0] = 1e5     # saturates in float8
    v[1, 1, 1] = np.nan
    slots = np.array([3, 7, -1, 19, 0, 12, 7, 11, 2], dtype=np.int64)  # slot 7 twice: the last wins
    kc, vc = make_cache(rng, nb, bs, hkv, d, cache_dtype), make_cache(rng, nb, bs, hkv, d, cache_dtype)
    scale = np.array([0.5, 2.0], dtype=np.float32) if cache_dtype in FP8 else None
    attnkit.append_kv_cache(k, v, kc, vc, slots, k_scale=scale, v_scale=scale)
    for cache, src in ((kc, k), (vc, v)):
        want = make_cache(rng, nb, bs, hkv, d, cache_dtype)
        for t, s in enumerate(slots):
            if s < 0:
                continue
            x = src[t] / (scale[:, None] if scale is not None else 1.0)
            if cache_dtype in FP8:
                x = np.where(np.isnan(x), x, np.clip(x, -FP8_MAX[cache_dtype], FP8_MAX[cache_dtype]))
            want[s // bs, s % bs] = x.astype(want.dtype)
        np.testing.assert_array_equal(cache.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_append_then_attend_equals_attention(rng, dtype):
    """A prefix appended, then a chunk appended and attended: equals dense attention of the
    chunk over the whole sequence (bottom-right causal)."""
    hq, hkv, d, bs, prefix, chunk = 4, 2, 32, 16, 37, 11
    n = prefix + chunk
    k = randn(rng, (n, hkv, d), dtype)
    v = randn(rng, (n, hkv, d), dtype)
    q = randn(rng, (chunk, hq, d), dtype)
    kc, vc = make_cache(rng, 8, bs, hkv, d, dtype), make_cache(rng, 8, bs, hkv, d, dtype)
    table = np.array([[5, 2, 7, 0, -1]], dtype=np.int32)
    slot = table[0, np.arange(n) // bs].astype(np.int64) * bs + np.arange(n) % bs
    attnkit.append_kv_cache(k[:prefix], v[:prefix], kc, vc, slot[:prefix])
    attnkit.append_kv_cache(k[prefix:], v[prefix:], kc, vc, slot[prefix:])
    out = attnkit.paged_attention(q, kc, vc, table, np.array([n], np.int32), cu([chunk]))
    dense = attnkit.attention(q.transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None],
                              causal="bottom_right", enable_gqa=True)[0].transpose(1, 0, 2)
    atol, rtol = tolerance(dtype, "out", magnitude=np.abs(to_f64(dense)) + 1)
    assert_close(out, to_f64(dense), atol * 2, rtol * 2)


def test_interleaved_kv_views(rng):
    """K and V as views of one buffer that share no element (FlashInfer's paged layout
    [num_blocks, 2, block_size, H, D]; FlashAttention's kvpacked gradients [total_k, 2, H, D])
    are not aliases: append, attend and the varlen backward accept them."""
    nb, bs, hkv, d = 4, 5, 2, 8
    kv = np.full((nb, 2, bs, hkv, d), np.nan, np.float32)
    k, v = randn(rng, (7, hkv, d), "float32"), randn(rng, (7, hkv, d), "float32")
    slots = np.array([3, 7, 19, 0, 12, 11, 2], np.int64)
    attnkit.append_kv_cache(k, v, kv[:, 0], kv[:, 1], slots)
    for half, src in ((0, k), (1, v)):
        want = np.full((nb, bs, hkv, d), np.nan, np.float32)
        want[slots // bs, slots % bs] = src
        np.testing.assert_array_equal(kv[:, half], want)
    q = randn(rng, (2, 4, d), "float32")
    table = np.array([[0, 2, 1, 3]], np.int32)
    packed = attnkit.paged_attention(q, kv[:, 0], kv[:, 1], table, np.array([20], np.int32), cu([2]))
    apart = attnkit.paged_attention(q, kv[:, 0].copy(), kv[:, 1].copy(), table, np.array([20], np.int32), cu([2]))
    np.testing.assert_array_equal(packed, apart)

    q, kvp = randn(rng, (3, 4, d), "float32"), randn(rng, (5, 2, hkv, d), "float32")
    cq, ck = cu([3]), cu([5])
    o, lse = attnkit.varlen_attention(q, kvp[:, 0], kvp[:, 1], cq, ck, return_lse=True)
    do = randn(rng, o.shape, "float32")
    dkv = np.full((5, 2, hkv, d), np.nan, np.float32)
    _, dk, dv = attnkit.varlen_attention_backward(q, kvp[:, 0], kvp[:, 1], o, lse, do, cq, ck, dk=dkv[:, 0],
                                                  dv=dkv[:, 1])
    _, dk_apart, dv_apart = attnkit.varlen_attention_backward(q, kvp[:, 0], kvp[:, 1], o, lse, do, cq, ck)
    np.testing.assert_array_equal(dkv[:, 0], dk_apart)
    np.testing.assert_array_equal(dkv[:, 1], dv_apart)


def test_huge_blocks_of_a_broadcast_cache():
    """max_blocks · block_size past int64 (a stride-0 cache of 2**62-key blocks) saturates."""
    torch = pytest.importorskip("torch")
    cache = torch.ones(1, 1, 1, 1).expand(1, 2**62, 1, 1)
    for max_blocks in (1, 2, 4):
        out = attnkit.paged_attention(torch.ones(1, 1, 1), cache, cache, torch.zeros(1, max_blocks, dtype=torch.int32),
                                      torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
        assert out.flatten().tolist() == [1.0]


def test_layouts_without_strides_are_value_errors(rng):
    torch = pytest.importorskip("torch")
    q = torch.ones(2, 1, 4)
    with pytest.raises(ValueError, match="q must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"):
        attnkit.varlen_attention(q.to_sparse(), q, q, torch.tensor([0, 2], dtype=torch.int32),
                                 torch.tensor([0, 2], dtype=torch.int32))
    buf = np.zeros(256, np.uint8)
    odd = np.ndarray((2, 1, 4), np.float32, buf.data, offset=0, strides=(18, 16, 4))  # 18-byte rows
    qn = np.ones((2, 1, 4), np.float32)
    with pytest.raises(ValueError, match="q must have strides that are whole elements, got byte strides"):
        attnkit.varlen_attention(odd, qn, qn, cu([2]), cu([2]))


# ---- errors

def _varlen_args(rng):
    q = randn(rng, (6, 4, 8))
    k = randn(rng, (9, 2, 8))
    return dict(q=q, k=k, v=randn(rng, (9, 2, 8)), cu_seqlens_q=cu([2, 4]), cu_seqlens_k=cu([3, 6]))


VARLEN_ERRORS = [
    (dict(cu_seqlens_q=np.array([1, 2, 6], np.int32)), "cu_seqlens_q[0] must be 0, got 1"),
    (dict(cu_seqlens_q=np.array([0, 5, 4, 6], np.int32), cu_seqlens_k=cu([3, 3, 3])),
     "cu_seqlens_q must be non-decreasing"),
    (dict(cu_seqlens_k=np.array([0, 3, 8], np.int32)), "cu_seqlens_k[B] must equal total_k=9, got 8"),
    (dict(cu_seqlens_k=cu([9])), "cu_seqlens_k must have B + 1 = 3 elements, got 2"),
    (dict(cu_seqlens_q=np.array([0, 2, 6], np.int64)), "cu_seqlens_q must be int32, got int64"),
    (dict(max_seqlen_q=3), "max_seqlen_q must be at least the longest query sequence (4), got 3"),
    (dict(max_seqlen_k=5), "max_seqlen_k must be at least the longest key sequence (6), got 5"),
    (dict(k=np.zeros((9, 3, 8), np.float32), v=np.zeros((9, 3, 8), np.float32)),
     "GQA/MQA requires query heads to be a multiple of KV heads, got q_heads=4 and kv_heads=3"),
    (dict(q=np.zeros((6, 4), np.float32)), "q must be a 3-d tensor [total_q, Hq, D], got 2-d [6, 4]"),
    (dict(scale=1e39), "scale must be finite, got 1e+39 (inf in float32"),
    (dict(causal="yes"), "causal must be True or False, got 'yes'"),
    (dict(max_seqlen_q=2**63), "max_seqlen_q must fit int64, got 9223372036854775808"),
    (dict(window=(2**63, 0)), "window must be a pair of ints that fit int64"),
    (dict(v=np.zeros((8, 2, 8), np.float32)), "v must have shape [9, 2, Dv] (total_k, Hkv from k), got [8, 2, 8]"),
    (dict(v=np.zeros((9, 2, 8), np.float16)), "v must have q's dtype float32, got float16"),
    (dict(k=np.zeros((9, 2, 7), np.float32)), "k head dim must equal q's D=8, got 7"),
    (dict(v=np.zeros((9, 2, 513), np.float32)), "v head dim Dv must be in [1, 512], got 513"),
    (dict(out=np.zeros((6, 4, 9), np.float32)), "out must have shape [6, 4, 8] ([total_q, Hq, Dv]), got [6, 4, 9]"),
    (dict(cu_seqlens_q=np.zeros(0, np.int32)), "cu_seqlens_q must have B + 1 >= 1 elements, got 0"),
]


@pytest.mark.parametrize("change, message", VARLEN_ERRORS)
def test_varlen_errors(rng, change, message):
    args = _varlen_args(rng)
    args.update(change)
    with pytest.raises(ValueError, match=re.escape(message)):
        attnkit.varlen_attention(**args)


def _paged_args(rng):
    kc, vc, table = random_paged_batch(rng, [1, 2], [20, 10], 8, 2, 16, 16, "float32", share=False)
    return dict(q=randn(rng, (3, 4, 16)), k_cache=kc, v_cache=vc, block_table=table,
                seq_lens=np.array([20, 10], np.int32), cu_seqlens_q=cu([1, 2]))


def test_paged_errors(rng):
    def expect(message, **change):
        args = _paged_args(rng)
        args.update(change)
        with pytest.raises(ValueError) as info:
            attnkit.paged_attention(**args)
        assert message in str(info.value), (message, str(info.value))

    base = _paged_args(rng)
    bad = base["block_table"].copy()
    bad[0, 1] = base["k_cache"].shape[0]
    expect(f"block_table[0, 1] must be a block in [0, num_blocks={base['k_cache'].shape[0]})", block_table=bad)
    bad = base["block_table"].copy()
    bad[1, 0] = -1
    expect("block_table[1, 0] must be a block in [0, num_blocks", block_table=bad)
    expect("seq_lens[1] must be at least the sequence's query count 2", seq_lens=np.array([20, 1], np.int32))
    expect("seq_lens[0] must be at most max_blocks * block_size", seq_lens=np.array([1000, 10], np.int32))
    expect("seq_lens must have B=2 elements", seq_lens=np.array([20], np.int32))
    expect("k_cache must have q's dtype float32 or be float8_e4m3fn or float8_e5m2, got float16",
           k_cache=base["k_cache"].astype(np.float16), v_cache=base["v_cache"].astype(np.float16))
    expect("v_cache must have k_cache's dtype float32, got float16", v_cache=base["v_cache"].astype(np.float16))
    expect("k_scale must have shape [] or [1] (per tensor) or [Hkv] = [2]", k_scale=np.ones(3, np.float32))
    expect("v_scale must be finite and positive, got nan", v_scale=np.float32("nan"))
    expect("k_scale must be float32, got float16", k_scale=np.ones(2, np.float16))
    expect("block_size (k_cache dim 1) must be at least 1", k_cache=np.zeros((4, 0, 2, 16), np.float32),
           v_cache=np.zeros((4, 0, 2, 16), np.float32))
    expect("block_table must be int32, got int64", block_table=base["block_table"].astype(np.int64))
    expect("k_scale must be a float, got", k_scale=10**400)
    expect("k_cache head dim must equal q's D=16, got 15", k_cache=base["k_cache"][..., :15].copy())
    expect("v_cache head dim Dv must be in [1, 512], got 0", v_cache=np.zeros(base["v_cache"].shape[:3] + (0,), np.float32))
    nb, bs = base["v_cache"].shape[:2]
    expect(f"v_cache must have shape [{nb}, {bs}, 2, Dv]", v_cache=base["v_cache"][:, :, :1].copy())
    expect("out must have shape [3, 4, 16] ([total_q, Hq, Dv]), got [3, 4, 17]", out=np.zeros((3, 4, 17), np.float32))
    args = _paged_args(rng)
    with pytest.raises(ValueError, match="out must not alias q"):
        attnkit.paged_attention(**args, out=args["q"])


def test_append_errors(rng):
    k = randn(rng, (3, 2, 8))
    kc = np.zeros((2, 4, 2, 8), np.float32)

    def expect(message, **change):
        args = dict(k=k, v=k.copy(), k_cache=kc.copy(), v_cache=kc.copy(), slot_mapping=np.array([0, 1, -1], np.int32))
        args.update(change)
        with pytest.raises(ValueError) as info:
            attnkit.append_kv_cache(**args)
        assert message in str(info.value), (message, str(info.value))

    expect("slot_mapping[1] must be -1 (skip) or a slot in [0, num_blocks * block_size=8), got 8",
           slot_mapping=np.array([0, 8, -1], np.int32))
    expect("slot_mapping[2] must be -1 (skip) or a slot in [0, num_blocks * block_size=8), got -2",
           slot_mapping=np.array([0, 1, -2], np.int64))
    expect("slot_mapping must be int32 or int64, got float32", slot_mapping=np.zeros(3, np.float32))
    expect("k_cache must have shape [num_blocks, block_size, 2, 8]", k_cache=np.zeros((2, 4, 2, 9), np.float32))
    shared = np.zeros((2, 4, 2, 8), np.float32)
    expect("k_cache must not alias v_cache", k_cache=shared, v_cache=shared)
    flat = np.zeros(2 * 4 * 2 * 8 + 1, np.float32)   # v_cache one element past k_cache: they share elements
    expect("k_cache must not alias v_cache", k_cache=flat[:-1].reshape(2, 4, 2, 8), v_cache=flat[1:].reshape(2, 4, 2, 8))
    expect("v_scale must be a float, got", v_scale=10**400)
    expect("slot_mapping must have T=3 elements (k's tokens), got 2", slot_mapping=np.array([0, 1], np.int32))
    expect("v must have k's dtype float32, got float16", v=k.astype(np.float16))
    expect("v must have shape [3, 2, Dv] (T, Hkv from k), got [2, 2, 8]", v=k[:2].copy())
    expect("v_cache must have shape [2, 4, 2, 8]", v_cache=np.zeros((2, 4, 2, 9), np.float32))
    expect("k_cache must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got int32",
           k_cache=np.zeros((2, 4, 2, 8), np.int32), v_cache=np.zeros((2, 4, 2, 8), np.int32))

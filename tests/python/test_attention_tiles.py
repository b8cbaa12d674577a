"""Cases aimed at the tiled kernel's edges: key counts at the 128-key tile size ±1, query
rows at the 48-row task size ±1, causal diagonals crossing tiles, GQA groups wider than a
task (split into head chunks), masks that change exactly on tile borders, and decode
(Sq = 1, long Skv) where the keys are split across tasks and the partial softmax states
are merged."""

import numpy as np
import pytest

import attnkit
from conftest import DTYPES, assert_bits_equal, make_qkv, strided_like
from reference import assert_close, pv_magnitude, tolerance
from test_attention import run_checked

KV_TILE = 128  # keys per tile (src/cpu/attention_fwd.cpp)
ROW_TASK = 48  # query rows per task


@pytest.mark.parametrize("Skv", [KV_TILE - 1, KV_TILE, KV_TILE + 1, 2 * KV_TILE - 1, 2 * KV_TILE + 1])
@pytest.mark.parametrize("Sq", [1, ROW_TASK - 1, ROW_TASK, ROW_TASK + 1])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_tile_edges(rng, isa, Sq, Skv, causal):
    q, k, v = make_qkv(rng, 1, 2, 1, Sq, Skv, 32, 16)
    run_checked(q, k, v, dtype="float32", causal=causal, enable_gqa=True)


@pytest.mark.parametrize("Skv", [KV_TILE - 1, KV_TILE + 1, 2 * KV_TILE + 1])
@pytest.mark.parametrize("Dv", [7, 48, 130])
def test_prefill_pv_on_bf16_pairs(rng, isa, Skv, Dv):
    """bf16 P·V (on avx512bf16: key pairs, P rounded to bf16, each V tile interleaved):
    tiles of odd length (a lone last key), Dv off the vector width, V contiguous or strided
    in the head dim; with dropout (P paired after it) against the same call in float32, which
    keeps the same keys: kept probabilities are scaled by 1 / (1 - p), so is the bound."""
    q, k, v = make_qkv(rng, 1, 4, 2, 49, Skv, 32, Dv, "bfloat16")
    run_checked(q, k, v, dtype="bfloat16", enable_gqa=True, causal="bottom_right")
    run_checked(q, k, strided_like(v, rng)[0], dtype="bfloat16", enable_gqa=True)
    p = 0.3
    got = attnkit.attention(q, k, v, dropout_p=p, seed=9, enable_gqa=True)
    want = attnkit.attention(*(x.astype(np.float32) for x in (q, k, v)), dropout_p=p, seed=9, enable_gqa=True)
    magnitude = pv_magnitude(q, k, v, enable_gqa=True) / (1 - p)
    assert_close(got, want.astype(np.float64), *tolerance("bfloat16", magnitude=magnitude), "dropout")


@pytest.mark.parametrize("Hq,Hkv", [(64, 1), (96, 2), (20, 4), (48, 1), (49, 7)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_groups_straddling_tasks(rng, Hq, Hkv, dtype):
    """Groups of 16, 48, 64 or 5 heads: a task holds at most 48 rows, so big groups are
    split into head chunks and small ones into position blocks that end mid-group."""
    q, k, v = make_qkv(rng, 1, Hq, Hkv, 9, 70, 16, 24, dtype)
    run_checked(q, k, v, dtype=dtype, causal="bottom_right", enable_gqa=True)


@pytest.mark.parametrize("border", [KV_TILE - 1, KV_TILE, KV_TILE + 1])
def test_mask_on_tile_borders(rng, isa, border):
    """Keys visible only on one side of a tile border (both sides in turn), bool and float."""
    Sq, Skv = 5, 3 * KV_TILE
    q, k, v = make_qkv(rng, 2, 2, 2, Sq, Skv, 16, 16)
    j = np.arange(Skv)
    for keep in (j < border, j >= border):
        run_checked(q, k, v, dtype="float32", mask=np.broadcast_to(keep, (Sq, Skv)).copy())
        additive = np.where(keep, 0.0, -1e30).astype(np.float32)[None, None, None, :]
        run_checked(q, k, v, dtype="float32", mask=additive)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Skv", [257, 1024, 1500, 4097])
def test_decode_split_keys(rng, isa, dtype, Skv):
    """Sq = 1 with long Skv: one row block per kv head, so the keys are split and merged."""
    q, k, v = make_qkv(rng, 1, 8, 2, 1, Skv, 64, 64, dtype)
    run_checked(q, k, v, dtype=dtype, enable_gqa=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_long_tasks(rng, isa, dtype):
    """Decode tasks long enough for the prefetch choice to be made (after 36 key blocks):
    16 kv heads give 16 row blocks, so the 1024 keys are not split."""
    q, k, v = make_qkv(rng, 1, 16, 16, 1, 1024, 64, 64, dtype)
    run_checked(q, k, v, dtype=dtype, enable_gqa=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_split_matches_unsplit(rng, dtype):
    """The same query row computed with the keys split (B = 1: one row block) and unsplit
    (B = 16: enough row blocks, no split) agrees within the float32 rounding of the merge."""
    q1, k1, v1 = make_qkv(rng, 1, 4, 1, 1, 2048, 64, 64, dtype)
    rep = lambda x: np.repeat(x, 16, axis=0)  # noqa: E731
    split, lse_split = attnkit.attention(q1, k1, v1, enable_gqa=True, return_lse=True)
    whole, lse_whole = attnkit.attention(rep(q1), rep(k1), rep(v1), enable_gqa=True, return_lse=True)
    for b in range(16):  # every batch element of the unsplit run is the same computation
        assert_bits_equal(whole[b], whole[0])
    tol = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    np.testing.assert_allclose(split[0].astype(np.float32), whole[0].astype(np.float32), atol=tol, rtol=tol)
    np.testing.assert_allclose(lse_split[0], lse_whole[0], atol=1e-6, rtol=1e-6)


def test_decode_split_bit_identical_across_threads(rng, restore_runtime):
    q, k, v = make_qkv(rng, 1, 4, 1, 1, 3000, 64, 64)
    runs = []
    for n in (1, 2):
        attnkit.set_num_threads(n)
        runs.append(attnkit.attention(q, k, v, enable_gqa=True, dropout_p=0.2, seed=9))
    assert_bits_equal(runs[0], runs[1])


def test_decode_split_with_empty_splits(rng):
    """A causal bottom-right decode row sees every key; a mask hiding all but the first few
    keys leaves most splits with nothing visible (their state must merge as empty)."""
    q, k, v = make_qkv(rng, 1, 2, 1, 1, 2048, 32, 32)
    mask = np.zeros((1, 2048), dtype=bool)
    mask[0, :3] = True
    run_checked(q, k, v, dtype="float32", mask=mask, causal="bottom_right", enable_gqa=True)
    mask[0, :] = False
    run_checked(q, k, v, dtype="float32", mask=mask, enable_gqa=True)


# Decode (at most 8 rows per task: Sq * group small) takes the key-block path: keys in
# blocks of one vector (16 on AVX-512, 8 on AVX2, 4 portable), scores row-major, K dotted
# on bf16 pairs on avx512bf16 (in place when D is a multiple of 32 with whole pairs), bf16
# V read in place when Dv is a multiple of two vectors.
KEY_BLOCK = 16


@pytest.mark.parametrize("Skv", [1, KEY_BLOCK - 1, KEY_BLOCK + 1, 2 * KEY_BLOCK + 1, 300])
@pytest.mark.parametrize("D,Dv", [(1, 1), (17, 33), (64, 32), (128, 96), (96, 48), (32, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_key_blocks(rng, isa, dtype, Skv, D, Dv):
    q, k, v = make_qkv(rng, 2, 8, 2, 1, Skv, D, Dv, dtype)
    run_checked(q, k, v, dtype=dtype, enable_gqa=True)


# Query rows go side by side in the key-block dot: up to 4 rows per vector on AVX-512 (2 on
# AVX2), fewer where a row would take more than 16 chunks of its vector (fp32 at D = 128 and
# 256, bf16 pairs at D = 256). Groups of 1, 2, 3 (a padded row) and 8 (two vectors of rows).
@pytest.mark.parametrize("Skv", [KEY_BLOCK + 1, 300])
@pytest.mark.parametrize("D,Dv", [(17, 33), (64, 32), (128, 96), (256, 64)])
@pytest.mark.parametrize("group", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_row_groupings(rng, isa, dtype, group, D, Dv, Skv):
    q, k, v = make_qkv(rng, 1, 2 * group, 2, 1, Skv, D, Dv, dtype)
    run_checked(q, k, v, dtype=dtype, enable_gqa=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_strided_kv(rng, isa, dtype):
    """Strided K and V (odd row strides, a step in the head dim): nothing read in place
    that is not laid out for it."""
    q, k, v = make_qkv(rng, 1, 4, 1, 1, 70, 64, 64, dtype)
    for _ in range(3):
        sk, sv = (strided_like(x, rng)[0] for x in (k, v))
        run_checked(q, sk, sv, dtype=dtype, enable_gqa=True)


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("border", [KEY_BLOCK - 1, KEY_BLOCK, KEY_BLOCK + 1])
def test_decode_masks_on_block_borders(rng, isa, causal, border):
    """Two positions of a 4-head group (8 rows, the key-block path) with a mask switching
    at a key-block border, under each causal convention."""
    Sq, Skv = 2, 3 * KEY_BLOCK + 5
    q, k, v = make_qkv(rng, 1, 4, 1, Sq, Skv, 32, 32, "bfloat16")
    keep = np.broadcast_to(np.arange(Skv) != border, (Sq, Skv)).copy()
    run_checked(q, k, v, dtype="bfloat16", mask=keep, causal=causal, enable_gqa=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_dropout_matches_prefill_rows(rng, isa, dtype):
    """Dropout keeps the same keys on the key-block path as on the tiled path: query row 0
    decoded alone equals row 0 of a 49-row prefill (no mask, so rows are independent),
    within the rounding of the two paths' different summation orders and of the output."""
    q, k, v = make_qkv(rng, 1, 4, 1, 49, 300, 64, 64, dtype)
    alone = attnkit.attention(q[:, :, :1], k, v, dropout_p=0.3, seed=5, enable_gqa=True)
    full = attnkit.attention(q, k, v, dropout_p=0.3, seed=5, enable_gqa=True)
    tol = {"float32": 2e-6, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    np.testing.assert_allclose(alone[:, :, 0].astype(np.float32), full[:, :, 0].astype(np.float32),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("D", [17, 32, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_k_in_place_or_packed(rng, isa, dtype, D):
    """Q·Kᵀ reads K rows in place when they allow it (fp32 of unit stride; bf16 rows that
    are whole pairs on avx512bf16) and packs them otherwise: contiguous K, odd D, and
    strided views (odd row strides, a step in the head dim) all agree with the reference."""
    q, k, v = make_qkv(rng, 1, 4, 2, 49, 200, D, 24, dtype)
    run_checked(q, k, v, dtype=dtype, enable_gqa=True, causal=True)
    for _ in range(2):
        run_checked(q, strided_like(k, rng)[0], v, dtype=dtype, enable_gqa=True)

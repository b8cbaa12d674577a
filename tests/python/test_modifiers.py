"""Score modifiers of attnkit.attention (sliding window, logit soft-cap, ALiBi, attention
sinks), alone and combined, with causal (both conventions), attn_mask and GQA, against the
float64 reference (reference.attention_ref) at the dtype tolerances of reference.py. The
shapes put window edges on tile borders (keys are tiled by 128) and run all three drivers:
the tile loop (many rows), decode's few-row path (<= 8 rows per task) and the kv-split path
(fewer than 16 row blocks: keys split in ranges of >= 512 and merged). Outputs are poisoned
with NaN; every invalid value is a ValueError naming the argument."""

import itertools

import numpy as np
import pytest

import attnkit
from conftest import (DTYPES, assert_bits_equal, assert_unmodified, make_mask, make_qkv,
                      np_dtype, poison, snapshot, to_torch)
from reference import assert_close, attention_ref, pv_magnitude, tolerance

KV_TILE = 128


def make_slopes(rng, B, Hq, per_batch=False):
    """ALiBi slopes: the usual geometric series 2^(-8 h / Hq), jittered, [Hq] or [B, Hq]."""
    base = 2.0 ** (-8.0 * (np.arange(Hq) + 1) / Hq)
    shape = (B, Hq) if per_batch else (Hq,)
    return (base * rng.uniform(0.5, 1.5, shape)).astype(np.float32)


def make_sinks(rng, Hq, specials=True):
    """Finite sinks around typical logit sizes; with specials, some heads +inf and -inf."""
    s = rng.normal(0.0, 2.0, Hq).astype(np.float32)
    if specials and Hq >= 3:
        s[0], s[1] = np.inf, -np.inf
    return s


def check(q, k, v, dtype, tol_scale=1.0, **kw):
    """attnkit.attention with return_lse on a NaN-poisoned out=, against the reference;
    inputs must stay unmodified. Returns (out, lse)."""
    mods = {n: kw[n] for n in ("window", "softcap", "alibi_slopes", "sinks") if n in kw}
    ref_kw = dict(attn_mask=kw.get("attn_mask"), causal=kw.get("causal", False),
                  scale=kw.get("scale"), enable_gqa=kw.get("enable_gqa", False),
                  layout=kw.get("layout", "BHSD"), **mods)
    ref_out, ref_lse = attention_ref(q, k, v, **ref_kw)
    before = snapshot(q, k, v, kw.get("attn_mask"), kw.get("alibi_slopes"), kw.get("sinks"))
    out = poison(ref_out.shape, np_dtype(dtype))
    got, lse = attnkit.attention(q, k, v, return_lse=True, out=out, **kw)
    assert got is out
    magnitude = pv_magnitude(q, k, v, **ref_kw)
    assert_close(got, ref_out, *tolerance(dtype, "out", tol_scale, magnitude), "out")
    assert_close(lse, ref_lse, *tolerance(dtype, "lse", tol_scale), "lse")
    assert_unmodified(before, (q, k, v, kw.get("attn_mask"), kw.get("alibi_slopes"), kw.get("sinks")))
    return got, lse


MODIFIERS = ("window", "softcap", "alibi", "sinks")
COMBOS = [c for n in (1, 2, 4) for c in itertools.combinations(MODIFIERS, n)]


def modifier_kwargs(rng, combo, B, Hq, Skv):
    kw = {}
    if "window" in combo:
        kw["window"] = (int(rng.integers(0, Skv // 2)), int(rng.integers(0, 20)))
    if "softcap" in combo:
        kw["softcap"] = float(rng.uniform(2.0, 8.0))
    if "alibi" in combo:
        kw["alibi_slopes"] = make_slopes(rng, B, Hq, per_batch=bool(rng.integers(2)))
    if "sinks" in combo:
        kw["sinks"] = make_sinks(rng, Hq)
    return kw


@pytest.mark.parametrize("combo", COMBOS, ids=["+".join(c) for c in COMBOS])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_alone_and_combined(rng, combo, causal, dtype):
    """Each modifier alone, in pairs and all four, GQA 6:2, Sq != Skv (so the conventions
    differ), logits scaled up so the soft-cap bends them."""
    B, Hq, Hkv, Sq, Skv = 2, 6, 2, 53, 181
    q, k, v = make_qkv(rng, B, Hq, Hkv, Sq, Skv, 40, 24, dtype, scale=1.6)
    check(q, k, v, dtype, causal=causal, enable_gqa=True, **modifier_kwargs(rng, combo, B, Hq, Skv))


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_all_with_attn_mask(rng, isa, mask_kind, layout):
    """All four with a bool or additive mask (added after the soft-cap), both layouts."""
    B, Hq, Hkv, Sq, Skv = 2, 4, 1, 70, 260
    q, k, v = make_qkv(rng, B, Hq, Hkv, Sq, Skv, 32, 32, "float32", layout=layout, scale=1.5)
    mask = make_mask(rng, mask_kind, (B, 1, Sq, Skv))
    check(q, k, v, "float32", attn_mask=mask, causal="bottom_right", enable_gqa=True, layout=layout,
          window=(150, 3), softcap=5.0, alibi_slopes=make_slopes(rng, B, Hq), sinks=make_sinks(rng, Hq))


LEFTS = [0, 1, 127, 128, 129, -1]
RIGHTS = [0, -1, 129]


@pytest.mark.parametrize("left", LEFTS)
@pytest.mark.parametrize("right", RIGHTS)
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_window_edges_tile_loop(rng, isa, left, right, causal):
    """Prefill: 48-row tasks; window edges at, one before and one past a 128-key tile."""
    q, k, v = make_qkv(rng, 1, 2, 1, 200, 390, 32, 16)
    check(q, k, v, "float32", causal=causal, enable_gqa=True, window=(left, right))


@pytest.mark.parametrize("Sq", [1, 3, 8])
@pytest.mark.parametrize("left", LEFTS + [600, 1100, 1700])
@pytest.mark.parametrize("right", [0, -1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_edges_decode_and_splits(rng, isa, Sq, left, right, dtype):
    """Few rows per task (decode's key blocks) and one row block, so the keys are split in
    ranges of >= 512 and merged: 4 over all 2100 keys, or as many as the window's span holds
    (1100: 2, 1700: 3), counted from the block's first visible key."""
    q, k, v = make_qkv(rng, 1, 1, 1, Sq, 2100, 64, 64, dtype)
    check(q, k, v, dtype, causal=False, window=(left, right))
    check(q, k, v, dtype, causal="bottom_right", window=(left, right),
          alibi_slopes=np.array([0.01], np.float32), sinks=np.array([1.5], np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_window_skips_whole_tiles(rng, isa, dtype):
    """Key tiles wholly left of a row block's window are never read: with NaN in K and V
    below key 256, the rows whose blocks start their window at or past 256 (query blocks
    of 48, or 64 on AMX tiles, from position 384: 384 - 100 >= 256, whose keys start at 284
    rounded down to 4, or to 256 on AMX's V slabs of 32 keys) are bit-identical; a read would
    make them NaN (P = 0 times V = NaN). The rows that do see those keys are NaN."""
    Sq = Skv = 600
    q, k, v = make_qkv(rng, 1, 2, 2, Sq, Skv, 32, 32, dtype)
    ref = attnkit.attention(q, k, v, causal=True, window=(100, -1))
    k[:, :, :256] = np.nan
    v[:, :, :256] = np.nan
    got = attnkit.attention(q, k, v, causal=True, window=(100, -1))
    assert_bits_equal(got[:, :, 384:], ref[:, :, 384:], "rows whose window starts past the NaN tiles")
    assert np.isnan(got[:, :, :356]).all()


@pytest.mark.parametrize("left", [1, 45, 700, -1])
@pytest.mark.parametrize("Sq,Skv", [(200, 255), (200, 289), (70, 2101)])
def test_window_bf16_v_prepared(rng, isa, Sq, Skv, left):
    """bf16 prefill with more rows per kv head than a task holds, so V's pairs are prepared
    once per call (on AMX tiles as Vᵀ's slabs of 32 keys, Oᵀ += Vᵀ · Pᵀ): window edges inside
    a slab (the block's keys then start on the slab border below, the keys before the edge
    masked), tiles that end mid-slab and on an odd key, and (Sq 70: two row blocks) keys
    split across tasks from the window's first slab."""
    q, k, v = make_qkv(rng, 1, 4, 2, Sq, Skv, 32, 48, "bfloat16")
    check(q, k, v, "bfloat16", causal="bottom_right", enable_gqa=True, window=(left, -1))
    check(q, k, v, "bfloat16", enable_gqa=True, window=(left, 3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap", [0.5, 30.0])
def test_softcap_large_logits(rng, isa, dtype, cap):
    """Logits of |s| up to ~100 (tanh saturated) and below the cap; tile loop and decode."""
    for Sq in (64, 2):
        q, k, v = make_qkv(rng, 1, 4, 4, Sq, 300, 64, 64, dtype, scale=3.5)
        check(q, k, v, dtype, softcap=cap, causal="bottom_right")
        check(q, k, v, dtype, softcap=cap, scale=1.0)


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("Sq", [1, 5, 100])
def test_alibi(rng, isa, per_batch, causal, Sq):
    """[Hq] and [B, Hq] slopes (strided too), with causal and with windows."""
    B, Hq, Hkv, Skv = 2, 4, 2, 700
    q, k, v = make_qkv(rng, B, Hq, Hkv, Sq, Skv, 32, 32)
    slopes = make_slopes(rng, B, Hq, per_batch)
    check(q, k, v, "float32", causal=causal, enable_gqa=True, alibi_slopes=slopes)
    strided = np.repeat(slopes, 2, axis=-1)[..., ::2]
    assert not strided.flags.c_contiguous
    check(q, k, v, "float32", causal=causal, enable_gqa=True, alibi_slopes=strided, window=(200, 30))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Sq", [1, 4, 60])
def test_sinks(rng, isa, dtype, Sq):
    """+inf (out = 0), -inf (no effect), large and small finite sinks; split and unsplit."""
    Hq = 6
    for Skv in (150, 1500):
        q, k, v = make_qkv(rng, 1, Hq, 3, Sq, Skv, 64, 32, dtype)
        sinks = make_sinks(rng, Hq)
        sinks[2], sinks[3] = 40.0, -40.0
        out, lse = check(q, k, v, dtype, enable_gqa=True, sinks=sinks, causal="bottom_right")
        assert (out[:, 0].astype(np.float32) == 0).all()
        plain, plain_lse = attnkit.attention(q, k, v, enable_gqa=True, causal="bottom_right", return_lse=True)
        assert_bits_equal(out[:, 1], plain[:, 1], "sink -inf")
        assert_bits_equal(lse, plain_lse, "lse excludes the sink")


def test_rows_that_see_no_key(rng, isa):
    """Rows outside every window (bottom-right, Sq > Skv; window (0, 0) before key 0) or fully
    masked: out 0 and lse -inf with every modifier, sinks included."""
    Hq, Sq, Skv = 3, 40, 20
    q, k, v = make_qkv(rng, 1, Hq, Hq, Sq, Skv, 16, 16)
    mask = np.ones((Sq, Skv), bool)
    mask[-1] = False
    kw = dict(softcap=3.0, alibi_slopes=make_slopes(rng, 1, Hq), sinks=make_sinks(rng, Hq))
    for causal, window in (("bottom_right", (5, -1)), (False, (0, 0)), (False, (3, 2))):
        out, lse = check(q, k, v, "float32", causal=causal, window=window, attn_mask=mask, **kw)
        empty = np.isneginf(lse)
        assert empty[..., : Sq - Skv - 2].all() and empty[..., -1].all()
        assert (out[empty] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_across_threads(rng, restore_runtime, dtype):
    """Bit-identical for 1, 2 and 3 threads: tile loop, decode and the kv split."""
    B, Hq, Hkv = 1, 4, 2
    for Sq, Skv in ((97, 400), (2, 2100)):
        q, k, v = make_qkv(rng, B, Hq, Hkv, Sq, Skv, 64, 64, dtype)
        kw = dict(window=(300, 7), softcap=4.0, alibi_slopes=make_slopes(rng, B, Hq),
                  sinks=make_sinks(rng, Hq), enable_gqa=True, return_lse=True)
        results = []
        for n in (1, 2, 3):
            attnkit.set_num_threads(n)
            results.append(attnkit.attention(q, k, v, **kw))
        for out, lse in results[1:]:
            assert_bits_equal(out, results[0][0])
            assert_bits_equal(lse, results[0][1], "lse")


def test_torch_path(rng):
    """torch tensors go through torch.ops.attnkit.attention / attention_out with the
    modifiers: bit-identical to the numpy path; the op passes opcheck."""
    torch = pytest.importorskip("torch")
    B, Hq, Hkv, Sq, Skv = 1, 4, 2, 9, 140
    q, k, v = make_qkv(rng, B, Hq, Hkv, Sq, Skv, 32, 32)
    kw = dict(window=(60, 2), softcap=4.0, alibi_slopes=make_slopes(rng, B, Hq, True),
              sinks=make_sinks(rng, Hq), enable_gqa=True, causal="bottom_right")
    want = attnkit.attention(q, k, v, **kw)
    tkw = {n: (to_torch(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    tq, tk, tv = map(to_torch, (q, k, v))
    assert_bits_equal(attnkit.attention(tq, tk, tv, **tkw), want)
    out = torch.full(want.shape, float("nan"))
    attnkit.attention(tq, tk, tv, out=out, **tkw)
    assert_bits_equal(out, want, "out=")
    compiled = torch.compile(lambda a, b, c: attnkit.attention(a, b, c, **tkw), fullgraph=True)
    assert_bits_equal(compiled(tq, tk, tv), want, "torch.compile")
    torch.library.opcheck(torch.ops.attnkit.attention.default,
                          (tq, tk, tv, None, 2, None, 0.0, None, True, "BHSD"),
                          dict(window_left=60, window_right=2, softcap=4.0,
                               alibi_slopes=tkw["alibi_slopes"], sinks=tkw["sinks"]))


def test_kinds_must_match(rng):
    torch = pytest.importorskip("torch")
    q, k, v = make_qkv(rng, 1, 2, 2, 3, 5, 8, 8)
    with pytest.raises(ValueError, match="sinks must be a numpy array like q"):
        attnkit.attention(q, k, v, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="alibi_slopes must be a torch tensor like q"):
        attnkit.attention(to_torch(q), to_torch(k), to_torch(v), alibi_slopes=np.zeros(2, np.float32))


BAD = [
    (dict(window=(-2, 0)), "window left must be -1 .unbounded. or >= 0, got -2"),
    (dict(window=(0, -7)), "window right must be -1 .unbounded. or >= 0, got -7"),
    (dict(window=(3,)), "window must be None or a pair"),
    (dict(window=5), "window must be None or a pair"),
    (dict(window=(1.0, 2)), "window must be None or a pair"),
    (dict(window=(True, 2)), "window must be None or a pair"),
    (dict(softcap=0.0), "softcap must be a finite number > 0"),
    (dict(softcap=-1.0), "softcap must be a finite number > 0"),
    (dict(softcap=float("nan")), "softcap must be a finite number > 0"),
    (dict(softcap=float("inf")), "softcap must be a finite number > 0"),
    (dict(softcap=1e-50), "softcap must be a finite number > 0"),
    (dict(softcap="5"), "softcap must be a float > 0 or None"),
    (dict(softcap=True), "softcap must be a float > 0 or None"),
    (dict(alibi_slopes=np.zeros(5, np.float32)), r"alibi_slopes must be float32 of shape \[4\] \(\[Hq\]\) or \[2, 4\]"),
    (dict(alibi_slopes=np.zeros((3, 4), np.float32)), r"alibi_slopes must be float32 .*got float32 of shape \[3, 4\]"),
    (dict(alibi_slopes=np.zeros((4, 1), np.float32)), r"alibi_slopes must be float32 .*got float32 of shape \[4, 1\]"),
    (dict(alibi_slopes=np.zeros(4, np.float64)), r"alibi_slopes .*float64"),
    (dict(alibi_slopes=np.zeros(4, np.float16)), r"alibi_slopes must be float32 .*got float16"),
    (dict(sinks=np.zeros((4, 1), np.float32)), r"sinks must be float32 of shape \[4\] \(\[Hq\]\), got float32 of shape \[4, 1\]"),
    (dict(sinks=np.zeros(2, np.float32)), r"sinks must be float32 of shape \[4\]"),
    (dict(sinks=np.zeros(4, np.int32)), r"sinks must be float32 .*got int32"),
    (dict(sinks=[0.0] * 4), "sinks must be a numpy array or a torch tensor"),
]


@pytest.mark.parametrize("kw,message", BAD, ids=[m[:40] for _, m in BAD])
def test_invalid_values(rng, kw, message):
    q, k, v = make_qkv(rng, 2, 4, 2, 3, 5, 8, 8)
    with pytest.raises(ValueError, match=message):
        attnkit.attention(q, k, v, enable_gqa=True, **kw)


def test_outputs_may_not_alias_the_modifiers(rng):
    q, k, v = make_qkv(rng, 1, 2, 2, 1, 5, 8, 2)
    out = np.zeros((1, 2, 1, 2), np.float32)
    with pytest.raises(ValueError, match="out.*sinks"):
        attnkit.attention(q, k, v, out=out, sinks=out.reshape(-1)[:2])
    with pytest.raises(ValueError, match="out.*alibi_slopes"):
        attnkit.attention(q, k, v, out=out, alibi_slopes=out.reshape(-1)[:2])


# Sage int8 honours the modifiers on its own logits: the accuracy contract of test_sage.py
# against exact attention with the same modifiers; fp4 refuses them.
COS_MIN, REL_L1_MAX, LSE_ATOL = 0.999, 0.02, 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("combo", [("window",), ("softcap",), ("alibi",), ("sinks",), MODIFIERS],
                         ids=["window", "softcap", "alibi", "sinks", "all"])
def test_sage_int8_honours_them(rng, isa, dtype, combo):
    B, Hq, Hkv, S = 1, 4, 2, 300
    q, k, v = make_qkv(rng, B, Hq, Hkv, S, S, 64, 64, dtype)
    k = (k.astype(np.float64) + rng.standard_normal((1, Hkv, 1, 64)) * 3).astype(k.dtype)  # smoothing matters
    kw = modifier_kwargs(rng, combo, B, Hq, S)
    if "sinks" in kw:
        kw["sinks"][0] = 0.0  # +inf would zero a head, which the cosine cannot judge
    out, lse = attnkit.sage_attention(q, k, v, causal=True, return_lse=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, causal=True, enable_gqa=True, **kw)
    g, r = np.asarray(out, np.float64).ravel(), ref.ravel()
    cos = g @ r / (np.linalg.norm(g) * np.linalg.norm(r))
    l1 = np.abs(g - r).sum() / np.abs(r).sum()
    assert cos >= COS_MIN and l1 <= REL_L1_MAX, f"cos {cos:.6f}, rel L1 {l1:.4f}"
    np.testing.assert_allclose(lse, ref_lse, atol=LSE_ATOL, rtol=0)


@pytest.mark.parametrize("kw,name", [(dict(window=(4, -1)), "window"), (dict(softcap=3.0), "softcap"),
                                     (dict(alibi_slopes=np.ones(2, np.float32)), "alibi_slopes"),
                                     (dict(sinks=np.ones(2, np.float32)), "sinks")])
def test_sage_fp4_refuses_them(rng, kw, name):
    q, k, v = make_qkv(rng, 1, 2, 2, 16, 16, 16, 16)
    with pytest.raises(ValueError, match=f'mode "fp4" does not support {name}'):
        attnkit.sage_attention(q, k, v, mode="fp4", **kw)
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        attnkit.sage_attention(q, k, v, softcap=-1.0)


# SGLang-shaped backends: the modifiers are impl extras; a backend that cannot honour one
# refuses it in validate (and so at construction).
def test_backends_validate_modifiers():
    from attnkit.backends import AttentionConfig, SageAttention3Backend, SageAttentionBackend, SDPABackend

    def cfg(**kw):
        return AttentionConfig(head_size=64, num_heads=8, num_kv_heads=8, dtype="float32", **kw)

    every = dict(window=(128, 0), softcap=30.0, alibi=True, sinks=True)
    assert cfg(**every).modifiers == ("window", "softcap", "alibi", "sinks")
    assert cfg(window=(-1, -1)).modifiers == ()
    assert SDPABackend.validate(cfg(**every)) == []
    assert SageAttentionBackend.validate(cfg(**every)) == []
    mha = SageAttention3Backend.validate(cfg(**every))
    assert len([r for r in mha if "for MHA" in r and "no score modifiers" in r]) == 4, mha
    gqa = AttentionConfig(head_size=64, num_heads=8, num_kv_heads=2, dtype="float32", **every)
    assert SageAttention3Backend.validate(gqa) == []  # the exact fallback honours them
    bad = SDPABackend.validate(cfg(window=(-3, 0), softcap=0.0))
    assert any("window must be None or a pair" in r and "(-3, 0)" in r for r in bad), bad
    assert any("softcap must be a finite float > 0" in r for r in bad), bad
    assert "window=(128, 0)" in SDPABackend.refusal_message(cfg(**every), ["x"])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_backends_honour_modifiers(rng, kind):
    """SDPA and SageAttention3's GQA fallback give attnkit.attention's result bit for bit;
    Sage int8 meets its accuracy contract; SageAttention3 MHA refuses at construction."""
    from attnkit.backends import SageAttention3Backend, SageAttentionBackend, SDPABackend

    B, S, Hq, Hkv, D = 1, 150, 8, 2, 64
    q, k, v = (x.transpose(0, 2, 1, 3).copy() for x in make_qkv(rng, B, Hq, Hkv, S, S, D, D))
    slopes, sinks = make_slopes(rng, B, Hq), make_sinks(rng, Hq, specials=False)
    if kind == "torch":
        q, k, v, slopes, sinks = map(to_torch, (q, k, v, slopes, sinks))
    mods = dict(window=(40, 0), softcap=5.0, alibi_slopes=slopes, sinks=sinks)
    args = dict(num_heads=Hq, head_size=D, causal=True, softmax_scale=None, num_kv_heads=Hkv, **mods)
    want = attnkit.attention(q, k, v, causal=True, enable_gqa=True, layout="BSHD", **mods)
    assert_bits_equal(SDPABackend.get_impl_cls()(**args).forward(q, k, v), want)
    assert_bits_equal(SageAttention3Backend.get_impl_cls()(**args).forward(q, k, v), want)
    got = SageAttentionBackend.get_impl_cls()(**args).forward(q, k, v)
    g, r = (np.asarray(x, np.float64).ravel() for x in (got, want))
    assert g @ r / (np.linalg.norm(g) * np.linalg.norm(r)) >= COS_MIN
    with pytest.raises(ValueError, match="sinks is not supported by SageAttention3Backend for MHA"):
        SageAttention3Backend.get_impl_cls()(**dict(args, num_kv_heads=Hq))

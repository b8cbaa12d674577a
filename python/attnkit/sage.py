"""SageAttention-style quantized attention."""

from . import _C
from ._arrays import FLOAT, MASK, dtype_name, empty_like_kind, kind_of, typed, typed_or_none, typed_output
from .ops import attention_shapes, causal_code, check_kinds, check_scalars, check_softcap, flag, window_pair

_MODES = ("int8", "int8_pv_int8", "fp4")


def run_sage(q, k, v, causal, scale, layout, mode, out, lse, window=(-1, -1), softcap=None,
             alibi_slopes=None, sinks=None, attn_mask=None, kv_lens=None):
    """Calls the kernel on checked kinds; out (and lse, if not None) are caller-owned."""
    _C.sage_attention(typed(q, "q"), typed(k, "k"), typed(v, "v"), typed_output(out, "out"),
                      None if lse is None else typed_output(lse, "lse", "float32"), causal, scale,
                      layout, mode, window[0], window[1], softcap,
                      typed_or_none(alibi_slopes, "alibi_slopes", "float32"), typed_or_none(sinks, "sinks", "float32"),
                      typed_or_none(attn_mask, "attn_mask", MASK), typed_or_none(kv_lens, "kv_lens", "int32"))


def sage_attention(q, k, v, *, causal=False, scale=None, layout="BHSD", mode="int8", return_lse=False,
                   window=None, softcap=None, alibi_slopes=None, sinks=None, attn_mask=None, kv_lens=None):
    """Quantized attention with attnkit.attention's shapes and semantics (no dropout;
    GQA/MQA served natively when Hq is a multiple of Hkv).

    mode "int8" — SageAttention2's recipe adapted to this CPU:
    - K is smoothed by subtracting its per-(batch, kv head) mean over tokens: softmax is
      invariant to it, and the returned lse is corrected back by scale · q·mean.
    - Q and K are quantised to int8 per row (token and head), each with scale max|x| / 127
      and round-to-nearest-even (SageAttention quantises K per block of keys; per key, one
      large key or a heavy-tailed K no longer coarsens its neighbours).
    - Q·Kᵀ is an exact integer dot product: AVX512-VNNI vpdpbusd on the avx512bf16 and
      avx512vnni variants (K stored + 128 as its unsigned operand, corrected by 128·Σq),
      AMX tdpbusd on avx512amx, fp32 FMAs on integers below 2^24 on avx512, avx2 and
      generic, so every ISA gets the same integers.
    - Scores are dequantised (q scale · k scale · softmax scale) into the fp32 online softmax.
    - P·V: on avx512bf16 and avx512vnni, P and V rounded to bf16 and multiplied with
      vdpbf16ps (fp32 sums; 1.75× the fp32 FMA rate on Zen 4), on avx512amx with tdpbf16ps;
      fp32 on avx512, avx2 and generic. The quantisation of K is one
      pass over K per call; Q is quantised inside the kernel.
    mode "int8_pv_int8" — mode "int8" with P·V on int8 too, the CPU counterpart of
    SageAttention2's quantised P·V (sageattn_qk_int8_pv_fp8: there P and V are fp8 on the
    GPU; here u8 × s8 for vpdpbusd). On a Zen 4 it takes 0.82-0.88× the time of mode "int8"
    and runs 1.4× faster than exact bf16 attention (BENCHMARKS.md; short of the 2× aimed
    at: its products run near vpdpbusd's peak, its softmax and quantisation passes do not
    shrink with them):
    - V is smoothed by subtracting its per-(batch, kv head, channel) mean over tokens (added
      back exactly after the normalisation: Σ p (v - mean) / l + mean = Σ p v / l), then
      quantised to int8 per tile of 128 keys and channel (scale max|v - mean| / 127 over
      the tile), once per call. Each tile's outlier row (a token with a massive activation:
      the row whose |v - mean|, over the channels where it is the tile's largest, exceeds the
      next row's by the largest product of ratios, at least 4) is left out of the mean and
      the scales, and its products are added exactly in fp32. One row per tile: two large
      rows in the same 128 keys leave the second in the scales (rows 0 and 3 at 1000x, Skv
      300: rel L1 0.138, where mode "int8" gives 0.008; at 20x 0.020).
    - P (in [0, 1] after the online softmax's max subtraction) is split per row and tile of
      128 keys: its largest value (the key attention concentrates on) stays exact in fp32
      (times that key's V codes), the rest is quantised to u8 with step (second largest) /
      255. The tile's P is final when it is quantised, so a rise of the running max (the
      rescale by alpha of the earlier tiles' fp32 sums) never re-quantises anything.
    - P·V is an exact integer dot product per tile (vpdpbusd on avx512bf16 and avx512vnni,
      tdpbusd on avx512amx, fp32 FMAs on integers below 2^24 elsewhere: every ISA gets the
      same integers), dequantised by the
      row's P scale into fp32 accumulators; the row sums l are of the unquantised P.
    - Rows of V holding a NaN or inf are exact rows too, so NaN and inf propagate as in
      exact attention.
    mode "fp4" — SageAttention3's numerics (sageattn3_blackwell), emulated exactly in double
    precision so a model's quality under SageAttention3 can be checked on a CPU; speed is
    secondary (scalar code, one thread per head). K smoothed by its token mean, Q by the
    mean of each 128-row block (its product with K added back to the scores), Q and K
    quantised to NVFP4 along D and V along tokens (E2M1 values, one E4M3 scale per 16
    elements, round to nearest even, saturating), 128×128 tiles with key tiles in reverse
    order, and P quantised with SageAttention3's two-level scaling (P~ = 2688·e^(s-m) per row,
    per 16 keys a scale max(P~)/6). Needs D a multiple of 16 and Dv == D. The spec, with its
    sources and open questions, is docs/sage_fp4.md; lse is that of the FP4 logits.

    Accuracy (modes "int8" and "int8_pv_int8", against exact attention, per head): cosine
    >= 0.999 and relative L1 <= 0.02 on random inputs, with outlier channels in K and V, one
    key 20x the others, one value row 20x the others, and on all-MiniLM-L6-v2's activations
    (tests). Measured outside it (worst head of 4 seeds, same on every ISA): logits of
    standard deviation 4 (q 4x) rel L1 0.019 / 0.021 (int8 / int8_pv_int8); heavy-tailed K
    (Student t, 4 degrees) 0.024 / 0.026; a few query rows 100x the others cos 0.985; one key
    50x the others cos 0.9989. Use exact attention there.

    Score modifiers (window, softcap, alibi_slopes, sinks): as in attnkit.attention, honoured
    by modes "int8" and "int8_pv_int8" (the soft-cap acts on the logits with the K smoothing
    added back, so it sees the same logits as attention); mode "fp4" refuses them (ValueError).

    Masks (modes "int8" and "int8_pv_int8"; "fp4" refuses them): attn_mask as in
    attnkit.attention (bool, True = attend, or additive float, broadcastable to
    [B, Hq, Sq, Skv]); kv_lens, int32 [B] with values in [0, Skv]: batch b sees keys
    j < kv_lens[b] only, as a key-padding mask would (the causal alignment stays Skv's), and
    keys past it are never read (they may hold anything) — a padded batch in one call. A
    row that sees no key gets out 0 and lse -inf, as in attnkit.attention.

    Inputs: numpy arrays or CPU torch tensors (torch goes through
    torch.ops.attnkit.sage_attention). Returns out, or (out, lse) with return_lse=True.
    """
    code = causal_code(causal)
    scale, _ = check_scalars(scale, 0.0, None, layout)
    return_lse = flag(return_lse, "return_lse")
    if mode not in _MODES:
        raise ValueError(f'mode must be "int8", "int8_pv_int8" or "fp4", got {mode!r}')
    window, softcap = window_pair(window), check_softcap(softcap)
    kind = kind_of(q, "q")
    check_kinds(kind, (("k", k), ("v", v), ("alibi_slopes", alibi_slopes), ("sinks", sinks),
                       ("attn_mask", attn_mask), ("kv_lens", kv_lens)), ("k", "v"))
    if kind == "torch":
        from . import _torch_ops
        out, lse = _torch_ops.sage_attention(q, k, v, code, scale, layout, mode, window, softcap,
                                             alibi_slopes, sinks, attn_mask, kv_lens)
        return (out, lse) if return_lse else out
    out_shape, lse_shape = attention_shapes(q, k, v, layout)
    out = empty_like_kind("numpy", out_shape, dtype_name(q, "q", FLOAT))
    lse = empty_like_kind("numpy", lse_shape, "float32") if return_lse else None
    run_sage(q, k, v, code, scale, layout, mode, out, lse, window, softcap, alibi_slopes, sinks, attn_mask,
             kv_lens)
    return (out, lse) if return_lse else out

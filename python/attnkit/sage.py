"""SageAttention-style quantized attention."""

from . import _C
from ._arrays import FLOAT, dtype_name, empty_like_kind, kind_of, typed, typed_output
from .ops import attention_shapes, causal_code, check_kinds, check_scalars, flag

_MODES = ("int8", "fp4")


def run_sage(q, k, v, causal, scale, layout, mode, out, lse):
    """Calls the kernel on checked kinds; out (and lse, if not None) are caller-owned."""
    _C.sage_attention(typed(q, "q"), typed(k, "k"), typed(v, "v"), typed_output(out, "out"),
                      None if lse is None else typed_output(lse, "lse", "float32"), causal, scale,
                      layout, mode)


def sage_attention(q, k, v, *, causal=False, scale=None, layout="BHSD", mode="int8", return_lse=False):
    """Quantized attention with attnkit.attention's shapes and semantics (no mask, no
    dropout; GQA/MQA served natively when Hq is a multiple of Hkv).

    mode "int8" — SageAttention2's recipe adapted to this CPU:
    - K is smoothed by subtracting its per-(batch, kv head) mean over tokens: softmax is
      invariant to it, and the returned lse is corrected back by scale · q·mean.
    - Q is quantised to int8 per row (token and head), K per tile of 128 keys, each with
      scale max|x| / 127 and round-to-nearest-even.
    - Q·Kᵀ is an exact integer dot product: AVX512-VNNI vpdpbusd on the avx512bf16 variant
      (K stored + 128 as its unsigned operand, corrected by 128·Σq), fp32 FMAs on integers
      below 2^24 elsewhere, so every ISA gets the same integers.
    - Scores are dequantised (q scale · k scale · softmax scale) into the fp32 online softmax.
    - P·V: on avx512bf16, P and V rounded to bf16 and multiplied with vdpbf16ps (fp32
      sums; 1.75× the fp32 FMA rate there); elsewhere fp32. The quantisation of K is one
      pass over K per call; Q is quantised inside the kernel.
    mode "fp4" — SageAttention3's numerics (sageattn3_blackwell), emulated exactly in double
    precision so a model's quality under SageAttention3 can be checked on a CPU; speed is
    secondary (scalar code, one thread per head). K smoothed by its token mean, Q by the
    mean of each 128-row block (its product with K added back to the scores), Q and K
    quantised to NVFP4 along D and V along tokens (E2M1 values, one E4M3 scale per 16
    elements, round to nearest even, saturating), 128×128 tiles with key tiles in reverse
    order, and P quantised with SageAttention3's two-level scaling (P~ = 2688·e^(s-m) per row,
    per 16 keys a scale max(P~)/6). Needs D a multiple of 16 and Dv == D. The spec, with its
    sources and open questions, is docs/sage_fp4.md; lse is that of the FP4 logits.

    Inputs: numpy arrays or CPU torch tensors (torch goes through
    torch.ops.attnkit.sage_attention). Returns out, or (out, lse) with return_lse=True.
    """
    code = causal_code(causal)
    scale, _ = check_scalars(scale, 0.0, None, layout)
    return_lse = flag(return_lse, "return_lse")
    if mode not in _MODES:
        raise ValueError(f'mode must be "int8" or "fp4", got {mode!r}')
    kind = kind_of(q, "q")
    check_kinds(kind, (("k", k), ("v", v)), ("k", "v"))
    if kind == "torch":
        from . import _torch_ops
        out, lse = _torch_ops.sage_attention(q, k, v, code, scale, layout, mode)
        return (out, lse) if return_lse else out
    out_shape, lse_shape = attention_shapes(q, k, v, layout)
    out = empty_like_kind("numpy", out_shape, dtype_name(q, "q", FLOAT))
    lse = empty_like_kind("numpy", lse_shape, "float32") if return_lse else None
    run_sage(q, k, v, code, scale, layout, mode, out, lse)
    return (out, lse) if return_lse else out

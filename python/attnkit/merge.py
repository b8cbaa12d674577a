"""merge_attention_states: partial attentions over disjoint key sets combined exactly by
their log-sum-exp (FlashInfer's merge_state, natural-log lse)."""

from . import _C
from ._arrays import empty_like_kind, kind_of, typed, typed_output


def merge_shapes(out_a, lse_a=None):
    """(out shape, lse shape) of a merge of out_a; the C++ op checks everything else."""
    if len(out_a.shape) < 2:
        raise ValueError("out_a must have at least 2 dims [..., Dv] (e.g. [T, H, Dv] or [B, H, S, Dv]), "
                         f"got {len(out_a.shape)}-d {list(out_a.shape)}")
    return tuple(out_a.shape), tuple(out_a.shape[:-1])


def run_merge(out_a, lse_a, out_b, lse_b, out, lse_out):
    """Calls the kernel; every argument is already of one kind and the outputs exist."""
    _C.merge_attention_states(typed(out_a, "out_a"), typed(lse_a, "lse_a", "float32"), typed(out_b, "out_b"),
                              typed(lse_b, "lse_b", "float32"), typed_output(out, "out"),
                              typed_output(lse_out, "lse_out", "float32"))


def merge_attention_states(out_a, lse_a, out_b, lse_b, *, out=None, lse_out=None):
    """Combines two partial attentions of the same queries over disjoint key sets A and B
    into the attention over A ∪ B, exactly (up to float32 rounding), by their lse.

    Shapes: out_a, out_b [..., Dv] (2 to 6 dims) with lse_a, lse_b float32 of out's shape
    minus Dv: the varlen layout [T, H, Dv] with lse [T, H], or attnkit.attention's
    [B, H, S, Dv] with lse [B, H, S]. Any strides: for attention's layout="BSHD" output
    [B, S, H, Dv] pass out.transpose(1, 2) (a view) with its lse [B, H, S]. out_a, out_b
    and out may each be float32, float16 or bfloat16 (e.g. a float32 accumulator merging
    bfloat16 parts); out defaults to out_a's dtype, lse_out is float32.

    Per row, with m = max(lse_a, lse_b) and w_x = exp(lse_x - m) (a part equal to m weighs
    exactly 1, so ±inf need no inf - inf):
        out     = (w_a · out_a + w_b · out_b) / (w_a + w_b)
        lse_out = m + log(w_a + w_b)
    computed in float32 (weights and lse in float64), out rounded once to its dtype.
    - A part whose weight w_x / (w_a + w_b) is 0 in float32 (lse -inf: it saw no key; or
      more than ~104 below the other) is never read,
      so its out may hold anything, NaN included (FlashInfer multiplies it by 0, which
      lets a NaN through).
    - Both -inf (the row saw no key in either part): out 0, lse_out -inf, attnkit.attention's
      convention for an empty row. (sparse_mla_prefill_fwd's empty rows carry lse +inf,
      FlashMLA's convention: map them to -inf before merging.) lse +inf dominates: out is
      that part (the mean of both when both are +inf), lse_out +inf. A NaN lse gives a NaN row.
    - lse is natural-log (attnkit.attention, FlashMLA, vLLM). FlashInfer's lse is base 2:
      multiply it by ln 2 first.

    out= / lse_out= are caller buffers of exactly those shapes and dtypes. out may be out_a
    or out_b and lse_out lse_a or lse_b (the same view: an in-place merge, as FlashInfer's
    merge_state_in_place); any other overlap is a ValueError. Inputs are numpy arrays or CPU
    torch tensors (torch through torch.ops.attnkit.merge_attention_states*), never modified
    unless they are also out / lse_out. Returns (out, lse_out).
    """
    kind = kind_of(out_a, "out_a")
    for x, name in ((lse_a, "lse_a"), (out_b, "out_b"), (lse_b, "lse_b"), (out, "out"), (lse_out, "lse_out")):
        if (x is not None or name in ("lse_a", "out_b", "lse_b")) and kind_of(x, name) != kind:
            raise ValueError(f"{name} must be a {kind} array like out_a, got {type(x).__name__}")
    if kind == "torch":
        from . import _torch_merge
        return _torch_merge.merge(out_a, lse_a, out_b, lse_b, out, lse_out)
    out_shape, lse_shape = merge_shapes(out_a)
    if out is None:
        out = empty_like_kind("numpy", out_shape, typed(out_a, "out_a")[1])
    if lse_out is None:
        lse_out = empty_like_kind("numpy", lse_shape, "float32")
    run_merge(out_a, lse_a, out_b, lse_b, out, lse_out)
    return out, lse_out

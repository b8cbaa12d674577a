"""merge_attention_states registered with torch.library (define + impl + register_fake):
a functional op, an out= op (caller buffers, mutated arguments) and an in-place op (out_a
and lse_a updated), so each form has an honest schema for torch.compile and opcheck."""

import torch

from ._torch_ops import register_grad_refusal
from .merge import merge_shapes, run_merge

_LIB = torch.library.Library("attnkit", "FRAGMENT")
_ARGS = "Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b"
_LIB.define(f"merge_attention_states({_ARGS}) -> (Tensor, Tensor)")
_LIB.define(f"merge_attention_states_out({_ARGS}, Tensor(a!) out, Tensor(b!) lse_out) -> ()")
_LIB.define("merge_attention_states_(Tensor(a!) out_a, Tensor(b!) lse_a, Tensor out_b, Tensor lse_b) -> ()")


def _functional_impl(out_a, lse_a, out_b, lse_b):
    out_shape, lse_shape = merge_shapes(out_a)
    out = torch.empty(out_shape, dtype=out_a.dtype)
    lse_out = torch.empty(lse_shape, dtype=torch.float32)
    run_merge(out_a, lse_a, out_b, lse_b, out, lse_out)
    return out, lse_out


def _functional_fake(out_a, lse_a, out_b, lse_b):
    out_shape, lse_shape = merge_shapes(out_a)
    return out_a.new_empty(out_shape), out_a.new_empty(lse_shape, dtype=torch.float32)


def _out_impl(out_a, lse_a, out_b, lse_b, out, lse_out):
    run_merge(out_a, lse_a, out_b, lse_b, out, lse_out)


def _inplace_impl(out_a, lse_a, out_b, lse_b):
    run_merge(out_a, lse_a, out_b, lse_b, out_a, lse_a)


def _no_result(*args):
    return None


_LIB.impl("merge_attention_states", _functional_impl, "CPU")
_LIB.impl("merge_attention_states_out", _out_impl, "CPU")
_LIB.impl("merge_attention_states_", _inplace_impl, "CPU")
torch.library.register_fake("attnkit::merge_attention_states", _functional_fake, lib=_LIB)
torch.library.register_fake("attnkit::merge_attention_states_out", _no_result, lib=_LIB)
torch.library.register_fake("attnkit::merge_attention_states_", _no_result, lib=_LIB)
for _name in ("merge_attention_states", "merge_attention_states_out", "merge_attention_states_"):
    register_grad_refusal(_name, _LIB)


def _same_view(x, y):
    if torch.compiler.is_compiling():  # dynamo cannot compare data pointers; the same tensor it can
        return x is y
    return (x.data_ptr() == y.data_ptr() and x.dtype == y.dtype and x.shape == y.shape
            and x.stride() == y.stride())


def merge(out_a, lse_a, out_b, lse_b, out, lse_out):
    """The torch path of attnkit.merge_attention_states (arguments already checked for kind)."""
    if out is None and lse_out is None:
        return torch.ops.attnkit.merge_attention_states(out_a, lse_a, out_b, lse_b)
    if out is not None and lse_out is not None:
        for acc, acc_lse, part, part_lse in ((out_a, lse_a, out_b, lse_b), (out_b, lse_b, out_a, lse_a)):
            if _same_view(out, acc) and _same_view(lse_out, acc_lse):
                torch.ops.attnkit.merge_attention_states_(acc, acc_lse, part, part_lse)
                return out, lse_out
    out_shape, lse_shape = merge_shapes(out_a)
    if out is None:
        out = torch.empty(out_shape, dtype=out_a.dtype)
    if lse_out is None:
        lse_out = torch.empty(lse_shape, dtype=torch.float32)
    torch.ops.attnkit.merge_attention_states_out(out_a, lse_a, out_b, lse_b, out, lse_out)
    return out, lse_out

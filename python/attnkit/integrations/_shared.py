"""What the integrations share: why attnkit cannot compute a call (their frameworks' own
kernels take it then), whether a call needs attnkit's backward, and the dropout seed, drawn
from torch's generator so that torch.manual_seed makes a training step reproducible
(attnkit's backward regenerates the keep mask from it)."""

import torch


def uncomputable_reason(query, value, tensors):
    """Why attnkit cannot compute attention over these tensors, or None."""
    if any(t.device.type != "cpu" for t in tensors):
        return f"tensors on {query.device.type}"
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {str(query.dtype).removeprefix('torch.')}"
    if query.shape[-1] > 512 or value.shape[-1] > 512:
        return "head dim over 512"
    return None


def needs_backward(*tensors):
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def dropout_seed(dropout_p):
    """None without dropout, and under torch.compile: the op then draws a seed at run time
    (never at trace time), which a call without backward needs no more than that."""
    if not dropout_p or torch.compiler.is_compiling():
        return None
    return int(torch.randint(0, 2**63 - 1, ()).item())


def compiled_dropout_reason(dropout_p, tensors):
    """Why a dropout call goes to the framework's kernel: under torch.compile no seed is drawn
    at trace time, and attnkit's backward would need the forward's."""
    if dropout_p and torch.compiler.is_compiling() and needs_backward(*tensors):
        return "dropout with inputs that require grad under torch.compile"
    return None

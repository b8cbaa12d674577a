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
    return int(torch.randint(0, 2**63 - 1, ()).item()) if dropout_p else None

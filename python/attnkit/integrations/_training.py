"""What the integrations share for training: whether a call needs attnkit's backward, and
the dropout seed, drawn from torch's generator so that torch.manual_seed makes a training
step reproducible (attnkit's backward regenerates the keep mask from it)."""

import torch


def needs_backward(*tensors):
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def dropout_seed(dropout_p):
    return int(torch.randint(0, 2**63 - 1, ()).item()) if dropout_p else None

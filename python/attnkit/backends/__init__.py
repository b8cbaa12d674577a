"""Attention backends in the shape of SGLang's diffusion-model attention backends.

- SDPABackend: exact attention (attnkit.attention).
- SageAttentionBackend: int8 quantized attention (attnkit.sage_attention(mode="int8")); no
  dropout.
- SageAttention3Backend: FP4 attention (attnkit.sage_attention(mode="fp4")) for MHA; GQA/MQA
  falls back to exact SDPA with a warning once per process.

Usage, as in SGLang::

    backend = attnkit.backends.select(head_size=128, num_heads=24, num_kv_heads=24,
                                      dtype="bfloat16", causal=False)  # exact: SDPABackend
    # allow_lossy=True lets select() pick the quantized SageAttentionBackend on its own
    impl = backend.get_impl_cls()(num_heads=24, head_size=128, causal=False,
                                  softmax_scale=None, num_kv_heads=24, dropout_p=0.0)
    out = impl.forward(q, k, v)  # [batch, seq, heads, head_dim], numpy or CPU torch

``Backend.validate(config)`` lists every reason a configuration is refused (empty = OK);
impls validate at construction and raise ValueError with those reasons.
"""

from .base import AttentionBackend, AttentionConfig, AttentionImpl, Capabilities
from .sage_attn import SageAttentionBackend, SageAttentionImpl, sage_kernel_status
from .sage_attn3 import (GQA_FALLBACK_WARNING, SageAttention3Backend, SageAttention3Impl,
                         fp4_kernel_available, fp4_kernel_status)
from .sdpa import SDPABackend, SDPAImpl
from .selector import BACKENDS, select

__all__ = ["AttentionBackend", "AttentionConfig", "AttentionImpl", "Capabilities",
           "SDPABackend", "SDPAImpl", "SageAttentionBackend", "SageAttentionImpl",
           "SageAttention3Backend", "SageAttention3Impl", "GQA_FALLBACK_WARNING",
           "fp4_kernel_available", "fp4_kernel_status", "sage_kernel_status", "BACKENDS", "select"]

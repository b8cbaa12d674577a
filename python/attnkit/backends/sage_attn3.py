"""SageAttention3Backend: FP4 quantized attention through attnkit.sage_attention(mode="fp4")
for MHA; GQA/MQA (num_heads != num_kv_heads) runs on exact SDPA instead, as in SGLang, with
a warning once per process.

Whether the fp4 kernel exists is found out at run time (fp4_kernel_status), so the day it
is built, MHA configurations stop being refused without any change here."""

import logging
import threading

from .base import (DTYPES, AttentionBackend, AttentionImpl, Capabilities,
                   gqa_divisibility_message)
from .sage_attn import sage_attention_op, sage_kernel_status

logger = logging.getLogger("attnkit")

GQA_FALLBACK_WARNING = ("SageAttention3 does not support GQA/MQA (Hq != Hkv); "
                        "falling back to exact SDPA.")


def fp4_kernel_status(refresh: bool = False):
    """(available, reason): whether attnkit.sage_attention(mode="fp4") runs (see
    sage_kernel_status); reason is None when available."""
    return sage_kernel_status("fp4", refresh)


def fp4_kernel_available() -> bool:
    """The capability flag: True once attnkit.sage_attention(mode="fp4") is built."""
    return fp4_kernel_status()[0]


class SageAttention3Impl(AttentionImpl):
    # Once per process, not per impl: a model builds one impl per attention layer.
    _warned_gqa_fallback_global = False
    _warn_lock = threading.Lock()

    def _compute(self, query, key, value):
        hq, hkv = query.shape[2], key.shape[2]
        if hq != hkv:
            if hq % hkv != 0:  # also checked in _check_tensors; kept next to the fallback
                raise ValueError(gqa_divisibility_message(hq, hkv))
            with SageAttention3Impl._warn_lock:
                if not SageAttention3Impl._warned_gqa_fallback_global:
                    SageAttention3Impl._warned_gqa_fallback_global = True
                    logger.warning(GQA_FALLBACK_WARNING)
            return self._exact(query, key, value)
        return sage_attention_op()(query, key, value, causal=self.causal,
                                   scale=self.softmax_scale, layout="BSHD", mode="fp4")


class SageAttention3Backend(AttentionBackend):
    name = "sage_attn3"
    aliases = ("sage_attn_3",)
    capabilities = Capabilities(
        head_sizes=(64, 128, 256), head_size_range=(64, 256), dtypes=DTYPES, gqa=True,
        causal=(False, True), dropout=False, deterministic=True, lossy=True,
        notes="MHA: fp4 kernel (SageAttention3 numerics, no dropout); GQA/MQA: exact SDPA "
              "fallback, which honours dropout_p; warns once per process")
    impl_cls = SageAttention3Impl

    @classmethod
    def _is_mha(cls, c):
        return c.num_heads == c.kv_heads

    @classmethod
    def _dropout_reason(cls, c):
        if not cls._is_mha(c):
            return None  # the exact SDPA fallback honours it
        return (f"dropout_p={c.dropout_p} > 0 is not supported by {cls.__name__} for MHA "
                "(num_heads == num_kv_heads): the fp4 kernel has no dropout; only GQA/MQA, "
                "served by the exact SDPA fallback, honours it")

    @classmethod
    def _extra_reasons(cls, c):
        if not cls._is_mha(c):
            return []
        available, why = fp4_kernel_status()
        if available:
            return []
        return [f"MHA (num_heads == num_kv_heads == {c.num_heads}) needs the SageAttention3 "
                f"fp4 kernel, which is not built: {why}"]


SageAttention3Impl.backend = SageAttention3Backend

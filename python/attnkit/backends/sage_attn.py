"""SageAttentionBackend: int8 quantized attention through attnkit.sage_attention(mode="int8")
(int8 Q/K with K smoothing, reduced-precision P·V). No dropout, so dropout_p > 0 is refused."""

import threading

from .base import DTYPES, AttentionBackend, AttentionImpl, Capabilities

_status = {}  # mode -> (available, reason), once attnkit.sage_attention exists
_lock = threading.Lock()


def sage_attention_op():
    """attnkit.sage_attention, or None where this build does not have it."""
    import attnkit
    return getattr(attnkit, "sage_attention", None)


def sage_kernel_status(mode: str, refresh: bool = False):
    """(available, reason): whether attnkit.sage_attention(mode=mode) runs here, found by
    one tiny probe call, cached per process (refresh=True probes again). A missing op, or
    any failure of the probe (e.g. ValueError "... not built", or an extension built
    without the kernel), means not available; reason says why (None when available)."""
    with _lock:
        if mode in _status and not refresh:
            return _status[mode]
        op = sage_attention_op()
        if op is None:  # not cached: the op may appear later in the process
            return False, "attnkit.sage_attention is not available in this build"
        import numpy as np
        q = np.full((1, 1, 128, 64), 0.125, dtype=np.float32)
        try:
            op(q, q, q, mode=mode)
            status = (True, None)
        except ValueError as e:
            msg = str(e)
            status = (False, msg if "not built" in msg else
                      f'attnkit.sage_attention(mode="{mode}") failed a probe call: {msg}')
        except Exception as e:  # noqa: BLE001 - any failure means "do not route here"
            status = (False, f'attnkit.sage_attention(mode="{mode}") failed a probe call: '
                             f'{type(e).__name__}: {e}')
        _status[mode] = status
        return status


class SageAttentionImpl(AttentionImpl):
    def _compute(self, query, key, value):
        return sage_attention_op()(query, key, value, causal=self.causal,
                                   scale=self.softmax_scale, layout="BSHD", mode="int8")


class SageAttentionBackend(AttentionBackend):
    name = "sage_attn"
    aliases = ()
    capabilities = Capabilities(
        head_sizes=None, head_size_range=(1, 512), dtypes=DTYPES, gqa=True,
        causal=(False, True, "top_left", "bottom_right"), dropout=False, deterministic=True, lossy=True,
        notes="quantized (int8 Q/K, reduced-precision P·V); accuracy contract: cosine "
              "similarity >= 0.999 against exact attention")
    impl_cls = SageAttentionImpl

    @classmethod
    def _extra_reasons(cls, c):
        available, why = sage_kernel_status("int8")
        return [] if available else [f"the int8 SageAttention kernel is not available: {why}"]


SageAttentionImpl.backend = SageAttentionBackend

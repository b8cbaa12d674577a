"""select(): an explicit backend that must serve the configuration, or the best one that does
(exact unless the caller opts into lossy, quantized backends)."""

import logging

from .base import AttentionBackend, AttentionConfig
from .sage_attn import SageAttentionBackend
from .sage_attn3 import SageAttention3Backend
from .sdpa import SDPABackend

logger = logging.getLogger("attnkit")

# Preference order for automatic selection: fastest first.
BACKENDS = (SageAttentionBackend, SDPABackend, SageAttention3Backend)


def _lookup(name):
    if isinstance(name, type) and issubclass(name, AttentionBackend):
        return name
    if isinstance(name, str):
        key = name.strip().lower()
        for b in BACKENDS:
            if key in (b.name, b.__name__.lower(), *b.aliases):
                return b
    known = ", ".join(f'"{n}"' for b in BACKENDS for n in (b.name, b.__name__, *b.aliases))
    raise ValueError(f"unknown attention backend {name!r}; known: {known}")


def select(name=None, *, head_size, num_heads, num_kv_heads, dtype, causal, dropout_p=0.0,
           allow_lossy=False):
    """The backend class for a configuration.

    name ("sdpa", "sage_attn", "sage_attn3", or a class name / class): that backend, or a
    ValueError listing every reason it cannot serve the configuration (it is never swapped
    for another). name=None: the first backend in BACKENDS that validates, among the exact
    ones only (SDPABackend) unless allow_lossy=True, which admits the quantized
    SageAttentionBackend (first: fastest) and SageAttention3Backend (last). The choice and
    the reasons each earlier backend was refused are logged at INFO on the "attnkit"
    logger. If none validates, ValueError with every candidate's reasons.

    The choice is for `dtype`: build the impl with the same dtype (``dtype=`` among its
    extra args) and its forward refuses tensors of any other dtype, which the chosen backend
    may not serve as well (or at all)."""
    config = AttentionConfig(head_size=head_size, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, dtype=dtype, causal=causal,
                             dropout_p=dropout_p)
    if not isinstance(allow_lossy, bool):
        raise ValueError(f"allow_lossy must be True or False, got {allow_lossy!r}")
    if name is not None:
        backend = _lookup(name)
        reasons = backend.validate(config)
        if reasons:
            raise ValueError(backend.refusal_message(config, reasons))
        logger.info("attention backend: %s (%s), requested explicitly, for %s",
                    backend.__name__, backend.name, config.describe())
        return backend
    refused = []
    for backend in BACKENDS:
        if backend.capabilities.lossy and not allow_lossy:
            refused.append((backend, ["lossy (quantized): pass allow_lossy=True to consider it"]))
            continue
        reasons = backend.validate(config)
        if not reasons:
            why = "; ".join(f"{b.__name__} refused: [{'; '.join(r)}]" for b, r in refused)
            logger.info("attention backend: chose %s (%s) for %s%s", backend.__name__,
                        backend.name, config.describe(),
                        f" ({why})" if why else " (first choice)")
            return backend
        refused.append((backend, reasons))
    raise ValueError(f"no attention backend can serve {config.describe()}:\n" + "\n".join(
        f"  {b.__name__}:\n" + "\n".join(f"    - {r}" for r in rs) for b, rs in refused))

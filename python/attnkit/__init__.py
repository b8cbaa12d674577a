"""attnkit: exact and quantized attention kernels for inference, CPU first.

Public API: :func:`attention` (PyTorch SDPA semantics), thread and ISA controls, and
``python -m attnkit info``; ``attnkit.torch`` (a drop-in for torch's SDPA and a scoped
override) and ``attnkit.integrations`` (transformers, diffusers). Arrays are numpy arrays (bf16/fp8 through ml_dtypes) or CPU
torch tensors, taken without copies; outputs come back in the input's kind.
"""

from . import _C
from .backward import attention_backward
from .merge import merge_attention_states
from . import dsa  # noqa: F401  (attnkit.dsa: DeepSeek sparse attention decode, indexer, top-k)
from .ops import attention
from .sage import sage_attention
from .serving import append_kv_cache, paged_attention, varlen_attention, varlen_attention_backward
from .sparse_mla import pad_heads, sparse_mla_prefill_fwd, sparse_mla_q8kv8_prefill_fwd, unpad_heads

__version__ = _C.version()
# Read ATTNKIT_NUM_THREADS and ATTNKIT_ISA now, so that a bad value is reported at import.
_C.get_num_threads()
_C.active_isa()


def __getattr__(name):
    """attnkit.torch, attnkit.integrations and attnkit.distributed load on first use: they
    import torch, which attnkit itself never does before a tensor reaches it."""
    if name in ("torch", "integrations", "distributed"):
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def set_num_threads(n: int) -> None:
    """Sets the number of threads every attnkit op uses (default: ATTNKIT_NUM_THREADS, else all cores)."""
    if not isinstance(n, int) or isinstance(n, bool):
        raise ValueError(f"num_threads must be an int, got {type(n).__name__}")
    _C.set_num_threads(n)


def get_num_threads() -> int:
    """The number of threads attnkit ops use."""
    return _C.get_num_threads()


def get_isa() -> str:
    """The CPU kernel variant in use: "avx512amx", "avx512bf16", "avx512vnni", "avx512",
    "avx2" or "generic" (supported_isas() lists those this CPU runs, best first)."""
    return _C.active_isa()


def supported_isas() -> list:
    """Kernel variants compiled in and runnable on this CPU, best first."""
    return _C.supported_isas()


def set_isa(name: str) -> None:
    """Selects a kernel variant (one of supported_isas()); ATTNKIT_ISA sets it at load."""
    _C.set_isa(name)


__all__ = ["attention", "attention_backward", "varlen_attention", "varlen_attention_backward", "paged_attention",
           "append_kv_cache", "merge_attention_states",
           "sage_attention", "sparse_mla_prefill_fwd", "sparse_mla_q8kv8_prefill_fwd", "pad_heads",
           "unpad_heads", "set_num_threads", "get_num_threads", "get_isa", "supported_isas", "set_isa"]

"""Array plumbing between numpy / torch and attnkit._C.

The extension takes arrays through DLPack or the buffer protocol, paired with the name of
their element type: numpy cannot express bf16/fp8 natively, so ml_dtypes arrays travel as
same-width integer views and the name carries the real type.
"""

import functools
import sys

import numpy as np

try:
    import ml_dtypes
except ImportError:  # bf16/fp8 numpy arrays then cannot exist either
    ml_dtypes = None

_NUMPY_NAMES = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float16): "float16",
    np.dtype(np.int8): "int8",
    np.dtype(np.uint8): "uint8",
    np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64",
    np.dtype(np.bool_): "boolean",
}
if ml_dtypes is not None:
    _NUMPY_NAMES.update({
        np.dtype(ml_dtypes.bfloat16): "bfloat16",
        np.dtype(ml_dtypes.float8_e4m3fn): "float8_e4m3fn",
        np.dtype(ml_dtypes.float8_e5m2): "float8_e5m2",
    })
_NUMPY_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_NUMPY_FROM_NAME = {name: dtype for dtype, name in _NUMPY_NAMES.items()}


def _torch():
    """torch if the process has imported it, else None. attnkit never imports torch itself
    before a torch tensor reaches it: importing it costs seconds, and its OpenMP runtime
    reads its settings (e.g. OMP_WAIT_POLICY) at that moment."""
    return sys.modules.get("torch")


@functools.cache
def _torch_tables():
    torch = _torch()
    names = {
        torch.float32: "float32",
        torch.float16: "float16",
        torch.bfloat16: "bfloat16",
        torch.float8_e4m3fn: "float8_e4m3fn",
        torch.float8_e5m2: "float8_e5m2",
        torch.int8: "int8",
        torch.uint8: "uint8",
        torch.int32: "int32",
        torch.int64: "int64",
        torch.bool: "boolean",
    }
    as_bytes = {torch.float8_e4m3fn, torch.float8_e5m2, torch.bool}
    return names, as_bytes, {name: dtype for dtype, name in names.items()}


def is_torch(x) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def kind_of(x, name: str) -> str:
    """ "numpy" or "torch"; anything else is a ValueError naming the argument."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if is_torch(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got device {x.device}")
        return "torch"
    raise ValueError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")


def dtype_name(x, name: str) -> str:
    table = _torch_tables()[0] if is_torch(x) else _NUMPY_NAMES
    try:
        return table[x.dtype]
    except KeyError:
        supported = ", ".join(sorted(set(table.values())))
        raise ValueError(f"{name} has unsupported dtype {x.dtype}; attnkit takes {supported} "
                         "(each op accepts a subset, named in its docstring)") from None


def typed(x, name: str):
    """(array the extension can import, dtype name) for a numpy array or torch tensor."""
    dname = dtype_name(x, name)
    if is_torch(x):
        x = x.detach()
        if x.dtype in _torch_tables()[1]:
            x = x.view(_torch().uint8)
        return x, dname
    if dname in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "boolean"):
        x = x.view(_NUMPY_BITS[x.dtype.itemsize])
    return x, dname


def typed_output(x, name: str):
    """typed() for an array attnkit writes into: it must be writable."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{name} must be a writable array, got a read-only one")
    return typed(x, name)


def typed_or_none(x, name: str):
    return None if x is None else typed(x, name)


def empty_like_kind(kind: str, shape, dtype_name_: str):
    """A new uninitialised array of the given kind, shape and attnkit dtype name."""
    if kind == "torch":
        return _torch().empty(shape, dtype=_torch_tables()[2][dtype_name_])
    return np.empty(shape, dtype=_NUMPY_FROM_NAME[dtype_name_])

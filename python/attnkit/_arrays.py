"""Array plumbing between numpy / torch and attnkit._C.

The extension takes numpy arrays through the buffer protocol, paired with the name of
their element type: numpy cannot express bf16/fp8 natively, so ml_dtypes arrays travel as
same-width integer views and the name carries the real type. torch tensors travel as
(address, shape, strides, dtype name): a DLPack export costs microseconds per tensor.
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


class _TorchNames(dict):
    """torch dtype -> attnkit dtype name, filled on first use (torch is imported by then)."""

    def __missing__(self, dtype):
        if not self:
            self.update(_torch_tables()[0])
            if dtype in self:
                return self[dtype]
        raise KeyError(dtype)


_TORCH_NAMES = _TorchNames()


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
    return names, {name: dtype for dtype, name in names.items()}


def is_torch(x) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def kind_of(x, name: str) -> str:
    """ "numpy" or "torch"; anything else is a ValueError naming the argument."""
    if isinstance(x, np.ndarray):
        return "numpy"
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if not x.is_cpu:
            raise ValueError(f"{name} must be a CPU tensor, got device {x.device}")
        if x.layout is not torch.strided:  # sparse and other layouts have no strides to read
            raise ValueError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
        return "torch"
    raise ValueError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")


# What each kind of argument takes, for the message on a dtype attnkit does not know at all
# (float64, int64: numpy's and torch's defaults); a known dtype that the op does not take
# gets the op's own message from the C++ contract.
FLOAT = "float32, float16 or bfloat16"
MASK = "bool or float32/float16/bfloat16"


def dtype_name(x, name: str, takes: str) -> str:
    table = _NUMPY_NAMES if isinstance(x, np.ndarray) else _torch_tables()[0]
    try:
        return table[x.dtype]
    except KeyError:
        raise ValueError(f"{name} must be {takes}, got {x.dtype}") from None


def typed(x, name: str, takes: str = FLOAT):
    """What the extension takes for a numpy array or torch tensor: (array, dtype name), or
    (address, shape, strides, dtype name) for a tensor (the caller keeps it alive)."""
    if not isinstance(x, np.ndarray):
        if x.is_neg():  # torch's lazy negation: the memory holds -x (the dispatcher resolves it, not this)
            raise ValueError(f"{name} has torch's lazy negation bit set (is_neg()); pass {name}.resolve_neg()")
        try:
            # a plain tuple: nanobind reads a torch.Size (a tuple subclass) ~1 us slower
            return x.data_ptr(), tuple(x.shape), x.stride(), _TORCH_NAMES[x.dtype]
        except KeyError:
            raise ValueError(f"{name} must be {takes}, got {x.dtype}") from None
        except RuntimeError:  # no strides or storage: sparse, nested and other non-dense layouts
            what = "a nested tensor" if x.is_nested else f"layout {x.layout}"
            raise ValueError(f"{name} must be a dense (strided) tensor, got {what}") from None
    dname = dtype_name(x, name, takes)
    if not x.flags.aligned and any(s % x.itemsize for s in x.strides):  # the flag: cheap, and rarely False
        raise ValueError(f"{name} must have strides that are whole elements, got byte strides {x.strides} "
                         f"for itemsize {x.itemsize}")
    if dname in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "boolean"):
        x = x.view(_NUMPY_BITS[x.dtype.itemsize])
    return x, dname


def typed_output(x, name: str, takes: str = FLOAT):
    """typed() for an array attnkit writes into: it must be writable."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{name} must be a writable array, got a read-only one")
    return typed(x, name, takes)


def typed_or_none(x, name: str, takes: str = FLOAT):
    return None if x is None else typed(x, name, takes)


def empty_like_kind(kind: str, shape, dtype_name_: str):
    """A new uninitialised array of the given kind, shape and attnkit dtype name."""
    if kind == "torch":
        return _torch().empty(shape, dtype=_torch_tables()[1][dtype_name_], device="cpu")
    return np.empty(shape, dtype=_NUMPY_FROM_NAME[dtype_name_])

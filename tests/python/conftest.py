"""Shared fixtures and input makers for the attnkit Python tests."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so tests can `import reference`

import attnkit  # noqa: E402

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

DTYPES = ["float32", "float16", "bfloat16"]


def np_dtype(name):
    """numpy dtype for an attnkit dtype name (bf16 through ml_dtypes)."""
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def torch_dtype(name):
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "bool": torch.bool}[name]


def to_torch(x):
    """A torch tensor sharing memory (and strides) with numpy array x, bf16 included."""
    if x.dtype == np_dtype("bfloat16"):
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def randn(rng, shape, dtype="float32", scale=1.0):
    """Fresh normal values from the seeded Generator, rounded to dtype (numpy array).
    Exact zeros are replaced so no input is ever all-zero-like."""
    x = rng.standard_normal(shape) * scale
    x = np.where(x == 0.0, 0.5, x)
    return x.astype(np_dtype(dtype))


def poison(shape, dtype):
    """A NaN-filled numpy array: anything the kernel leaves unwritten stays NaN."""
    return np.full(shape, np.nan, dtype=np_dtype(dtype) if isinstance(dtype, str) else dtype)


def strided_like(x, rng, fill=np.nan, allow_negative=False):
    """A non-contiguous view with x's shape and values: a slice of a larger NaN-padded buffer
    (padding in every dim, a step of 2 in one dim), with the memory order of the dims
    permuted; optionally one dim reversed (negative stride, numpy only). Reads outside the
    view would see NaN."""
    shape = x.shape
    nd = len(shape)
    perm = rng.permutation(nd)                      # memory order of the logical dims
    step = np.ones(nd, dtype=int)
    step[rng.integers(nd)] = 2
    buf_shape = [shape[p] * step[p] + 1 + int(rng.integers(0, 3)) for p in perm]
    if x.dtype == np.bool_:
        buf = np.zeros(buf_shape, dtype=bool)
    else:
        buf = np.full(buf_shape, fill, dtype=x.dtype)
    view = buf[tuple(slice(1, 1 + shape[p] * step[p], int(step[p])) for p in perm)]
    view = view.transpose(np.argsort(perm))
    if allow_negative and nd:
        d = int(rng.integers(nd))
        view = np.flip(view, axis=d)
    view[...] = x
    assert view.shape == shape
    return view, buf


def strided_out(shape, dtype, rng):
    """A NaN-poisoned non-contiguous out buffer and the whole backing buffer."""
    return strided_like(poison(shape, dtype), rng)


@pytest.fixture
def rng(request):
    """A Generator seeded from the test's node id: reproducible, different per test."""
    import zlib
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=attnkit.supported_isas())
def isa(request):
    """Runs the test with each ISA compiled in and runnable here; restores the original."""
    original = attnkit.get_isa()
    attnkit.set_isa(request.param)
    assert attnkit.get_isa() == request.param
    try:
        yield request.param
    finally:
        attnkit.set_isa(original)


@pytest.fixture(params=[1, 2])
def threads(request):
    """Runs the test with 1 and 2 threads; restores the original thread count."""
    original = attnkit.get_num_threads()
    attnkit.set_num_threads(request.param)
    assert attnkit.get_num_threads() == request.param
    try:
        yield request.param
    finally:
        attnkit.set_num_threads(original)


@pytest.fixture
def restore_runtime():
    """Restores ISA and thread count after a test that changes them itself."""
    isa0, n0 = attnkit.get_isa(), attnkit.get_num_threads()
    try:
        yield
    finally:
        attnkit.set_isa(isa0)
        attnkit.set_num_threads(n0)


# Mask shapes, in BHSD order whatever the layout, as functions of (B, Hq, Sq, Skv).
MASK_SHAPES = {
    "SqSkv": lambda B, H, Sq, Skv: (Sq, Skv),
    "11SqSkv": lambda B, H, Sq, Skv: (1, 1, Sq, Skv),
    "B11Skv": lambda B, H, Sq, Skv: (B, 1, 1, Skv),
    "HSqSkv": lambda B, H, Sq, Skv: (H, Sq, Skv),
    "full": lambda B, H, Sq, Skv: (B, H, Sq, Skv),
    "Skv": lambda B, H, Sq, Skv: (Skv,),
    "BH11": lambda B, H, Sq, Skv: (B, H, 1, 1),
    "B1Sq1": lambda B, H, Sq, Skv: (B, 1, Sq, 1),
}


def make_mask(rng, kind, shape, dtype="float32", p_attend=0.75, neg_inf_frac=0.1):
    """A random mask: kind "bool" (True = attend, P(True) = p_attend) or "float" (additive
    normal values, a fraction set to -inf), rounded to dtype."""
    if kind == "bool":
        return rng.random(shape) < p_attend
    m = rng.standard_normal(shape) * 2.0
    m = np.where(rng.random(shape) < neg_inf_frac, -np.inf, m)
    return m.astype(np_dtype(dtype))


def bhsd_shape(layout, B, H, S, D):
    return (B, H, S, D) if layout == "BHSD" else (B, S, H, D)


def make_qkv(rng, B, Hq, Hkv, Sq, Skv, D, Dv, dtype="float32", layout="BHSD", scale=1.0):
    q = randn(rng, bhsd_shape(layout, B, Hq, Sq, D), dtype, scale)
    k = randn(rng, bhsd_shape(layout, B, Hkv, Skv, D), dtype, scale)
    v = randn(rng, bhsd_shape(layout, B, Hkv, Skv, Dv), dtype)
    return q, k, v


def snapshot(*arrays):
    """Bit copies of arrays (None kept), to check later that nothing was modified."""
    return [None if a is None else bits(a).copy() for a in arrays]


def assert_unmodified(before, arrays):
    for i, (b, a) in enumerate(zip(before, arrays)):
        if a is not None:
            assert np.array_equal(bits(a), b), f"input #{i} was modified by the call"


def bits(x):
    """An unsigned-integer view of an array's bits (numpy or torch), for bitwise equality."""
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.view(torch.int16).numpy() if x.dtype in (torch.bfloat16, torch.float16) else x.numpy()
    x = np.ascontiguousarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def assert_bits_equal(a, b, name="out"):
    """Bitwise equality with a short report: how many elements differ, the first one, and
    the largest difference in units of the last place."""
    ba, bb = bits(a), bits(b)
    assert ba.shape == bb.shape, f"{name}: shapes {ba.shape} != {bb.shape}"
    ne = ba != bb
    if ne.any():
        first = tuple(int(c) for c in np.argwhere(ne)[0])
        fa = np.asarray(a.float() if hasattr(a, "float") else a, dtype=np.float64)
        fb = np.asarray(b.float() if hasattr(b, "float") else b, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            diff = np.abs(fa - fb)[ne]
        raise AssertionError(
            f"{name}: {int(ne.sum())} of {ne.size} elements differ bitwise; first at {first}: "
            f"{fa[first]!r} vs {fb[first]!r}; max |diff| {np.nanmax(diff):.3g}")

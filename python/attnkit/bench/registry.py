"""The op registry: one entry per benchmarked op (``--op NAME``).

An op entry is a :class:`BenchOp`; the driver (runner.py) only talks to ops through it, so
adding ``sparse_mla`` or ``sage`` means writing one module with a subclass and calling
:func:`register` on it (then importing the module in :func:`load_ops`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def numpy_dtype(name: str):
    """The numpy dtype of a canonical dtype name (bfloat16 and fp8 through ml_dtypes)."""
    if name in ("float32", "float16"):
        return np.dtype(name)
    if name not in ITEMSIZE:
        raise ValueError(name)
    if ml_dtypes is None:
        raise RuntimeError(f"{name} needs the ml_dtypes package")
    return np.dtype(getattr(ml_dtypes, name))


def itemsize(name: str) -> int:
    return ITEMSIZE[name]


def positive_int(what: str, value: str) -> int:
    """value as a positive integer, else a ValueError naming `what`."""
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{what}: expected an integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"{what}: must be >= 1, got {n}")
    return n


def shape_int(key: str, value: str) -> int:
    """A shape spec's value: a positive integer, else a ValueError naming the key."""
    return positive_int(f"shape key {key}", value)


@dataclass
class Case:
    """One (shape, dtype) the op is benchmarked at; ``shape`` is op-specific."""
    shape: Any
    dtype: str

    @property
    def label(self) -> str:
        return f"{self.shape.label} {self.dtype}"


@dataclass
class Contender:
    """Something that computes the op: attnkit itself, a reference kernel or a peer.

    ``run(inputs)`` returns the output (any array kind the op's verify/compare accepts);
    ``prepare()`` runs before each call or batch of calls (e.g. selecting an ISA) and
    ``finish()`` after it, both untimed; ``set_threads(n)`` before each thread count.
    ``verify(ref, out)``, if set, replaces the op's verify for this contender (e.g. exact
    peers of a quantized kernel); ``compare_to`` names the contender a non-attnkit one is
    compared with (op.compare): None for the attnkit contender, "" for none.
    ``prepare_inputs(inputs)``, if set, runs once per input set and thread count before the
    contender is verified or timed (untimed), e.g. converting inputs to a peer's own types.
    ``flops``, if set, replaces the case's useful FLOPs for this contender's GFLOP/s (e.g. a
    forward timed beside its backward).
    """
    name: str
    role: str  # "attnkit" (what the ratios are against), "reference" or "peer"
    run: Callable[[Any], Any]
    prepare: Callable[[], None] = lambda: None
    finish: Callable[[], None] = lambda: None
    set_threads: Callable[[int], None] = lambda n: None
    note: str = ""
    verify: Optional[Callable[[Any, Any], "Check"]] = None
    compare_to: Optional[str] = None
    prepare_inputs: Optional[Callable[[Any], None]] = None
    flops: Optional[float] = None


@dataclass
class Check:
    ok: bool
    err: float            # max |out - ref| / rms(ref) (dimensionless)
    detail: str = ""      # why it failed; on success, shown in the verify column if set


@dataclass
class Counts:
    flops: float                          # useful FLOPs of one call
    mem_bytes: Optional[float] = None     # bytes that must stream from memory (floor), if relevant
    memory_bound: bool = False            # report the memory floor column
    extra: dict = field(default_factory=dict)


class BenchOp:
    name = "?"
    description = ""

    # --- shapes: an op names its shapes, its default ones and its spec parser ----------
    shapes: dict = {}
    default_shapes: tuple = ()
    shape_parser = None  # staticmethod: "name" or "key=value,..." -> shape; raises ValueError

    def named_shapes(self) -> dict:
        return dict(self.shapes)

    def default_shape_names(self) -> list:
        return list(self.default_shapes)

    def parse_shape(self, text: str):
        """A named shape or a custom "key=value,..." spec; raises ValueError."""
        return self.shape_parser(text)

    def quick_shape(self, shape):
        """The scaled-down version for --quick."""
        raise NotImplementedError

    def dtypes_for(self, shape, requested: Optional[list]) -> tuple:
        """(dtypes to run, note about skipped ones or "")."""
        raise NotImplementedError

    # --- per case -----------------------------------------------------------------------
    def counts(self, case: Case) -> Counts:
        raise NotImplementedError

    def input_bytes(self, case: Case) -> int:
        raise NotImplementedError

    def make_inputs(self, case: Case, rng) -> Any:
        raise NotImplementedError

    def reference(self, case: Case, inputs) -> Any:
        """An exact (float64) reference on a subset of the output, computed once per case."""
        raise NotImplementedError

    def verify(self, case: Case, ref, out) -> Check:
        """Checks an output against the reference subset."""
        raise NotImplementedError

    def compare(self, case: Case, out, attnkit_out) -> Check:
        """Checks a peer's full output against attnkit's."""
        raise NotImplementedError

    # Whether attnkit's whole output must be finite (checked by the runner, beyond the subset
    # verify compares): not where a contract writes -inf or +inf (the DSA logits).
    outputs_finite = True

    def reset_outputs(self, inputs) -> None:
        """Fills the output buffers an input set carries (contenders that write with out=)
        with NaN before each contender's verifying call, so that each is verified on what it
        wrote itself, not on what the one before it left there."""

    def inject_error(self, case: Case, ref, out) -> Any:
        """A copy of `out` made wrong where verify looks (for testing the tool itself)."""
        raise NotImplementedError

    def contenders(self, case: Case) -> tuple:
        """(list of Contender, list of notes about skipped peers)."""
        raise NotImplementedError


OPS: dict = {}


def register(op: BenchOp) -> BenchOp:
    OPS[op.name] = op
    return op


def load_ops() -> dict:
    from . import attention_op  # noqa: F401  (registers "attention")
    from . import sparse_mla_op  # noqa: F401  (registers "sparse_mla")
    from . import sage_op  # noqa: F401  (registers "sage")
    from . import serving_op  # noqa: F401  (registers "varlen" and "paged")
    from . import dsa_op  # noqa: F401  (registers "dsa")
    from . import modifiers_op  # noqa: F401  (registers "modifiers")
    from . import backward_op  # noqa: F401  (registers "backward" and "varlen_backward")
    return OPS


def attnkit_contenders(run, notes: list) -> list:
    """attnkit on the best ISA (the contender ratios are against) and attnkit's portable
    kernel as the reference peer, both computing `run(inputs)`; appends why the reference
    is skipped to `notes`."""
    import attnkit

    best = attnkit.get_isa()
    out = [Contender("attnkit", "attnkit", run, prepare=lambda: attnkit.set_isa(best),
                     set_threads=attnkit.set_num_threads, note=f"isa {best}")]
    if best == "generic":
        notes.append("attnkit-generic: skipped (the active ISA is already generic)")
    elif "generic" not in attnkit.supported_isas():
        notes.append("attnkit-generic: skipped (not built)")
    else:
        out.append(Contender("attnkit-generic", "reference", run,
                             prepare=lambda: attnkit.set_isa("generic"),
                             finish=lambda: attnkit.set_isa(best),
                             set_threads=attnkit.set_num_threads,
                             note="attnkit's portable kernel"))
    return out


def optional_torch():
    """torch if it imports, else None (a broken torch install is as good as none)."""
    try:
        import torch
        return torch
    except Exception:  # noqa: BLE001
        return None

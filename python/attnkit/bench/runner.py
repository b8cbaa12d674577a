"""The benchmark driver, op-agnostic: for each case and thread count, verify every contender
(never timing a wrong one), then time the verified ones interleaved (A B C A B C ...)."""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .registry import BenchOp, Case, Check, Contender


@dataclass
class Settings:
    quick: bool = False
    warmup: int = 1            # untimed interleaved rounds after the verifying call
    repeats: int = 7           # timed rounds (reduced to fit budget_s, never below min_repeats)
    min_repeats: int = 3
    budget_s: float = 60.0     # per (case, threads) group
    min_sample_s: float = 0.01  # short calls are batched so one sample lasts at least this
    max_inner: int = 64
    max_input_sets: int = 8
    inject_error: bool = False
    seed: int = 0


@dataclass
class Row:
    op: str
    case: Case
    threads: int
    contender: str
    role: str
    status: str                  # "ok", "FAILED", "error", "skipped"
    detail: str = ""
    err: float = math.nan        # normalised max error vs the reference
    peer_err: float = math.nan   # normalised max error vs attnkit (peers)
    times_ms: list = field(default_factory=list)
    inner: int = 1
    flops: float = 0.0
    mem_bytes: Optional[float] = None
    memory_bound: bool = False
    peak_gflops: float = math.nan   # of the instruction in peak_of, this thread count
    peak_of: str = "fp32 FMA"       # the instruction whose peak % peak is of
    read_gbs: float = math.nan
    ratio: float = math.nan      # this contender's median / attnkit's median
    note: str = ""

    @property
    def timed(self) -> bool:
        return bool(self.times_ms)

    @property
    def ms_median(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else math.nan

    @property
    def ms_min(self) -> float:
        return min(self.times_ms) if self.times_ms else math.nan

    @property
    def ms_max(self) -> float:
        return max(self.times_ms) if self.times_ms else math.nan

    @property
    def gflops(self) -> float:
        return self.flops / (self.ms_median * 1e6) if self.timed else math.nan

    @property
    def pct_peak(self) -> float:
        return 100.0 * self.gflops / self.peak_gflops if self.timed else math.nan

    @property
    def floor_ms(self) -> float:
        if self.mem_bytes is None or not self.read_gbs > 0:
            return math.nan
        return self.mem_bytes / (self.read_gbs * 1e6)

    @property
    def x_floor(self) -> float:
        return self.ms_median / self.floor_ms if self.timed else math.nan


class Progress:
    """One status line on stderr: rewritten in place on a terminal, else one line per step."""

    def __init__(self, stream=None, enabled=True):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = ""

    def update(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\033[K" + msg[:160])
        elif msg != self._last:
            self.stream.write(msg + "\n")
        self.stream.flush()
        self._last = msg

    def done(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def note(self, msg: str) -> None:
        self.done()
        self.stream.write(msg + "\n")
        self.stream.flush()


def input_sets_needed(input_bytes: int, llc_bytes: int, max_sets: int) -> int:
    """Rotate input sets when one set would stay in cache between calls (docs/BENCH.md step 3)."""
    if input_bytes <= 0:
        return 1
    return max(1, min(max_sets, math.ceil(2 * llc_bytes / input_bytes)))


def _snapshot(out):
    """A copy of a contender's output (arrays, tensors, or tuples of them): contenders may
    return the one buffer an input set carries, which the next contender overwrites."""
    if isinstance(out, (tuple, list)):
        return type(out)(_snapshot(o) for o in out)
    if isinstance(out, np.ndarray):
        return out.copy()
    if hasattr(out, "detach"):
        return out.detach().clone()
    return out


def _nonfinite(out) -> int:
    """How many values of an output (arrays, tensors, or tuples of them) are NaN or inf."""
    if isinstance(out, (tuple, list)):
        return sum(_nonfinite(o) for o in out)
    if hasattr(out, "detach"):
        out = out.detach().float().numpy()
    if not isinstance(out, np.ndarray) or out.dtype.kind in "biu":  # index outputs
        return 0
    return int(np.sum(~np.isfinite(out.astype(np.float32))))  # float, or ml_dtypes' bfloat16


def _call(c: Contender, x):
    c.prepare()
    try:
        t0 = time.perf_counter()
        out = c.run(x)
        return out, time.perf_counter() - t0
    finally:
        c.finish()


def run_case(op: BenchOp, case: Case, threads: list, machine, settings: Settings,
             progress: Progress, case_tag: str, notes: list) -> list:
    counts = op.counts(case)
    rng = np.random.default_rng(settings.seed)
    n_sets = input_sets_needed(op.input_bytes(case), machine.llc_bytes, settings.max_input_sets)
    progress.update(f"{case_tag} {case.label}: making {n_sets} input set(s)")
    inputs = [op.make_inputs(case, rng) for _ in range(n_sets)]
    progress.update(f"{case_tag} {case.label}: float64 reference")
    ref = op.reference(case, inputs[0])
    contenders, skipped = op.contenders(case)
    for n in skipped:
        if n not in notes:
            notes.append(n)
    rows = []
    for t in threads:
        tag = f"{case_tag} {case.label} threads={t}"
        group = []
        for c in contenders:
            group.append(Row(op.name, case, t, c.name, c.role, "ok",
                             flops=counts.flops if c.flops is None else c.flops,
                             mem_bytes=counts.mem_bytes, memory_bound=counts.memory_bound,
                             peak_gflops=machine.peak_gflops.get(t, math.nan),
                             read_gbs=machine.read_gbs.get(t, math.nan), note=c.note))
        for c in contenders:
            c.set_threads(t)

        # 1. Verify (the verifying call doubles as the first warm-up).
        outs, est = {}, {}
        for c, row in zip(contenders, group):
            progress.update(f"{tag}: verifying {c.name}")
            try:
                if c.prepare_inputs is not None:
                    for x in inputs:
                        c.prepare_inputs(x)
                op.reset_outputs(inputs[0])
                out, dt = _call(c, inputs[0])
                out = _snapshot(out)
            except Exception as e:  # noqa: BLE001
                # attnkit's own kernels raising is a failure; a peer raising is only skipped.
                row.status = "error" if c.role == "peer" else "FAILED"
                row.detail = f"raised {type(e).__name__}: {e}"
                continue
            if c.role == "attnkit" and settings.inject_error:
                out = op.inject_error(case, ref, out)
            chk = c.verify(ref, out) if c.verify is not None else op.verify(case, ref, out)
            if chk.ok and c.role == "attnkit" and op.outputs_finite:
                bad = _nonfinite(out)
                if bad:
                    chk = Check(False, math.inf, f"{bad} non-finite values in the whole output")
            row.err = chk.err
            if not chk.ok:
                row.status, row.detail = "FAILED", f"vs float64 reference: {chk.detail}"
            else:
                row.detail = chk.detail
            outs[c.name], est[c.name] = out, dt
        ak = next((c.name for c in contenders if c.role == "attnkit"), None)
        by_name = {r.contender: r for r in group}
        for c, row in zip(contenders, group):
            target = ak if c.compare_to is None else c.compare_to
            if (c.role == "attnkit" or row.status != "ok" or not target
                    or target not in by_name or by_name[target].status != "ok"):
                continue
            chk: Check = op.compare(case, outs[c.name], outs[target])
            row.peer_err = chk.err
            if not chk.ok:
                row.status, row.detail = "FAILED", f"vs {target}: {chk.detail}"
        outs.clear()

        # 2. Time the verified contenders, interleaved.
        live = [(c, row) for c, row in zip(contenders, group) if row.status == "ok"]
        if live:
            inner = {c.name: max(1, min(settings.max_inner,
                                        math.ceil(settings.min_sample_s / max(est[c.name], 1e-9))))
                     for c, _ in live}
            round_s = sum(est[c.name] * inner[c.name] for c, _ in live)
            reps = settings.repeats
            if round_s * (reps + settings.warmup) > settings.budget_s:
                reps = max(settings.min_repeats, int(settings.budget_s / round_s) - settings.warmup)
            counter = {c.name: 1 for c, _ in live}  # rotates through the input sets
            for rnd in range(settings.warmup + reps):
                timed = rnd >= settings.warmup
                what = f"rep {rnd - settings.warmup + 1}/{reps}" if timed else "warm-up"
                for c, row in live:
                    progress.update(f"{tag}: timing ({what}) {c.name}")
                    n = inner[c.name]
                    c.prepare()
                    try:
                        t0 = time.perf_counter()
                        for _ in range(n):
                            c.run(inputs[counter[c.name] % n_sets])
                            counter[c.name] += 1
                        dt = time.perf_counter() - t0
                    finally:
                        c.finish()
                    if timed:
                        row.times_ms.append(dt * 1e3 / n)
                        row.inner = n
        ak_row = next((r for r in group if r.role == "attnkit"), None)
        for row in group:
            if ak_row is not None and ak_row.timed and row.timed:
                row.ratio = row.ms_median / ak_row.ms_median
        rows.extend(group)
    return rows


def run(op: BenchOp, cases: list, threads: list, machine, settings: Settings,
        progress: Progress, notes: list) -> list:
    """All rows; notes (skipped peers, ...) are appended to `notes`."""
    import attnkit

    saved_threads, saved_isa = attnkit.get_num_threads(), attnkit.get_isa()
    rows = []
    try:
        for i, case in enumerate(cases):
            rows.extend(run_case(op, case, threads, machine, settings, progress,
                                 f"[{i + 1}/{len(cases)}]", notes))
    finally:
        attnkit.set_num_threads(saved_threads)
        attnkit.set_isa(saved_isa)
        progress.done()
    return rows

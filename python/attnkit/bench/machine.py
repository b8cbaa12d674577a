"""The machine the benchmark runs on: CPU model, cores, last-level cache, the measured peak
of each instruction a kernel path may run (fp32 FMA, vdpbf16ps, vpdpbusd, fp16 FMA, AMX's
tdpbf16ps and tdpbusd) and the read bandwidth, per thread count (docs/BENCH.md protocol
step 6), and the instructions each ISA variant's paths run on (which peak a row is measured
against)."""

from __future__ import annotations

import math
import os
import platform
import subprocess
from dataclasses import dataclass, field


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             env={**os.environ, "LC_ALL": "C"}).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_family_model() -> str:
    """ "family F model M" from /proc/cpuinfo (the model name alone, e.g. "AMD EPYC" in a
    VM, does not tell Zen 4 from Zen 5), "" if unknown."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip():
                    break
    except OSError:
        pass
    if "cpu family" in fields and "model" in fields:
        return f"family {fields['cpu family']} model {fields['model']}"
    return ""


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        return os.cpu_count() or 1


def last_level_cache_bytes() -> int:
    """The largest cache cpu0 sees (sysfs), 32 MiB if unknown."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in os.listdir(base):
            try:
                with open(os.path.join(base, entry, "size")) as f:
                    text = f.read().strip()
            except OSError:
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
            num = text[:-1] if mult != 1 else text
            try:
                best = max(best, int(num) * mult)
            except ValueError:
                continue
    except OSError:
        pass
    return best or (32 << 20)


# The instructions whose peaks are measured (attnkit.measure_peak_gflops; 2 operations per
# multiply-add: vfmadd231ps 2 per fp32 lane, vdpbf16ps 4, vpdpbusd 8 per int32 lane,
# tdpbf16ps 16 × 16 × 32 × 2 per tile instruction, tdpbusd 16 × 16 × 64 × 2).
FP32_FMA, BF16_DOT, INT8_DOT, FP16_FMA = "fp32 FMA", "vdpbf16ps", "vpdpbusd", "fp16 FMA"
AMX_BF16, AMX_INT8 = "tdpbf16ps", "tdpbusd"
INSTRUCTIONS = (FP32_FMA, BF16_DOT, INT8_DOT, FP16_FMA, AMX_BF16, AMX_INT8)


def bf16_dot_of(isa: str) -> str:
    """The instruction attnkit's bf16 tile-loop products run on in variant `isa`
    (src/core/dispatch.cpp): AMX tiles on avx512amx, vdpbf16ps on avx512bf16; elsewhere bf16
    is converted to fp32 for FMAs (avx512vnni is the choice on CPUs whose vdpbf16ps is slower
    than that)."""
    return {"avx512amx": AMX_BF16, "avx512bf16": BF16_DOT}.get(isa, FP32_FMA)


def int8_dot_of(isa: str) -> str:
    """The instruction int8 Sage's Q·Kᵀ runs on in variant `isa`: AMX's tdpbusd on avx512amx
    (which also runs sage's bf16 P·V on tdpbf16ps), vpdpbusd on avx512bf16 and avx512vnni
    (which takes avx512bf16's Sage kernel, P·V on vdpbf16ps included)."""
    if isa == "avx512amx":
        return AMX_INT8
    return INT8_DOT if isa in ("avx512bf16", "avx512vnni") else FP32_FMA


def path_label(path) -> str:
    """A path is one instruction name, or ((instruction, FLOP share), ...) for a path whose
    products split over instructions; its label names them, e.g. "vpdpbusd+vdpbf16ps"."""
    if isinstance(path, str):
        return path
    return "+".join(dict.fromkeys(kind for kind, _ in path))


@dataclass
class Machine:
    model: str
    cores: int
    llc_bytes: int
    isa: str
    supported_isas: list
    attnkit_version: str
    torch_version: str
    isa_rule: str = ""
    peaks: dict = field(default_factory=dict)       # instruction -> {threads -> GFLOP/s}; 0: n/a
    read_gbs: dict = field(default_factory=dict)    # threads -> GB/s

    @property
    def peak_gflops(self) -> dict:
        """threads -> the fp32 FMA peak."""
        return self.peaks.get(FP32_FMA, {})

    def path_peak(self, path, threads: int) -> float:
        """The peak of a path on `threads` threads: its instruction's, or for a mixed path the
        rate at which its FLOP shares take the same time, each at its own instruction's peak
        (nan where one of them is not on this machine)."""
        parts = ((path, 1.0),) if isinstance(path, str) else path
        total, seconds = 0.0, 0.0
        for kind, share in parts:
            peak = self.peaks.get(kind, {}).get(threads, 0.0)
            if not peak > 0:
                return math.nan
            total += share
            seconds += share / peak
        return total / seconds

    def peaks_text(self) -> str:
        out = []
        for kind in INSTRUCTIONS:
            by_thr = self.peaks.get(kind, {})
            if by_thr and all(v > 0 for v in by_thr.values()):
                unit = "GOP/s" if kind in (INT8_DOT, AMX_INT8) else "GFLOP/s"
                out.append(f"{kind} " + ", ".join(f"{t} thr {g:.0f}" for t, g in sorted(by_thr.items()))
                           + f" {unit}")
            else:
                out.append(f"{kind} n/a")
        return "; ".join(out)

    def bf16_rule_check(self) -> str:
        """Whether the measured vdpbf16ps / fp32 FMA ratio agrees with the variant the
        dispatcher chose (its bf16 rule), "" when the machine has no vdpbf16ps."""
        fma, dot = self.peaks.get(FP32_FMA, {}).get(1, 0.0), self.peaks.get(BF16_DOT, {}).get(1, 0.0)
        if not (fma > 0 and dot > 0):
            return ""
        ratio = dot / fma
        default = self.supported_isas[0] if self.supported_isas else self.isa
        agrees = (ratio > 1.0) == (bf16_dot_of(default) == BF16_DOT)
        return (f"bf16 rule: vdpbf16ps at {ratio:.2f}x the fp32 FMA rate (1 thread); the default isa "
                f"{default} runs bf16 on {bf16_dot_of(default)}: "
                + ("agrees" if agrees else "DISAGREES (report it: the rule in src/core/dispatch.cpp)"))

    def line(self) -> str:
        bws = ", ".join(f"{t} thr {b:.1f}" for t, b in sorted(self.read_gbs.items()))
        fm = cpu_family_model()
        return (f"machine: {self.model}{f' ({fm})' if fm else ''}, {self.cores} cores, "
                f"LLC {self.llc_bytes >> 20} MiB | "
                f"isa {self.isa} (supported: {', '.join(self.supported_isas)}; {self.isa_rule}) | "
                f"peaks: {self.peaks_text()} | read GB/s: {bws} | "
                f"attnkit {self.attnkit_version}, {self.torch_version} "
                f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')})")


def measure(threads: list, progress=None, machine: Machine = None) -> Machine:
    """Measures every instruction's peak and the bandwidth for each thread count. Given
    `machine` (an earlier measurement), keeps the best of both: interference from other
    processes only ever lowers a measurement, so measuring before and after the run and
    keeping the max is more robust."""
    import attnkit
    from attnkit import _C

    try:
        import torch
        torch_version = f"torch {torch.__version__}"
    except Exception:  # noqa: BLE001
        torch_version = "torch not importable"
    m = machine or Machine(cpu_model(), cores(), last_level_cache_bytes(), attnkit.get_isa(),
                           attnkit.supported_isas(), attnkit.__version__, torch_version, _C.isa_rule())
    if attnkit.get_isa() != m.isa:
        attnkit.set_isa(m.isa)
    saved = attnkit.get_num_threads()
    try:
        for t in threads:
            attnkit.set_num_threads(t)  # measure_* need threads <= get_num_threads()
            for kind in INSTRUCTIONS:
                if progress:
                    progress.update(f"measuring the {kind} peak, {t} thread(s)")
                by_thr = m.peaks.setdefault(kind, {})
                by_thr[t] = max(by_thr.get(t, 0.0), _C.measure_peak_gflops(kind, t))
            if progress:
                progress.update(f"measuring read bandwidth, {t} thread(s)")
            m.read_gbs[t] = max(m.read_gbs.get(t, 0.0), _C.measure_read_bandwidth_gbs(t))
    finally:
        attnkit.set_num_threads(saved)
    return m

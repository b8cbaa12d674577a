"""The machine the benchmark runs on: CPU model, cores, last-level cache, and its measured
fp32 FMA peak and read bandwidth per thread count (docs/BENCH.md protocol step 6), and the
peak of each instruction a row's path may run, derived from the measured fp32 FMA peak."""

from __future__ import annotations

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


# The peak of each instruction a benchmark row's inner products run on, as a multiple of
# the measured fp32 FMA peak: per 512-bit instruction vfmadd231ps does 16 multiply-adds,
# vdpbf16ps 32 (bf16 pairs) and vpdpbusd 64 (int8 quads), issued at the same rate on Zen 4
# (AMD's Zen 4 optimisation guide; assumed for Zen 5). A model, not a measurement: only the
# fp32 FMA peak is measured.
INSTRUCTION_PEAK = {"fp32 FMA": 1.0, "bf16 dot": 2.0, "int8 dot": 4.0}


def mixed_peak_factor(parts) -> float:
    """The peak multiple of a path whose FLOPs split over instructions: parts is
    ((instruction, FLOP share), ...); the time bound adds each share at its own rate."""
    total = sum(share for _, share in parts)
    return total / sum(share / INSTRUCTION_PEAK[kind] for kind, share in parts)


@dataclass
class Machine:
    model: str
    cores: int
    llc_bytes: int
    isa: str
    supported_isas: list
    attnkit_version: str
    torch_version: str
    peak_gflops: dict = field(default_factory=dict)   # threads -> fp32 FMA GFLOP/s
    read_gbs: dict = field(default_factory=dict)      # threads -> GB/s

    def line(self) -> str:
        peaks = ", ".join(f"{t} thr {g:.0f}" for t, g in sorted(self.peak_gflops.items()))
        bws = ", ".join(f"{t} thr {b:.1f}" for t, b in sorted(self.read_gbs.items()))
        fm = cpu_family_model()
        return (f"machine: {self.model}{f' ({fm})' if fm else ''}, {self.cores} cores, "
                f"LLC {self.llc_bytes >> 20} MiB | "
                f"isa {self.isa} (supported: {', '.join(self.supported_isas)}) | "
                f"fp32 FMA peak GFLOP/s ({self.isa}): {peaks} | read GB/s: {bws} | "
                f"attnkit {self.attnkit_version}, {self.torch_version} "
                f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')})")


def measure(threads: list, progress=None, machine: Machine = None) -> Machine:
    """Measures the peak and bandwidth for each thread count. Given `machine` (an earlier
    measurement), keeps the best of both: interference from other processes only ever lowers
    a measurement, so measuring before and after the run and keeping the max is more robust."""
    import attnkit
    from attnkit import _C

    try:
        import torch
        torch_version = f"torch {torch.__version__}"
    except Exception:  # noqa: BLE001
        torch_version = "torch not importable"
    m = machine or Machine(cpu_model(), cores(), last_level_cache_bytes(), attnkit.get_isa(),
                           attnkit.supported_isas(), attnkit.__version__, torch_version)
    if attnkit.get_isa() != m.isa:
        attnkit.set_isa(m.isa)
    saved = attnkit.get_num_threads()
    try:
        for t in threads:
            attnkit.set_num_threads(t)  # measure_* need threads <= get_num_threads()
            if progress:
                progress.update(f"measuring fp32 FMA peak, {t} thread(s)")
            m.peak_gflops[t] = max(m.peak_gflops.get(t, 0.0), _C.measure_fma_peak_gflops(t))
            if progress:
                progress.update(f"measuring read bandwidth, {t} thread(s)")
            m.read_gbs[t] = max(m.read_gbs.get(t, 0.0), _C.measure_read_bandwidth_gbs(t))
    finally:
        attnkit.set_num_threads(saved)
    return m

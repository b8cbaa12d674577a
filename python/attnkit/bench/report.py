"""Tables (stdout), CSV and plots of the benchmark rows."""

from __future__ import annotations

import csv
import math
from itertools import groupby


def _ms(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    if x >= 0.1:
        return f"{x:.3f}"
    return f"{x:.4f}"  # a per-call overhead row: tenths of a microsecond


def _num(x: float, fmt: str) -> str:
    return format(x, fmt) if math.isfinite(x) else "-"


def _verify(row) -> str:
    if row.status == "ok":
        if row.detail:
            return f"ok ({row.detail})"
        errs = [e for e in (row.err, row.peer_err) if math.isfinite(e)]
        return f"ok (err {max(errs):.1e})" if errs else "ok"
    if row.status == "error":
        return "error (skipped)"
    return row.status


def _pct_of(row) -> str:
    """ "62.0% of vdpbf16ps"; "- of fp16 FMA" where the row is untimed or the peak is n/a."""
    return f"{_num(row.pct_peak, '.1f')}{'%' if math.isfinite(row.pct_peak) else ''} of {row.peak_of}"


def _case_key(row):
    return (row.op, row.case.label, row.case.dtype)


def _case_header(rows) -> str:
    r = rows[0]
    s = r.case.shape
    dims = s.dims() if hasattr(s, "dims") else str(s)
    name = f"{s.label} [{dims}]" if getattr(s, "name", None) else s.label
    head = f"{name} {r.case.dtype}: {r.flops / 1e9:.3g} GFLOP useful"
    if r.memory_bound and r.mem_bytes:
        head += f", K+V {r.mem_bytes / 1e6:.1f} MB"
    return head


def format_tables(rows) -> str:
    out = []
    for _, grp in groupby(rows, key=_case_key):
        grp = list(grp)
        mem = grp[0].memory_bound
        cols = ["threads", "contender", "ms median (min-max)", "GFLOP/s", "% of path peak",
                "vs attnkit"]
        if mem:
            cols += ["floor ms", "x floor"]
        cols += ["verify"]
        table = []
        for r in grp:
            if r.timed:
                ms = f"{_ms(r.ms_median)} ({_ms(r.ms_min)}-{_ms(r.ms_max)})"
            else:
                ms = "not timed"
            line = [str(r.threads), r.contender, ms, _num(r.gflops, ".1f"), _pct_of(r),
                    _num(r.ratio, ".2f")]
            if mem:
                line += [_ms(r.floor_ms), _num(r.x_floor, ".2f")]
            line += [_verify(r)]
            table.append(line)
        widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
        left = {1, 4, len(cols) - 1}
        fmt = lambda cells: "  ".join(  # noqa: E731
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        out.append(_case_header(grp))
        out.append(fmt(cols))
        out.extend(fmt(t) for t in table)
        for r in grp:
            if r.status != "ok":
                out.append(f"  ! {r.contender}, {r.threads} thread(s): {r.status}: {r.detail}")
        out.append("")
    return "\n".join(out)


CSV_FIELDS = ["op", "shape", "dims", "dtype", "quick", "threads", "contender", "role", "status",
              "detail", "err_vs_ref", "err_vs_attnkit", "ms_median", "ms_min", "ms_max", "reps",
              "calls_per_sample", "gflop", "gflops", "peak_gflops", "peak_of", "pct_peak", "ratio_vs_attnkit",
              "mem_bytes", "read_gbs", "floor_ms", "x_floor", "note"]


def write_csv(path: str, rows) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in rows:
            s = r.case.shape
            w.writerow([r.op, s.label, s.dims() if hasattr(s, "dims") else "", r.case.dtype,
                        int(getattr(s, "quick", False)), r.threads, r.contender, r.role, r.status,
                        r.detail, r.err, r.peer_err, r.ms_median, r.ms_min, r.ms_max,
                        len(r.times_ms), r.inner, r.flops / 1e9, r.gflops, r.peak_gflops,
                        r.peak_of, r.pct_peak, r.ratio, r.mem_bytes if r.memory_bound else "", r.read_gbs,
                        r.floor_ms if r.memory_bound else "", r.x_floor if r.memory_bound else "",
                        r.note])


def write_plot(path: str, rows, title: str = "") -> None:
    """Two bar charts: % of measured peak per contender, and peer time / attnkit time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = []  # (label, {contender: row})
    for key, grp in groupby(rows, key=lambda r: (r.case.shape.label, r.case.dtype, r.threads)):
        groups.append((f"{key[0]}\n{key[1]}\n{key[2]} thr", {r.contender: r for r in grp}))
    names = []
    for _, d in groups:
        names.extend(n for n in d if n not in names)
    peers = [n for n in names if any(d[n].role != "attnkit" for _, d in groups if n in d)]
    cycle = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0", "C1", "C2", "C3"])
    color = {n: cycle[i % len(cycle)] for i, n in enumerate(names)}  # same colour in both charts
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(groups) + 2), 8))
    width = 0.8 / max(1, len(names))
    xs = range(len(groups))
    for i, n in enumerate(names):
        vals = [d[n].pct_peak if n in d and d[n].timed else 0.0 for _, d in groups]
        ax1.bar([x + i * width for x in xs], vals, width, label=n, color=color[n])
    ax1.set_ylabel("% of the peak of each row's instruction")
    ax1.set_title(title or "attnkit benchmark")
    width2 = 0.8 / max(1, len(peers))
    for i, n in enumerate(peers):
        vals = [d[n].ratio if n in d and math.isfinite(d[n].ratio) else 0.0 for _, d in groups]
        ax2.bar([x + i * width2 for x in xs], vals, width2, label=n, color=color[n])
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.set_ylabel("peer time / attnkit time (>1: attnkit faster)")
    for ax, k in ((ax1, len(names)), (ax2, len(peers))):
        ax.set_xticks([x + 0.4 - 0.4 / max(1, k) for x in xs])
        ax.set_xticklabels([g[0] for g in groups], fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

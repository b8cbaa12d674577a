"""python -m attnkit.bench: verify, then time attnkit against its peers (docs/BENCH.md).

Exit status: 0 when every contender's result verified, 1 when any verification FAILED (or
attnkit raised), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .registry import Case, load_ops, positive_int

INJECT_ENV = "ATTNKIT_BENCH_INJECT_ERROR"


def _split(values):
    out = []
    for v in values or []:
        out.extend(x.strip() for x in v.split(",") if x.strip())
    return out


def _parse_threads(values, default):
    if not values:
        return default
    out = []
    for v in _split(values):
        try:
            n = positive_int("--threads", v)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        if n not in out:
            out.append(n)
    return out


def build_parser(ops) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m attnkit.bench",
        description="Verify, then time attnkit against its peers in one run, as ratios "
                    "(protocol: docs/BENCH.md).",
        epilog="Shapes (attention): A (causal prefill B=1 Hq=32 Hkv=8 S=2048 D=128), A' / Ap "
               "(same, non-causal), V (B=1 H=24 S=4608 D=128, bf16), Dc (decode Sq=1 Skv=8192), "
               "or custom, e.g. \"B=1,Hq=32,Hkv=8,S=2048,D=128,causal\" (keys B Hq Hkv H S Sq "
               "Skv D Dv, flag causal; may start from a named shape: \"A,S=4096\"). "
               "Shapes (sparse_mla): B (s_q=1024 h_q=128 d_qk=576 d_v=512 topk=2048 s_kv=8192; fp8, "
               "bf16) or custom, e.g. \"B,s_q=128\" (keys s_q h_q d_qk d_v topk s_kv; missing keys as in B). "
               "Shapes (sage): V and A as for attention (bf16 and fp32 by default) or custom as for "
               "attention; --op sage --accuracy prints its accuracy against float64 instead of timing.")
    p.add_argument("--op", default="attention", choices=sorted(ops),
                   help="op to benchmark (default: attention)")
    p.add_argument("--shape", action="append", metavar="SHAPE",
                   help="named or custom shape; repeatable (default: the op's reference shapes)")
    p.add_argument("--dtype", action="append", metavar="DTYPE",
                   help="attention: float32 | bfloat16 | float16; sparse_mla: fp8 (float8_e4m3fn, "
                        "q8kv8) | bfloat16; paged: the cache's, bfloat16 | fp8; repeatable or "
                        "comma-separated (default: per shape, as in docs/BENCH.md)")
    p.add_argument("--threads", action="append", metavar="N[,N...]",
                   help="thread counts (default: 1 and all cores)")
    p.add_argument("--quick", action="store_true",
                   help="sequence lengths / 4 (sparse_mla: s_q at most 32) and fewer repeats (the "
                        "default run in < 1 min)")
    p.add_argument("--repeats", type=int, help="timed rounds (default: 7, quick: 3)")
    p.add_argument("--warmup", type=int, help="untimed rounds after verification (default: 1, "
                                              "quick: 0)")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="time budget per (shape, dtype, threads); repeats shrink to fit, never "
                        "below 3 (quick: 2) (default: 60, quick: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--csv", metavar="FILE", help="write every row to a CSV file")
    p.add_argument("--plot", metavar="FILE.png", help="bar charts of %% of path peak and peer ratios")
    p.add_argument("--accuracy", action="store_true",
                   help="no timing: accuracy against a float64 reference over all heads, exit 1 if "
                        "the op's accuracy contract fails (ops with an accuracy mode: sage; "
                        "default cases: the op's own, or --shape / --dtype)")
    p.add_argument("--list-shapes", action="store_true", help="print the named shapes and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    # Testing the tool: perturbs attnkit's output before verification (must report FAILED and
    # exit 1). Also enabled by ATTNKIT_BENCH_INJECT_ERROR=1.
    p.add_argument("--inject-error", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    ops = load_ops()
    parser = build_parser(ops)
    args = parser.parse_args(argv)
    op = ops[args.op]

    if args.list_shapes:
        for name, s in op.named_shapes().items():
            dims = s.dims() if hasattr(s, "dims") else str(s)
            print(f"{name:4s} {dims}  dtypes: {', '.join(op.dtypes_for(s, None)[0])}")
        return 0

    from .attention_op import DTYPE_ALIASES
    aliases = getattr(op, "dtype_aliases", None) or DTYPE_ALIASES  # an op may take its own
    requested = None
    if args.dtype:
        requested = []
        for d in _split(args.dtype):
            if d.lower() not in aliases:
                known = ", ".join(dict.fromkeys(aliases.values()))
                parser.error(f"--dtype: unknown dtype {d!r} for --op {op.name} ({known})")
            if aliases[d.lower()] not in requested:
                requested.append(aliases[d.lower()])

    try:
        shapes = [op.parse_shape(s) for s in (args.shape or op.default_shape_names())]
    except ValueError as e:
        parser.error(f"--shape: {e}")
    if args.quick:
        shapes = [op.quick_shape(s) for s in shapes]

    if args.accuracy:
        if not hasattr(op, "accuracy"):
            parser.error(f"--accuracy: --op {op.name} has no accuracy mode")
        import attnkit  # noqa: F401  (fails here if the extension is missing)
        return op.accuracy(shapes if args.shape else None, requested, seed=args.seed)

    notes, cases = [], []
    for s in shapes:
        dts, note = op.dtypes_for(s, requested)
        if note:
            notes.append(note)
        cases.extend(Case(s, d) for d in dts)
    if not cases:
        parser.error("nothing to run: " + "; ".join(notes))

    from .machine import cores
    from .runner import Progress, Settings, run

    all_cores = cores()
    try:
        threads = _parse_threads(args.threads, sorted({1, all_cores}))
    except SystemExit as e:
        parser.error(str(e))

    settings = Settings(quick=args.quick, seed=args.seed,
                        inject_error=args.inject_error or os.environ.get(INJECT_ENV, "") not in
                        ("", "0"))
    if args.quick:
        settings.warmup, settings.repeats, settings.min_repeats = 0, 3, 2
        settings.budget_s, settings.min_sample_s = 3.0, 0.005
    if args.repeats is not None:
        settings.repeats = max(1, args.repeats)
        settings.min_repeats = min(settings.min_repeats, settings.repeats)
    if args.warmup is not None:
        settings.warmup = max(0, args.warmup)
    if args.budget is not None:
        settings.budget_s = args.budget

    import attnkit  # noqa: F401  (fails here, not mid-run, if the extension is missing)

    from . import machine as machine_mod
    from .report import format_tables, write_csv, write_plot

    progress = Progress(enabled=not args.no_progress)
    t0 = time.perf_counter()
    mach = machine_mod.measure(threads, progress)
    rows = run(op, cases, threads, mach, settings, progress, notes)
    machine_mod.measure(threads, progress, mach)  # again after the run; keeps the best
    progress.done()
    peak_of = getattr(op, "peak_of", lambda r: machine_mod.FP32_FMA)
    for r in rows:
        path = peak_of(r)
        r.peak_of, r.peak_gflops = machine_mod.path_label(path), mach.path_peak(path, r.threads)
        r.read_gbs = mach.read_gbs[r.threads]
    elapsed = time.perf_counter() - t0

    quick = f", quick ({getattr(op, 'quick_note', 'sequence lengths / 4')})" if args.quick else ""
    print(mach.line() + " (best of before/after the run)")
    print(f"op {op.name}: {len(cases)} case(s), threads {', '.join(map(str, threads))}"
          f"{quick}; median of "
          f"{settings.repeats} interleaved rounds (fewer where the budget is short); "
          f"ratio = contender time / attnkit time (>1: attnkit faster); % of path peak = of the "
          f"peak measured above, for the same thread count, of the instruction the row's path "
          f"runs on (a mixed path: its FLOP shares each at its instruction's peak); verify: "
          f"'ok (err E)' with E = max |out - ref| / rms(ref) over the checked subset against the "
          f"float64 reference (peers: the larger of that and the same against attnkit's output)")
    rule = mach.bf16_rule_check()
    if rule:
        print(f"note: {rule}")
    if settings.inject_error:
        print("note: --inject-error: attnkit's output is perturbed before verification")
    for n in notes:
        print(f"note: {n}")
    print()
    print(format_tables(rows))

    if any(r.timed and r.pct_peak > 100 for r in rows):
        print("note: % of path peak above 100 means the peak measurement was slowed by other load on "
              "this machine (or the row's path is not the one named); ratios in the same run still hold")
    failed = [r for r in rows if r.status == "FAILED"]
    if args.csv:
        write_csv(args.csv, rows)
        print(f"wrote {args.csv}")
    if args.plot:
        try:
            write_plot(args.plot, rows, f"attnkit {op.name} — {mach.model}, isa {mach.isa}")
            print(f"wrote {args.plot}")
        except ImportError as e:
            print(f"note: --plot skipped: {e}", file=sys.stderr)
    if failed:
        print(f"verification FAILED for {len(failed)} of {len(rows)} rows "
              f"({elapsed:.0f} s)")
        return 1
    print(f"all {len(rows)} rows verified ({elapsed:.0f} s)")
    return 0

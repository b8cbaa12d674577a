"""Ring attention benchmark: ``python -m attnkit.bench.ring``.

2 ranks × 1 thread (gloo on loopback, zigzag shards) against 1 process × 1 thread
(attnkit.attention on the whole sequence), causal, interleaved rep by rep inside one
spawned group: rank 0 times the single-process call while rank 1 waits at a barrier,
then both time ring_attention. Each rank is pinned to its own core (--no-pin: not), and
both contenders write preallocated outputs (out=), so neither pays first-touch page faults
on a new output each call (--fresh-out: they allocate, as plain calls do). Reports medians
of the wall time (the slower rank), the speed-up with its spread over reps, the CPU time
and page faults of each, and per rank and ring step the median compute (of which merging),
wait (transfer not hidden) and the time outside the steps (exchange of shapes, packing).
Both outputs are checked against a float64 reference on a few rows first.
"""

import argparse
import datetime
import os
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: no spinning OpenMP threads


def _verify(q, k, v, outs, dtype):
    """Both contenders' outputs on 2 heads x 5 rows against a float64 reference, with the
    attention benchmark's per-dtype tolerances (attention_op._check); raises if either fails."""
    import numpy as np

    from attnkit.bench.attention_op import _check

    seq, group = q.shape[2], q.shape[1] // k.shape[1]
    heads, rows = sorted({0, q.shape[1] - 1}), sorted({0, 1, seq // 3, seq // 2, seq - 1})
    ref = np.empty((len(heads), len(rows), v.shape[3]))
    magnitude = np.empty_like(ref)
    for a, h in enumerate(heads):
        kh, vh = (x[0, h // group].double().numpy() for x in (k, v))
        for b, i in enumerate(rows):  # causal: keys 0 .. i
            s = kh[:i + 1] @ q[0, h, i].double().numpy() / np.sqrt(q.shape[3])
            p = np.exp(s - s.max())
            ref[a, b], magnitude[a, b] = p @ vh[:i + 1] / p.sum(), p @ np.abs(vh[:i + 1]) / p.sum()
    for name, out in outs.items():
        got = out[0][heads][:, rows].double().numpy()
        chk = _check(got, ref, {"fp32": "float32", "bf16": "bfloat16"}[dtype], magnitude=magnitude)
        if not chk.ok:
            raise AssertionError(f"{name} vs the float64 reference: {chk.detail}")
        print(f"verified: {name} vs the float64 reference (2 heads x 5 rows), max error {chk.err:.2e} of the rms",
              flush=True)


def _rank_main(rank, world, store_path, args, result_path):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    import torch
    import torch.distributed as dist

    import attnkit
    from attnkit import distributed as ad

    if args.pin:  # before gloo starts its threads: they share the rank's core
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(1)
    attnkit.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.heads, args.seq, args.dim, generator=g).to(dtype)
    k = torch.randn(1, args.kv_heads, args.seq, args.dim, generator=g).to(dtype)
    v = torch.randn(1, args.kv_heads, args.seq, args.dim, generator=g).to(dtype)
    gqa = args.heads != args.kv_heads
    lq, lk, lv = (ad.shard_sequence(x, world, rank, layout="zigzag") for x in (q, k, v))

    out_single = None if args.fresh_out else torch.empty(1, args.heads, args.seq, args.dim, dtype=dtype)
    out_ring = None if args.fresh_out else torch.empty(lq.shape, dtype=dtype)
    single_s, single_cpu, single_faults, ring_s, ring_cpu, ring_faults, steps, outside = ([] for _ in range(8))
    for rep in range(args.reps + 1):  # rep 0 warms up and verifies
        dist.barrier()
        if rank == 0:
            t0, c0, f0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            want = attnkit.attention(q, k, v, causal=True, enable_gqa=gqa, out=out_single)
            single_s.append(time.perf_counter() - t0)
            single_cpu.append(time.process_time() - c0)
            single_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        dist.barrier()
        timings = []
        t0, c0, f0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = ad.ring_attention(lq, lk, lv, causal=True, layout="zigzag", enable_gqa=gqa, out=out_ring,
                                timings=timings)
        mine = time.perf_counter() - t0
        ring_cpu.append(time.process_time() - c0)
        ring_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        wall = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        ring_s.append(wall.item())
        steps.append(timings)
        outside.append(mine - sum(t["compute_s"] + t["wait_s"] for t in timings))
        if rep == 0:
            full = ad.gather_sequence(out, layout="zigzag")
            if rank == 0:
                _verify(q, k, v, {"one process": want, "ring": full}, args.dtype)
    gathered = [None] * world
    dist.all_gather_object(gathered, (steps[1:], ring_cpu[1:], ring_faults[1:], outside[1:]))
    if rank == 0:
        import json
        with open(result_path, "w") as f:
            json.dump({"single_s": single_s[1:], "single_cpu_s": single_cpu[1:], "single_faults": single_faults[1:],
                       "ring_s": ring_s[1:], "steps": [g[0] for g in gathered], "ring_cpu_s": [g[1] for g in gathered],
                       "ring_faults": [g[2] for g in gathered], "outside_s": [g[3] for g in gathered]}, f)
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-pin", dest="pin", action="store_false", help="leave the ranks unpinned")
    p.add_argument("--fresh-out", action="store_true", help="allocate outputs on every call")
    args = p.parse_args(argv)
    import json

    import torch.multiprocessing as mp
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(_rank_main, args=(world, os.path.join(tmp, "store"), args, result_path), nprocs=world, join=True)
        with open(result_path) as f:
            r = json.load(f)
    single, ring = statistics.median(r["single_s"]), statistics.median(r["ring_s"])
    ratios = sorted(s / t for s, t in zip(r["single_s"], r["ring_s"]))  # rep by rep: the same moment
    flops = 4 * args.seq * args.seq * args.dim * args.heads / 2  # causal: half the score matrix
    print(f"shape B=1 Hq={args.heads} Hkv={args.kv_heads} S={args.seq} D=Dv={args.dim} {args.dtype} causal, "
          f"zigzag, {args.reps} reps, ranks {'pinned to a core each' if args.pin else 'unpinned'}, outputs "
          f"{'allocated per call' if args.fresh_out else 'preallocated (out=)'} (medians; on a shared machine "
          "the figures are indicative)")
    print("| contender | ms | GFLOP/s | speed-up |")
    print("|---|---|---|---|")
    print(f"| 1 rank x 1 thread (attnkit.attention) | {single * 1e3:.0f} | {flops / single / 1e9:.1f} | 1.00x |")
    print(f"| 2 ranks x 1 thread (ring_attention) | {ring * 1e3:.0f} | {flops / ring / 1e9:.1f} | "
          f"{single / ring:.2f}x |")
    print(f"speed-up rep by rep: median {statistics.median(ratios):.2f}x, min {ratios[0]:.2f}x, max {ratios[-1]:.2f}x")
    print(f"single reps (ms): {[round(x * 1e3) for x in r['single_s']]}; ring reps (ms): "
          f"{[round(x * 1e3) for x in r['ring_s']]}")
    # CPU seconds (process time, gloo's threads included) do not depend on how many cores
    # the other tenants leave: they show how the work splits.
    cpu = [statistics.median(c) for c in r["ring_cpu_s"]]
    print(f"CPU s per call (medians): 1 rank {statistics.median(r['single_cpu_s']):.3f}; ring ranks "
          + ", ".join(f"{c:.3f}" for c in cpu))
    print(f"page faults per call (medians): 1 rank {statistics.median(r['single_faults']):.0f}; ring ranks "
          + ", ".join(f"{statistics.median(f):.0f}" for f in r["ring_faults"]))
    print("| rank | step | compute ms | of which merge ms | wait ms |")
    print("|---|---|---|---|---|")
    for rank, reps in enumerate(r["steps"]):
        for step in range(world):
            compute = statistics.median(rep[step]["compute_s"] for rep in reps)
            merge = statistics.median(rep[step]["merge_s"] for rep in reps)
            wait = statistics.median(rep[step]["wait_s"] for rep in reps)
            print(f"| {rank} | {step} | {compute * 1e3:.1f} | {merge * 1e3:.1f} | {wait * 1e3:.1f} |")
    print("outside the steps (exchange, packing), ms per call: "
          + ", ".join(f"rank {rank} {statistics.median(o) * 1e3:.1f}" for rank, o in enumerate(r["outside_s"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

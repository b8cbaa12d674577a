"""attnkit.distributed: shard arithmetic and causal pieces in process, then spawned gloo
groups of 2 and 3 ranks on loopback (a FileStore, GLOO_SOCKET_IFNAME=lo): bitwise
tensor-parallel equality on 128 heads at TP 3 (43/43/42), ring attention against the
float64 reference and against one process (causal both ways and not, contiguous of uneven
lengths and zigzag, GQA, bf16), and the mismatch errors raised on every rank.

Each group is one spawn running all of its cases (a spawn costs seconds of imports); the
ranks run 1 thread each."""

import datetime
import os
import re
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import attnkit  # noqa: E402
from attnkit import distributed as ad  # noqa: E402
from reference import attention_ref, to_f64  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo not available")


# ---- in process

def test_shard_heads_arithmetic():
    assert [ad.shard_heads(128, 3, r) for r in range(3)] == [(0, 43), (43, 43), (86, 42)]
    for heads in (0, 1, 5, 64, 127, 128):
        for world in (1, 2, 3, 7, 200):
            shards = [ad.shard_heads(heads, world, r) for r in range(world)]
            assert sum(c for _, c in shards) == heads
            assert all(s == sum(c for _, c in shards[:r]) for r, (s, _) in enumerate(shards))
            assert max(c for _, c in shards) - min(c for _, c in shards) <= 1
            assert [c for _, c in shards] == sorted((c for _, c in shards), reverse=True)


@pytest.mark.parametrize("args, message", [
    ((128, 0, 0), "world_size must be an int >= 1, got 0"),
    ((128, 3, 3), r"rank must be an int in \[0, 3\), got 3"),
    ((128, 3, -1), r"rank must be an int in \[0, 3\), got -1"),
    ((-1, 3, 0), "num_heads must be an int >= 0, got -1"),
    ((128.0, 3, 0), "num_heads must be an int >= 0, got 128.0"),
    ((128, True, 0), "world_size must be an int >= 1, got True"),
])
def test_shard_heads_errors(args, message):
    with pytest.raises(ValueError, match=message):
        ad.shard_heads(*args)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_sequence_segments_partition(layout):
    for seq_len in (0, 1, 5, 12, 37):
        for world in (1, 2, 3, 4):
            covered = sorted(p for r in range(world) for s, e in ad.sequence_segments(seq_len, world, r, layout)
                             for p in range(s, e))
            assert covered == list(range(seq_len))
    assert ad.sequence_segments(16, 2, 0, "zigzag") == [(0, 4), (12, 16)]
    assert ad.sequence_segments(16, 2, 1, "zigzag") == [(4, 8), (8, 12)]
    with pytest.raises(ValueError, match='layout must be "contiguous" or "zigzag", got \'ring\''):
        ad.sequence_segments(16, 2, 0, "ring")


def test_visible_runs_cover_the_mask_exactly():
    # For ascending disjoint segments of rows and keys and any shift, every (query, key) pair
    # with key <= query + shift (global positions) is in exactly one run, none other.
    rng = np.random.default_rng(0)

    def segments(total, count):
        cuts = np.sort(rng.integers(0, total + 1, 2 * count)).tolist()
        return [(cuts[2 * i], cuts[2 * i + 1]) for i in range(count)]

    for _ in range(3000):
        total = int(rng.integers(0, 14))
        q_segments, kv_segments = segments(total, int(rng.integers(1, 3))), segments(total, int(rng.integers(1, 3)))
        shift = int(rng.integers(-8, 9))
        q_pos = [a for s, e in q_segments for a in range(s, e)]
        kv_pos = [b for s, e in kv_segments for b in range(s, e)]
        want = (np.array(kv_pos, int)[None, :] <= np.array(q_pos, int)[:, None] + shift).astype(int)
        got = np.zeros((len(q_pos), len(kv_pos)), int)
        for r0, r1, kv_end, causal in ad.visible_runs(q_segments, kv_segments, shift):
            assert causal in (False, "bottom_right")
            assert 0 <= r0 < r1 <= len(q_pos) and 0 < kv_end <= len(kv_pos)
            for a in range(r0, r1):
                for b in range(kv_end):
                    # bottom-right on the run: row a - r0 sees b <= (a - r0) + kv_end - (r1 - r0)
                    got[a, b] += not causal or b <= (a - r0) + kv_end - (r1 - r0)
        np.testing.assert_array_equal(got, want, err_msg=f"{q_segments} {kv_segments} {shift}")


def test_visible_runs_one_call_per_zigzag_step():
    # 2 ranks, zigzag, causal: each step is one attention call, its own block one
    # bottom-right call across both chunks (chunk sizes 4, S = 16).
    segments = [ad.sequence_segments(16, 2, r) for r in range(2)]
    assert ad.visible_runs(segments[0], segments[0], 0) == [(0, 8, 8, "bottom_right")]
    assert ad.visible_runs(segments[0], segments[1], 0) == [(4, 8, 8, False)]
    assert ad.visible_runs(segments[1], segments[0], 0) == [(0, 8, 4, False)]
    assert ad.visible_runs(segments[1], segments[1], 0) == [(0, 8, 8, "bottom_right")]


def test_needs_an_initialised_group():
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    q = torch.ones(1, 1, 2, 4)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        ad.ring_attention(q, q, q)


def test_ring_refuses_inputs_that_require_grad():
    """Forward only: an input that requires grad is refused (before any collective), not
    silently detached."""
    q = torch.ones(1, 1, 2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="ring_attention has no backward yet, and q requires grad"):
        ad.ring_attention(q, q.detach(), q.detach())


# ---- spawned groups

def _init(rank, world, store_path):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    torch.set_num_threads(1)
    attnkit.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _inputs(seed, shape_q, shape_kv, dv, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)  # the same full tensors on every rank
    q = torch.randn(*shape_q, generator=g).to(dtype)
    k = torch.randn(*shape_kv, generator=g).to(dtype)
    v = torch.randn(*shape_kv[:3], dv, generator=g).to(dtype)
    return q, k, v


def _ring_case(rank, world, *, seed, B, Hq, Hkv, Sq, Skv, D, Dv, causal, layout, dtype=torch.float32,
               q_lens=None, kv_lens=None, group=None, with_out=False):
    """Ring attention on this rank's shard against the float64 reference and one process
    (with_out: into a NaN-poisoned out=, a strided view)."""
    q, k, v = _inputs(seed, (B, Hq, Sq, D), (B, Hkv, Skv, D), Dv, dtype)
    if q_lens is None:
        lq = ad.shard_sequence(q, world, rank, layout=layout)
        lk, lv = (ad.shard_sequence(x, world, rank, layout=layout) for x in (k, v))
    else:  # contiguous shards of the given lengths
        qs, ks = sum(q_lens[:rank]), sum(kv_lens[:rank])
        lq, lk, lv = q[:, :, qs:qs + q_lens[rank]], k[:, :, ks:ks + kv_lens[rank]], v[:, :, ks:ks + kv_lens[rank]]
    timings = []
    given = None
    if with_out:  # BSHD storage seen as BHSD: not contiguous
        given = torch.full((B, lq.shape[2], Hq, Dv), float("nan"), dtype=dtype).transpose(1, 2)
    out, lse = ad.ring_attention(lq, lk, lv, group=group, causal=causal, layout=layout, enable_gqa=Hq != Hkv,
                                 return_lse=True, out=given, timings=timings)
    assert given is None or out is given
    assert len(timings) == world
    assert all(t["compute_s"] >= t["merge_s"] >= 0 and t["wait_s"] >= 0 for t in timings)
    assert out.dtype == dtype and out.shape == lq.shape[:3] + (Dv,) and lse.shape == lq.shape[:3]
    full = ad.gather_sequence(out, group=group, layout=layout)
    full_lse = ad.gather_sequence(lse, group=group, layout=layout)
    want, want_lse = attention_ref(q, k, v, causal=causal, enable_gqa=Hq != Hkv)
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    np.testing.assert_allclose(to_f64(full), want, rtol=tol, atol=tol)
    finite = np.isfinite(want_lse)
    np.testing.assert_array_equal(to_f64(full_lse)[~finite], want_lse[~finite])
    np.testing.assert_allclose(to_f64(full_lse)[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    single = attnkit.attention(q, k, v, causal=causal, enable_gqa=Hq != Hkv)
    np.testing.assert_allclose(to_f64(full), to_f64(single), rtol=tol, atol=tol)


def _expect_error(fn, message):
    try:
        fn()
    except ValueError as e:
        assert re.search(message, str(e)), f"{e!r} does not match {message!r}"
        return
    raise AssertionError(f"no ValueError matching {message!r}")


def _two_ranks(rank, world, store_path):
    _init(rank, world, store_path)
    # Non-causal, contiguous shards of uneven lengths (q and k/v split differently), GQA, Dv != D.
    _ring_case(rank, world, seed=1, B=2, Hq=4, Hkv=2, Sq=19, Skv=23, D=16, Dv=12, causal=False,
               layout="contiguous", q_lens=[5, 14], kv_lens=[17, 6])
    # Causal top-left, zigzag of a length that does not divide into 4 chunks.
    _ring_case(rank, world, seed=2, B=1, Hq=3, Hkv=3, Sq=37, Skv=37, D=32, Dv=32, causal=True, layout="zigzag")
    # Causal bottom-right: q the last 20 positions of 45 keys, contiguous uneven, GQA.
    _ring_case(rank, world, seed=3, B=1, Hq=4, Hkv=1, Sq=20, Skv=45, D=8, Dv=8, causal="bottom_right",
               layout="contiguous", q_lens=[7, 13], kv_lens=[30, 15])
    # The same on zigzag shards (q and k/v zigzagged independently).
    _ring_case(rank, world, seed=4, B=1, Hq=2, Hkv=2, Sq=21, Skv=50, D=8, Dv=8, causal="bottom_right",
               layout="zigzag")
    # Top-left with more queries than keys: the last queries see every key; bf16; a rank
    # with an empty k/v shard.
    _ring_case(rank, world, seed=5, B=1, Hq=2, Hkv=2, Sq=30, Skv=12, D=16, Dv=16, causal=True,
               layout="contiguous", dtype=torch.bfloat16, q_lens=[16, 14], kv_lens=[12, 0])
    # Non-causal zigzag, the case of 300 keys over tile edges, into out=.
    _ring_case(rank, world, seed=6, B=1, Hq=2, Hkv=1, Sq=300, Skv=300, D=64, Dv=64, causal=False, layout="zigzag",
               with_out=True)
    # Causal shards where a step's run covers rows with and without an earlier partial; bf16
    # into out= (out itself accumulates); the same call twice (the kept buffers are reused).
    for _ in range(2):
        _ring_case(rank, world, seed=9, B=1, Hq=2, Hkv=2, Sq=11, Skv=12, D=8, Dv=8, causal=True,
                   layout="contiguous", q_lens=[4, 7], kv_lens=[5, 7], dtype=torch.bfloat16, with_out=True)
    _ring_case(rank, world, seed=10, B=1, Hq=2, Hkv=1, Sq=9, Skv=14, D=8, Dv=8, causal="bottom_right",
               layout="contiguous", q_lens=[2, 7], kv_lens=[8, 6], with_out=True)

    # Errors: the same ValueError on both ranks, no hang.
    x = torch.randn(1, 2, 8, 16)
    bf = x.to(torch.bfloat16)
    _expect_error(lambda: ad.ring_attention(x if rank == 0 else bf, x if rank == 0 else bf,
                                            x if rank == 0 else bf, layout="contiguous"),
                  r"ranks disagree on dtype: rank 0 has torch.float32, rank 1 has torch.bfloat16")
    _expect_error(lambda: ad.ring_attention(x, x, x, causal=rank == 1, layout="contiguous"),
                  r"ranks disagree on options")
    _expect_error(lambda: ad.ring_attention(x if rank == 0 else x[0], x, x, layout="contiguous"),
                  r"invalid input on rank 1: q must be 4-d \[B, H, S, D\] \(BHSD\), got 3-d")
    _expect_error(lambda: ad.ring_attention(x, x[:, :1], x[:, :1], layout="contiguous"),
                  r"rank 0: q has 2 heads and k 1: Hq != Hkv needs enable_gqa=True.*; rank 1: q has 2 heads")
    _expect_error(lambda: ad.ring_attention(x, x, x if rank == 0 else x[..., :8], layout="contiguous"),
                  r"invalid input on rank 1: v must have|ranks disagree on k/v's")
    _expect_error(lambda: ad.ring_attention(x, x, x[..., :4] if rank == 0 else x[..., :8], layout="contiguous"),
                  r"ranks disagree on k/v's \[B, Hkv, D\] or Dv")
    _expect_error(lambda: ad.ring_attention(x, x, x, layout="zigzag" if rank == 0 else "contiguous"),
                  r"ranks disagree on options")
    _expect_error(lambda: ad.ring_attention(x[:, :, :4 - rank], x, x, layout="zigzag"),
                  r"zigzag q shards of a sequence of 7 must have lengths \[3, 4\] \(see shard_sequence\), got \[4, 3\]")
    _expect_error(lambda: ad.ring_attention(x, x, x, layout="zigzag", timeout=5 if rank else None),
                  r"rank 1: timeout must be a datetime.timedelta, got int")
    _expect_error(lambda: ad.ring_attention(x, x.to(torch.float16), x, layout="zigzag"),
                  r"q, k and v must have one dtype")
    _expect_error(lambda: ad.ring_attention(x, x, x, layout="contiguous", out=torch.empty(1, 2, 8, 16 - rank)),
                  r"invalid input on rank 1: out must be torch.float32 \[1, 2, 8, 16\] \(q's dtype, \[B, Hq, Sq, Dv\]\), "
                  r"got torch.float32 \[1, 2, 8, 15\]")
    _expect_error(lambda: ad.ring_attention(x, x, x, layout="contiguous", out=bf.clone() if rank else None),
                  r"invalid input on rank 1: out must be torch.float32 .* got torch.bfloat16")
    _expect_error(lambda: ad.ring_attention(x, x, x, layout="contiguous", out=x.numpy() if rank else None),
                  r"invalid input on rank 1: out must be None or a CPU torch tensor, got ndarray")
    kv = torch.randn(1, 2, 16, 16)
    _expect_error(lambda: ad.ring_attention(x, kv[:, :, :8], kv[:, :, :8],
                                            layout="contiguous", out=kv[:, :, 4:12] if rank == 0 else None),
                  r"invalid input on rank 0: out must not overlap k")
    # After the errors the group still works.
    _ring_case(rank, world, seed=7, B=1, Hq=1, Hkv=1, Sq=8, Skv=8, D=8, Dv=8, causal=True, layout="zigzag")
    # A group of one rank: no transfers, the whole sequence.
    alone = [dist.new_group([r]) for r in range(world)][rank]
    _ring_case(0, 1, seed=8, B=1, Hq=2, Hkv=1, Sq=9, Skv=9, D=8, Dv=8, causal=True, layout="zigzag", group=alone)
    # A rank that never calls: the other raises after its timeout instead of hanging. (The
    # group is unusable afterwards, so this comes last.)
    if rank == 0:
        started = time.monotonic()
        try:
            ad.ring_attention(x, x, x, timeout=datetime.timedelta(seconds=1))
            raise AssertionError("no timeout")
        except RuntimeError as e:
            assert "not every rank of the group joined (waited at most 0:00:01" in str(e), str(e)
            assert "timed out" in str(e).lower(), str(e)
        assert 0.9 < time.monotonic() - started < 30
    if rank == 1:
        time.sleep(3)  # still in the group, never calling
    dist.destroy_process_group()


def _three_ranks(rank, world, store_path):
    _init(rank, world, store_path)
    # Tensor parallelism: 128 heads at TP 3 (43/43/42); each rank runs its heads; the gathered
    # results equal one process's bit for bit.
    start, count = ad.shard_heads(128, world, rank)
    assert count == (43, 43, 42)[rank]
    q, k, v = _inputs(11, (1, 128, 24, 16), (1, 128, 24, 16), 16)
    local = attnkit.attention(ad.local_heads(q), ad.local_heads(k), ad.local_heads(v), causal=True)
    assert local.shape[1] == count
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    torch.testing.assert_close(torch.cat(gathered, dim=1), attnkit.attention(q, k, v, causal=True), rtol=0, atol=0)

    g = torch.Generator().manual_seed(12)
    s_q, s_kv, d_qk, d_v, topk = 5, 40, 64, 32, 16
    mq = torch.randn(s_q, 128, d_qk, generator=g).to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, d_qk, generator=g).to(torch.bfloat16)
    indices = torch.randint(-1, s_kv, (s_q, 1, topk), generator=g, dtype=torch.int32)
    sink = torch.randn(128, generator=g)
    want = attnkit.sparse_mla_prefill_fwd(mq, kv, indices, 0.125, d_v, attn_sink=sink)
    got = attnkit.sparse_mla_prefill_fwd(mq[:, start:start + count], kv, indices, 0.125, d_v,
                                         attn_sink=sink[start:start + count])
    gathered = [None] * world
    dist.all_gather_object(gathered, got)
    for i, name in enumerate(("out", "max_logits", "lse")):
        torch.testing.assert_close(torch.cat([r[i] for r in gathered], dim=1), want[i], rtol=0, atol=0,
                                   msg=lambda m: f"{name}: {m}")

    # Ring over 3 ranks: zigzag causal with GQA; contiguous non-causal of uneven lengths.
    _ring_case(rank, world, seed=13, B=1, Hq=6, Hkv=2, Sq=50, Skv=50, D=16, Dv=16, causal=True, layout="zigzag")
    _ring_case(rank, world, seed=14, B=2, Hq=2, Hkv=2, Sq=31, Skv=31, D=8, Dv=8, causal=True,
               layout="contiguous", q_lens=[20, 1, 10], kv_lens=[20, 1, 10])
    _ring_case(rank, world, seed=15, B=1, Hq=2, Hkv=2, Sq=17, Skv=9, D=8, Dv=4, causal=False,
               layout="contiguous", q_lens=[0, 9, 8], kv_lens=[3, 3, 3])
    # bf16 over 3 ranks: a float32 accumulator; runs over rows with and without a partial,
    # rows whose first partial comes late, rows that see no key.
    _ring_case(rank, world, seed=17, B=1, Hq=2, Hkv=1, Sq=19, Skv=9, D=8, Dv=8, causal="bottom_right",
               layout="contiguous", q_lens=[8, 4, 7], kv_lens=[5, 1, 3], dtype=torch.bfloat16, with_out=True)
    _ring_case(rank, world, seed=18, B=1, Hq=4, Hkv=2, Sq=61, Skv=61, D=16, Dv=16, causal=True, layout="zigzag",
               dtype=torch.bfloat16)
    # A subgroup of global ranks 1 and 2: ring neighbours are mapped to global ranks.
    pair = dist.new_group([1, 2])
    if rank > 0:
        _ring_case(rank - 1, 2, seed=16, B=1, Hq=2, Hkv=2, Sq=20, Skv=20, D=8, Dv=8, causal=True,
                   layout="zigzag", group=pair)
    x = torch.randn(1, 4, 6, 8)
    _expect_error(lambda: ad.ring_attention(x if rank != 2 else x[:, :2], x if rank != 2 else x[:, :2],
                                            x if rank != 2 else x[:, :2], layout="contiguous"),
                  r"ranks disagree on q's \[B, Hq, D\]: rank 0 has \[1, 4, 6, 8\], rank 2 has \[1, 2, 6, 8\]")
    dist.destroy_process_group()


@pytest.mark.parametrize("world, body", [(2, _two_ranks), (3, _three_ranks)])
def test_spawned_group(tmp_path, world, body):
    mp.spawn(body, args=(world, str(tmp_path / "store")), nprocs=world, join=True)


def test_ring_benchmark_runs(capfd):
    from attnkit.bench import ring
    assert ring.main(["--seq", "256", "--heads", "2", "--kv-heads", "1", "--dim", "32", "--reps", "1"]) == 0
    text = capfd.readouterr().out  # the ranks print from their own processes
    assert "verified: one process vs the float64 reference" in text and "verified: ring vs the float64 reference" in text
    assert "| 2 ranks x 1 thread (ring_attention) |" in text
    # 2 ranks x 2 steps of compute, merge and wait
    assert len(re.findall(r"^\| [01] \| [01] \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$", text, re.M)) == 4
    assert re.search(r"^speed-up rep by rep: median [0-9.]+x, min [0-9.]+x, max [0-9.]+x$", text, re.M)
    assert re.search(r"^outside the steps \(exchange, packing\), ms per call: rank 0 [0-9.]+, rank 1 [0-9.]+$", text,
                     re.M)

"""attnkit on torch.distributed (gloo on CPUs; the same calls on any backend with p2p):
tensor-parallel head shards and ring (context-parallel) attention.

Tensor parallelism needs no special op: a rank takes its heads (shard_heads) and calls
attnkit.attention / sparse_mla_prefill_fwd on them; results are per head, so gathering
them gives the single-process result bit for bit. ring_attention shards the sequence.

    # every rank, after torch.distributed.init_process_group("gloo", ...):
    rank, world = dist.get_rank(), dist.get_world_size()
    start, count = shard_heads(128, world, rank)               # TP: this rank's heads
    out = attnkit.attention(q[:, start:start + count], k[:, start:start + count], ...)
    lq, lk, lv = (shard_sequence(x, world, rank) for x in (q, k, v))   # CP: zigzag shards
    out = ring_attention(lq, lk, lv, causal=True)              # this rank's queries
    full = gather_sequence(out)                                # if every rank needs it all
"""

import datetime
import json
import math
import threading
import time

import torch
import torch.distributed as dist

from .merge import merge_attention_states
from ._torch_ops import check_no_grad
from .ops import causal_code, run_attention

__all__ = ["shard_heads", "local_heads", "sequence_segments", "shard_sequence", "gather_sequence",
           "ring_attention"]

LAYOUTS = ("contiguous", "zigzag")
_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


def _check_int(x, name, low):
    if isinstance(x, bool) or not isinstance(x, int) or x < low:
        raise ValueError(f"{name} must be an int >= {low}, got {x!r}")


def shard_heads(num_heads, world_size, rank):
    """(start, count) of the heads rank owns when num_heads are split over world_size
    ranks: contiguous blocks, the first num_heads % world_size ranks one head more
    (SGLang's split: 128 heads at TP 3 are 43/43/42)."""
    _check_int(num_heads, "num_heads", 0)
    _check_int(world_size, "world_size", 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    base, extra = divmod(num_heads, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def _rank_and_size(group):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised: call torch.distributed.init_process_group first")
    return dist.get_rank(group), dist.get_world_size(group)


def local_heads(x, *, group=None, dim=1):
    """This rank's heads of x along dim (a view), per shard_heads."""
    rank, world = _rank_and_size(group)
    start, count = shard_heads(x.shape[dim], world, rank)
    return x.narrow(dim, start, count)


def _zigzag_chunks(seq_len, world_size):
    """Bounds of the 2·world_size chunks of a zigzag split (sizes differ by at most 1)."""
    base, extra = divmod(seq_len, 2 * world_size)
    bounds = [0]
    for c in range(2 * world_size):
        bounds.append(bounds[-1] + base + (c < extra))
    return bounds


def sequence_segments(seq_len, world_size, rank, layout="zigzag"):
    """The global positions rank holds, as [(start, end), ...] in local order.

    contiguous: one block of an even split (the first seq_len % world_size ranks one more);
    ring_attention also takes contiguous shards of any lengths, in rank order.
    zigzag: the sequence cut into 2·world_size chunks; rank r holds chunks r and
    2·world_size - 1 - r, which balances causal work across ranks."""
    _check_int(seq_len, "seq_len", 0)
    if layout == "contiguous":
        start, count = shard_heads(seq_len, world_size, rank)
        return [(start, start + count)]
    if layout == "zigzag":
        shard_heads(0, world_size, rank)  # checks world_size and rank
        b = _zigzag_chunks(seq_len, world_size)
        j = 2 * world_size - 1 - rank
        return [(b[rank], b[rank + 1]), (b[j], b[j + 1])]
    raise ValueError(f'layout must be "contiguous" or "zigzag", got {layout!r}')


def shard_sequence(x, world_size, rank, *, layout="zigzag", dim=2):
    """This rank's shard of the full sequence x along dim (dim 2 of BHSD), per sequence_segments."""
    segments = sequence_segments(x.shape[dim], world_size, rank, layout)
    parts = [x.narrow(dim, s, e - s) for s, e in segments]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def gather_sequence(local, *, group=None, layout="zigzag", dim=2):
    """The full sequence from every rank's shard (all ranks get it): the inverse of
    shard_sequence, and of ring_attention's contiguous shards of any lengths."""
    rank, world = _rank_and_size(group)
    lengths = [None] * world
    dist.all_gather_object(lengths, int(local.shape[dim]), group=group)
    longest = max(max(lengths), 1)
    padded = torch.zeros(*local.shape[:dim], longest, *local.shape[dim + 1:], dtype=local.dtype)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    wire = padded.view(torch.uint8) if padded.dtype.itemsize == 1 else padded
    gathered = [torch.empty_like(wire) for _ in range(world)]
    dist.all_gather(gathered, wire.contiguous(), group=group)
    shards = [g.view(local.dtype).narrow(dim, 0, n) for g, n in zip(gathered, lengths)]
    if layout == "contiguous":
        return torch.cat(shards, dim=dim)
    total = sum(lengths)
    out = torch.empty(*local.shape[:dim], total, *local.shape[dim + 1:], dtype=local.dtype)
    for r, shard in enumerate(shards):
        offset = 0
        for s, e in sequence_segments(total, world, r, layout):
            out.narrow(dim, s, e - s).copy_(shard.narrow(dim, offset, e - s))
            offset += e - s
    return out


def visible_runs(q_segments, kv_segments, shift):
    """The attention calls that cover "the query at global position a sees the key at
    global position b iff b <= a + shift" for one rank's queries against one K/V block, as
    (row_start, row_end, kv_end, causal): attention on local rows [row_start, row_end) and
    local keys [0, kv_end), causal False or "bottom_right" (attention's own conventions).

    q_segments and kv_segments are the global [start, end) runs of the local rows and
    keys, in local order and ascending (as zigzag and contiguous shards are). A query at a
    then sees a prefix of the local keys, of length L(a) that grows by one per row inside a
    key segment and is flat elsewhere. Maximal runs of local rows where L is flat become one
    call without a mask on keys [0, L); runs where L grows by one per row one bottom-right
    causal call on keys [0, L of the last row). Runs continue across the rows' segment
    boundaries, so zigzag's two chunks share calls (2 ranks: one call per step).
    Rows that see no key are left out: they stay empty."""
    def visible(a):
        return sum(min(max(a + shift + 1 - ks, 0), ke - ks) for ks, ke in kv_segments)

    runs = []  # [row_start, row_end, L of the first row, L of the last row]
    local = 0
    for qs, qe in q_segments:
        cuts = sorted({qs, qe} | {min(max(x - shift, qs), qe) for ks, ke in kv_segments for x in (ks, ke)})
        for a0, a1 in zip(cuts, cuts[1:]):  # L is flat or grows by one per row on [a0, a1)
            first, last = visible(a0), visible(a1 - 1)
            if last == 0:
                continue
            r0, r1 = local + a0 - qs, local + a1 - qs
            if runs and runs[-1][1] == r0:
                prev = runs[-1]
                prev_flat = prev[2] == prev[3]
                prev_growing = prev[3] - prev[2] == prev[1] - prev[0] - 1
                flat, growing = first == last, last - first == r1 - r0 - 1
                if (prev_flat and flat and first == prev[3]) or (prev_growing and growing and first == prev[3] + 1):
                    prev[1], prev[3] = r1, last
                    continue
            runs.append([r0, r1, first, last])
        local += qe - qs
    return [(r0, r1, last, False if first == last else "bottom_right") for r0, r1, first, last in runs]


def _span(x):
    """The bytes [first, end) that tensor x's elements occupy (none for an empty one)."""
    if x.numel() == 0:
        return None
    first = x.data_ptr()
    return first, first + (sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1) * x.element_size()


def _describe(q, k, v, out, causal, scale, layout, enable_gqa, return_lse, timeout):
    """This rank's shapes and options, or the reason they are invalid (never raises)."""
    try:
        if not isinstance(timeout, datetime.timedelta):
            raise ValueError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
        for x, name in ((q, "q"), (k, "k"), (v, "v")):
            if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU torch tensor, got {type(x).__name__}"
                                 + (f" on {x.device}" if isinstance(x, torch.Tensor) else ""))
            if x.dim() != 4:
                raise ValueError(f"{name} must be 4-d [B, H, S, D] (BHSD), got {x.dim()}-d {list(x.shape)}")
            if x.dtype not in _FLOAT_TYPES:
                raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
            raise ValueError(f"q, k and v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
        if v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
            raise ValueError(f"v must have k's heads and length {list(k.shape[1:3])}, got {list(v.shape[1:3])}")
        if k.shape[3] != q.shape[3]:
            raise ValueError(f"k head dim must match q's {q.shape[3]}, got {k.shape[3]}")
        if not (1 <= q.shape[3] <= 512 and 1 <= v.shape[3] <= 512):
            raise ValueError(f"head dims D and Dv must be in [1, 512], got {q.shape[3]} and {v.shape[3]}")
        hq, hkv = q.shape[1], k.shape[1]
        if hq != hkv and not (enable_gqa and hkv > 0 and hq % hkv == 0):
            raise ValueError(f"q has {hq} heads and k {hkv}: Hq != Hkv needs enable_gqa=True and Hq a multiple "
                             "of Hkv")
        code = causal_code(causal)
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
            raise ValueError(f"scale must be a float or None, got {type(scale).__name__}")
        if layout not in LAYOUTS:
            raise ValueError(f'layout must be "contiguous" or "zigzag", got {layout!r}')
        if out is not None:
            want = [q.shape[0], hq, q.shape[2], v.shape[3]]
            if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
                raise ValueError(f"out must be None or a CPU torch tensor, got {type(out).__name__}"
                                 + (f" on {out.device}" if isinstance(out, torch.Tensor) else ""))
            if list(out.shape) != want or out.dtype != q.dtype:
                raise ValueError(f"out must be {q.dtype} {want} (q's dtype, [B, Hq, Sq, Dv]), got {out.dtype} "
                                 f"{list(out.shape)}")
            mine = _span(out)
            for x, name in ((q, "q"), (k, "k"), (v, "v")):
                theirs = _span(x)
                if mine and theirs and mine[0] < theirs[1] and theirs[0] < mine[1]:
                    raise ValueError(f"out must not overlap {name}")
        options = (code, None if scale is None else float(scale), layout, bool(enable_gqa), bool(return_lse))
        return {"error": None, "q": list(q.shape), "kv": list(k.shape), "dv": v.shape[3], "dtype": str(q.dtype),
                "options": list(options)}
    except ValueError as e:
        return {"error": str(e)}


_DESCRIPTION_BYTES = 4096


def _exchange(desc, group, world, rank, timeout):
    """Every rank's description, through one all_gather of fixed-size byte buffers that
    waits at most timeout: a rank that never joins (it failed before the call, or calls
    something else) makes the others raise instead of waiting for ever."""
    if desc["error"] and len(desc["error"]) > _DESCRIPTION_BYTES // 2:
        desc["error"] = desc["error"][:_DESCRIPTION_BYTES // 2] + "..."
    data = json.dumps(desc).encode()
    mine = torch.zeros(_DESCRIPTION_BYTES, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    if not isinstance(timeout, datetime.timedelta):  # reported as this rank's error; still wait a while
        timeout = _DEFAULT_TIMEOUT
    try:
        work.wait(timeout)
    except RuntimeError as e:
        raise RuntimeError(f"ring_attention: rank {rank}: not every rank of the group joined (waited at most "
                           f"{timeout}; a rank failed before the call, does not call it, or left): {e}") from None
    return [json.loads(bytes(g.numpy()).rstrip(b"\0").decode()) for g in gathered]


def _agree(descs, world):
    """Every rank checks every rank's description the same way, so all fail together."""
    bad = [f"rank {r}: {d['error']}" for r, d in enumerate(descs) if d["error"]]
    if bad:
        raise ValueError("ring_attention: invalid input on " + "; ".join(bad))
    first = descs[0]
    for r, d in enumerate(descs):
        for key, what in (("dtype", "dtype"), ("options", "options (causal, scale, layout, enable_gqa, "
                                                                   "return_lse)")):
            if d[key] != first[key]:
                raise ValueError(f"ring_attention: ranks disagree on {what}: rank 0 has {first[key]}, "
                                 f"rank {r} has {d[key]}")
        if (d["q"][0], d["q"][1], d["q"][3]) != (first["q"][0], first["q"][1], first["q"][3]):
            raise ValueError(f"ring_attention: ranks disagree on q's [B, Hq, D]: rank 0 has {first['q']}, "
                             f"rank {r} has {d['q']}")
        if (d["kv"][0], d["kv"][1], d["kv"][3], d["dv"]) != (first["kv"][0], first["kv"][1], first["kv"][3],
                                                             first["dv"]):
            raise ValueError(f"ring_attention: ranks disagree on k/v's [B, Hkv, D] or Dv: rank 0 has "
                             f"{first['kv']} (Dv {first['dv']}), rank {r} has {d['kv']} (Dv {d['dv']})")
    layout = first["options"][2]
    q_lens = [d["q"][2] for d in descs]
    kv_lens = [d["kv"][2] for d in descs]
    if layout == "zigzag":
        for name, lens in (("q", q_lens), ("k/v", kv_lens)):
            total = sum(lens)
            want = [sum(e - s for s, e in sequence_segments(total, world, r, "zigzag")) for r in range(world)]
            if lens != want:
                raise ValueError(f"ring_attention: zigzag {name} shards of a sequence of {total} must have lengths "
                                 f"{want} (see shard_sequence), got {lens}")
    return q_lens, kv_lens


def _segments(lens, world, rank, layout):
    """Global (start, end) segments of rank's shard given every rank's length."""
    if layout == "zigzag":
        return sequence_segments(sum(lens), world, rank, "zigzag")
    start = sum(lens[:rank])
    return [(start, start + lens[rank])]


_workspace = threading.local()


def _buffer(name, nbytes):
    """A uint8 buffer of nbytes (at least 1) that this thread keeps between calls, the
    largest size seen: ring_attention's transfer and scratch buffers touch their pages
    once (a first touch costs microseconds a page), not on every call."""
    buffers = _workspace.__dict__.setdefault("buffers", {})
    buf = buffers.get(name)
    if buf is None or buf.numel() < max(nbytes, 1):
        buf = buffers[name] = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    return buf[:max(nbytes, 1)]


def _typed(name, shape, dtype):
    """_buffer(name) as a contiguous tensor of shape and dtype."""
    nbytes = math.prod(shape) * dtype.itemsize
    return _buffer(name, nbytes)[:nbytes].view(dtype).view(shape)


def _unpack(buf, k_shape, v_shape, dtype):
    nk = math.prod(k_shape) * dtype.itemsize
    nv = math.prod(v_shape) * dtype.itemsize
    return buf[:nk].view(dtype).view(k_shape), buf[nk:nk + nv].view(dtype).view(v_shape)


def _true_runs(flags):
    """[(start, end)] of the runs of True in a 1-d bool tensor."""
    edges = torch.nonzero(torch.diff(flags.to(torch.int8), prepend=flags.new_zeros(1, dtype=torch.int8),
                                     append=flags.new_zeros(1, dtype=torch.int8))).flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))


def ring_attention(q, k, v, *, group=None, causal=False, scale=None, layout="zigzag", enable_gqa=False,
                   return_lse=False, out=None, timeout=None, timings=None):
    """Attention over a sequence sharded across the ranks of group (ring / context
    parallelism): equal to attnkit.attention on the gathered q, k, v, up to float32
    rounding of the merges.

    Each rank passes its shard, BHSD: q [B, Hq, Sq_r, D], k [B, Hkv, Skv_r, D],
    v [B, Hkv, Skv_r, Dv] (CPU torch tensors, float32 / float16 / bfloat16, any strides),
    and gets out [B, Hq, Sq_r, Dv] in q's dtype (and lse [B, Hq, Sq_r] float32, natural
    log, with return_lse) for its own queries. out=, if given, is that buffer (any strides,
    not overlapping q, k or v) and is returned.
    - layout "contiguous": rank r holds a block of positions, blocks in rank order, any
      lengths (q and k/v sharded independently). "zigzag": the sequence is cut into
      2·world chunks and rank r holds chunks r and 2·world-1-r (shard_sequence), so
      causal work is balanced.
    - causal: attention's conventions over global positions: True / "top_left" (query i
      sees keys j <= i), "bottom_right" (j <= i + Skv - Sq, for q the last Sq positions of
      a longer K/V). A query row that sees no key gives out 0, lse -inf.
    - GQA with enable_gqa=True as in attention; scale defaults to 1/sqrt(D).
    K/V shards travel around the ring (isend to rank+1, irecv from rank-1) while the
    current shard is computed; each step's visible part is one or two attention calls
    (visible_runs). A row's first partial is written in place; later ones merge into it by
    their lse (merge_attention_states), in float32 except for bf16/fp16 over more than two
    ranks, where a float32 accumulator keeps the sum (out then rounds once, at the end;
    each partial out is rounded to the input dtype before its merge). The transfer and
    scratch buffers stay allocated on the calling thread for the next call.

    Before any transfer the ranks all-gather their shapes, dtypes and options; invalid or
    inconsistent input raises the same ValueError on every rank. That exchange and every
    transfer wait at most timeout (a datetime.timedelta, default 5 minutes), then raise
    RuntimeError (e.g. a rank that never calls); the group is then unusable, as after any
    failed collective. timings, if a list, gets one dict per ring step: {"step",
    "compute_s" (attention calls and merges), "merge_s" (of which merges and copies),
    "wait_s" (transfer not hidden)}. Forward only (no autograd): an input that requires grad
    in grad mode is a ValueError, as on attnkit's other ops without a backward.
    """
    check_no_grad("ring_attention", (("q", q), ("k", k), ("v", v)))
    rank, world = _rank_and_size(group)
    timeout = _DEFAULT_TIMEOUT if timeout is None else timeout
    descs = _exchange(_describe(q, k, v, out, causal, scale, layout, enable_gqa, return_lse, timeout), group,
                      world, rank, timeout)
    q_lens, kv_lens = _agree(descs, world)

    code = causal_code(causal)
    scale = None if scale is None else float(scale)
    B, Hq, Sq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    shift = sum(kv_lens) - sum(q_lens) if code == 2 else 0  # key j visible from query i iff j <= i + shift
    q_segments = _segments(q_lens, world, rank, layout)
    if out is None:
        out = torch.empty(B, Hq, Sq, Dv, dtype=q.dtype)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32)
    # A row gets at most one partial per step: with two steps, merging the second into the
    # first rounds once, as a float32 accumulator would.
    exact_in_out = q.dtype == torch.float32 or world <= 2
    acc = out if exact_in_out else _typed("acc", (B, Hq, Sq, Dv), torch.float32)
    seen = torch.zeros(Sq, dtype=torch.bool)  # rows holding a partial

    def attend(kb, vb, origin):
        """Adds the attention of this rank's queries over origin's K/V block to acc;
        returns the seconds spent merging."""
        if code == 0:
            runs = [(0, Sq, kb.shape[2], False)] if Sq and kb.shape[2] else []
        else:
            runs = visible_runs(q_segments, _segments(kv_lens, world, origin, layout), shift)
        merge_s = 0.0
        for r0, r1, kv_end, run_causal in runs:
            args = (q[:, :, r0:r1], kb[:, :, :kv_end], vb[:, :, :kv_end], None, causal_code(run_causal), scale, 0.0,
                    None, enable_gqa, "BHSD")
            rows, rows_lse = acc[:, :, r0:r1], lse[:, :, r0:r1]
            fresh = not bool(seen[r0:r1].any())
            if fresh and acc.dtype == q.dtype:
                run_attention(*args, rows, rows_lse)
            else:
                part = _typed("part", (B, Hq, r1 - r0, Dv), q.dtype)
                part_lse = _typed("part_lse", (B, Hq, r1 - r0), torch.float32)
                run_attention(*args, part, part_lse)
                t = time.perf_counter()
                if fresh:
                    rows.copy_(part)
                    rows_lse.copy_(part_lse)
                else:
                    for s, e in _true_runs(~seen[r0:r1]):  # rows without a partial yet: empty
                        rows[:, :, s:e].zero_()
                        rows_lse[:, :, s:e].fill_(-math.inf)
                    merge_attention_states(rows, rows_lse, part, part_lse, out=rows, lse_out=rows_lse)
                merge_s += time.perf_counter() - t
            seen[r0:r1] = True
        return merge_s

    prev_rank = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    next_rank = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    block_shapes = [((B, Hkv, n, D), (B, Hkv, n, Dv)) for n in kv_lens]
    block_bytes = [B * Hkv * n * (D + Dv) * q.dtype.itemsize for n in kv_lens]
    if world > 1:  # k and v packed in one byte buffer: any dtype travels through gloo as uint8
        current, incoming = _buffer("send", max(block_bytes)), _buffer("recv", max(block_bytes))
        packed_k, packed_v = _unpack(current, *block_shapes[rank], q.dtype)
        packed_k.copy_(k)
        packed_v.copy_(v)
    kb, vb = k, v
    try:
        for step in range(world):
            works = []
            if step + 1 < world:
                origin, source = (rank - step) % world, (rank - step - 1) % world
                works = [dist.isend(current[:max(1, block_bytes[origin])], next_rank, group=group),
                         dist.irecv(incoming[:max(1, block_bytes[source])], prev_rank, group=group)]
            t0 = time.perf_counter()
            merge_s = attend(kb, vb, (rank - step) % world)
            t1 = time.perf_counter()
            for w in works:
                if not w.wait(timeout):
                    raise RuntimeError(f"ring_attention: rank {rank}: step {step} transfer timed out after {timeout}")
            t2 = time.perf_counter()
            if timings is not None:
                timings.append({"step": step, "compute_s": t1 - t0, "merge_s": merge_s, "wait_s": t2 - t1})
            if works:
                kb, vb = _unpack(incoming, *block_shapes[source], q.dtype)
                current, incoming = incoming, current  # send on what came in; receive into what went out
    except RuntimeError:
        _workspace.__dict__.pop("buffers", None)  # a transfer may still land in them
        raise
    for s, e in _true_runs(~seen):
        acc[:, :, s:e].zero_()
        lse[:, :, s:e].fill_(-math.inf)
    if acc is not out:
        out.copy_(acc)
    return (out, lse) if return_lse else out

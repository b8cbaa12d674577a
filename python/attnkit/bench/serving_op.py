"""``--op varlen`` and ``--op paged``: the serving ops (attnkit.varlen_attention,
attnkit.paged_attention).

varlen: a ragged batch of self-attention sequences (lengths drawn from a fixed seed), packed.
Peers: a loop of attnkit.attention calls over the sequences (the best a user can do without
varlen) and torch SDPA on the padded batch with a padding mask (what users do today; its
inputs are padded before timing, its output is unpadded inside the timed call). FLOPs count
useful (visible) pairs only.

paged: each sequence's new tokens over its keys in a paged cache (block table shuffled).
Decode shapes are memory-bound: the floor is the bytes of K and V read (Σ seq_lens) over the
read bandwidth measured in the same run. The mixed shape puts prefill chunks and decodes in
one batch. Case dtypes are the cache's (bfloat16, float8_e4m3fn); queries are bfloat16.

Both verify a float64 reference on a subset (two sequences, three heads, all their rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
import numpy as np

from .attention_op import PEER_TOL_FACTOR, _as_f32, _check, decode_peak_of, exact_peak_of, visible_pairs
from .machine import bf16_dot_of
from .registry import (BenchOp, Contender, Counts, attnkit_contenders, itemsize, numpy_dtype,
                       optional_torch, register, shape_int)


@dataclass(frozen=True)
class ServingShape:
    name: str
    n_seqs: int
    lo: int            # key lengths drawn uniformly in [lo, hi]
    hi: int
    q_len: int         # new tokens per sequence (paged; 0 = self-attention of the whole length)
    prefills: int = 0  # paged "mixed": this many sequences are prefill chunks of q_len tokens
    Hq: int = 32
    Hkv: int = 8
    D: int = 128
    block_size: int = 16
    causal: bool = True
    quick: bool = False

    @property
    def label(self) -> str:
        return self.name + (" (quick)" if self.quick else "")

    def dims(self) -> str:
        lens = self.lengths()
        kv = f"{self.n_seqs} seqs, keys {lens.min()}-{lens.max()} (sum {lens.sum()})"
        q = "" if self.q_len == 0 else (f", {self.prefills} prefill chunks of {self.q_len} + decodes"
                                        if self.prefills else f", {self.q_len} new token(s) each")
        h = f"Hq={self.Hq} Hkv={self.Hkv} D={self.D}"
        page = f", block_size {self.block_size}" if self.q_len else ""
        return f"{kv}{q}, {h}{page}, {'causal' if self.causal else 'non-causal'}"

    def lengths(self) -> np.ndarray:
        return np.random.default_rng(2026).integers(self.lo, self.hi + 1, self.n_seqs)

    def q_lens(self) -> np.ndarray:
        if self.q_len == 0:
            return self.lengths()
        q = np.full(self.n_seqs, 1 if self.prefills else self.q_len, dtype=np.int64)  # mixed: decodes
        q[:self.prefills] = self.q_len
        return q

    def rows_per_kv_head(self) -> int:
        """The most query rows one sequence puts on a kv head (decode: at most 8)."""
        return int(self.q_lens().max()) * (self.Hq // self.Hkv)


VARLEN_SHAPES = {
    "R": ServingShape("R", 64, 16, 512, 0),
    # a BERT-style encoder batch at all-MiniLM-L6-v2's attention dims (what the transformers
    # integration sends for a right-padded batch)
    "E": ServingShape("E", 64, 8, 128, 0, Hq=12, Hkv=12, D=32, causal=False),
}
PAGED_SHAPES = {
    "P16": ServingShape("P16", 16, 2048, 4096, 1, block_size=16, causal=True),
    "P128": ServingShape("P128", 16, 2048, 4096, 1, block_size=128, causal=True),
    "M": ServingShape("M", 16, 1024, 4096, 256, prefills=4, block_size=16, causal=True),
}


def _parse(named):
    def parse(text: str) -> ServingShape:
        key = text.strip()
        if key in named:
            return named[key]
        tokens = [t for t in key.replace(";", ",").split(",") if t]
        if not tokens or tokens[0] not in named:
            raise ValueError(f"shape {text!r}: start from one of {', '.join(named)} (e.g. {list(named)[0]},n=8)")
        base, vals = named[tokens[0]], {}
        fields = {"n": "n_seqs", "lo": "lo", "hi": "hi", "q": "q_len", "hq": "Hq", "hkv": "Hkv", "d": "D",
                  "bs": "block_size"}
        for tok in tokens[1:]:
            k, _, v = tok.partition("=")
            if k.lower() not in fields:
                raise ValueError(f"unknown shape key {k!r} (keys: {', '.join(fields)})")
            vals[fields[k.lower()]] = shape_int(k, v)
        shape = replace(base, name=key, **vals)
        if shape.q_len > shape.lo:
            raise ValueError(f"shape {text!r}: q={shape.q_len} new tokens need keys lo >= q, got lo={shape.lo}")
        return shape
    return staticmethod(parse)


def _torch_view(a):
    torch = optional_torch()
    if a.dtype in (np.float32, np.float16, np.int32, np.int64):
        return torch.from_numpy(a)
    return torch.from_numpy(a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8)).view(
        torch.bfloat16 if a.dtype.itemsize == 2 else torch.float8_e4m3fn)


def _ref_rows(q, k, v, rows_causal_offset, causal, heads, group, k_scale=1.0, v_scale=1.0):
    """float64 [len(heads), rows, Dv] for one sequence: q [rows, Hq, D], k/v [keys, Hkv, *]."""
    n_q, n_k = q.shape[0], k.shape[0]
    out = np.empty((len(heads), n_q, v.shape[2]))
    mag = np.empty_like(out)
    cols, rows = np.arange(n_k), np.arange(n_q)
    for hi, h in enumerate(heads):
        qq = q[:, h].astype(np.float64)
        kk = k[:, h // group].astype(np.float64) * k_scale
        vv = v[:, h // group].astype(np.float64) * v_scale
        s = qq @ kk.T / math.sqrt(q.shape[2])
        if causal:
            s = np.where(cols[None, :] <= rows[:, None] + rows_causal_offset, s, -np.inf)
        mx = np.max(s, axis=1, keepdims=True, initial=-np.inf)
        live = np.isfinite(mx)
        p = np.exp(s - np.where(live, mx, 0.0))
        den = np.where(live, p.sum(axis=1, keepdims=True), 1.0)
        out[hi] = np.where(live, p @ vv / den, 0.0)
        mag[hi] = np.where(live, p @ np.abs(vv) / den, 0.0)
    return out, mag


@dataclass
class ServingRef:
    seqs: list        # the checked sequences
    heads: np.ndarray
    out: list         # per sequence: float64 [heads, rows, Dv]
    magnitude: list


class _ServingOp(BenchOp):
    def quick_shape(self, s):
        return replace(s, n_seqs=max(2, s.n_seqs // 4), lo=max(1, s.lo // 4), hi=max(1, s.hi // 4),
                       q_len=s.q_len if s.q_len <= 1 else max(1, s.q_len // 4), prefills=min(s.prefills, 1),
                       quick=True)

    def peak_of(self, row):
        return decode_peak_of(row, exact_peak_of(row), row.case.shape.rows_per_kv_head())

    def _subset(self, out, ref, cu_q):
        return [np.asarray(_as_f32(out))[cu_q[b]:cu_q[b + 1]][:, ref.heads].transpose(1, 0, 2).astype(np.float64)
                for b in ref.seqs]

    def _check_subset(self, case, ref, out, cu_q, factor=1.0):
        got = self._subset(out, ref, cu_q)
        dtype = "bfloat16" if case.dtype not in ("float32", "float16") else case.dtype
        return _check(np.concatenate([g.reshape(-1) for g in got]), np.concatenate([r.reshape(-1) for r in ref.out]),
                      dtype, factor, np.concatenate([m.reshape(-1) for m in ref.magnitude]))

    def compare(self, case, out, attnkit_out):
        dtype = "bfloat16" if case.dtype not in ("float32", "float16") else case.dtype
        return _check(_as_f32(out), _as_f32(attnkit_out).astype(np.float64), dtype, PEER_TOL_FACTOR)

    def inject_error(self, case, ref, out):
        out = out.copy() if isinstance(out, np.ndarray) else out.clone()
        out[0, int(ref.heads[0]), 0] = out[0, int(ref.heads[0]), 0] * -3 + 1
        return out


def padded_batch(torch, x, s, arrays=None):
    """The packed arrays (default x.q, x.k, x.v) as torch tensors [B, H, longest, D] padded
    with zeros, the boolean mask (padding, causal; a padded query row sees every key, so that
    no softmax row is empty and the backward's gradients stay finite), and the packed rows'
    index into [B · longest]."""
    lengths, smax = np.diff(x.cu), int(np.diff(x.cu).max())
    B = len(lengths)

    def pad(a):
        p = torch.zeros((B, smax) + a.shape[1:], dtype=_torch_view(a).dtype)
        for b in range(B):
            p[b, :lengths[b]] = _torch_view(a[x.cu[b]:x.cu[b + 1]])
        return p.transpose(1, 2)

    valid = torch.from_numpy(np.arange(smax)[None, :] < lengths[:, None])
    mask = valid[:, None, None, :] & valid[:, None, :, None]
    if s.causal:
        mask = mask & torch.ones(smax, smax, dtype=torch.bool).tril()
    mask = mask | ~valid[:, None, :, None]
    index = torch.from_numpy(np.concatenate([b * smax + np.arange(n) for b, n in enumerate(lengths)]))
    return [pad(a) for a in (arrays or (x.q, x.k, x.v))], mask, index


class VarlenInputs:
    """The packed batch and one output buffer, written before timing: on this VM the first
    touch of fresh memory costs ~40 us a page (0.7 s for shape R's 69 MB fp32 output), which
    would land on whichever contender's allocation the allocator serves from the OS."""

    def __init__(self, q, k, v, cu):
        self.q, self.k, self.v, self.cu = q, k, v, cu
        self.out = np.zeros_like(q)
        self._padded = None


class VarlenOp(_ServingOp):
    name = "varlen"
    description = "packed ragged batch (attnkit.varlen_attention vs a loop of attnkit.attention and padded torch SDPA)"
    shapes = VARLEN_SHAPES
    default_shapes = ("R",)
    shape_parser = _parse(VARLEN_SHAPES)

    def dtypes_for(self, shape, requested):
        return (["bfloat16", "float32"] if requested is None else list(requested)), ""

    def counts(self, case):
        s = case.shape
        pairs = sum(visible_pairs(int(n), int(n), s.causal) for n in s.lengths())
        return Counts(flops=2.0 * s.Hq * 2 * s.D * pairs, extra={"pairs": pairs})

    def input_bytes(self, case):
        s = case.shape
        return itemsize(case.dtype) * int(s.lengths().sum()) * (s.Hq + 2 * s.Hkv) * s.D

    def make_inputs(self, case, rng):
        s, dt = case.shape, numpy_dtype(case.dtype)
        total = int(s.lengths().sum())

        def rand(*shape):
            x = rng.standard_normal(shape, dtype=np.float32)
            return x if dt == np.float32 else x.astype(dt)

        cu = np.concatenate([[0], np.cumsum(s.lengths())]).astype(np.int32)
        return VarlenInputs(rand(total, s.Hq, s.D), rand(total, s.Hkv, s.D), rand(total, s.Hkv, s.D), cu)

    def reference(self, case, inputs, rng=None):
        s = case.shape
        lengths = s.lengths()
        seqs = sorted({0, int(np.argmax(lengths))})
        group = s.Hq // s.Hkv
        heads = np.array(sorted({0, s.Hq // 2, s.Hq - 1}))
        outs, mags = [], []
        for b in seqs:
            lo, hi = inputs.cu[b], inputs.cu[b + 1]
            o, m = _ref_rows(inputs.q[lo:hi], inputs.k[lo:hi], inputs.v[lo:hi], 0, s.causal, heads, group)
            outs.append(o)
            mags.append(m)
        return ServingRef(seqs, heads, outs, mags)

    def verify(self, case, ref, out):
        return self._check_subset(case, ref, out, np.concatenate([[0], np.cumsum(case.shape.lengths())]))

    def reset_outputs(self, inputs):
        inputs.out.fill(np.nan)

    def contenders(self, case):
        import attnkit

        s = case.shape
        notes = ["attnkit and attnkit-loop write into one preallocated out (out=), as an engine does",
                 "attnkit-loop: one attnkit.attention call per sequence on [1, S, H, D] slices (BSHD)",
                 "torch-sdpa-padded: inputs padded to the longest sequence before timing; the boolean "
                 "padding mask (and causal) in the call; output unpadded inside the timed call"]

        def run_varlen(x):
            return attnkit.varlen_attention(x.q, x.k, x.v, x.cu, x.cu, causal=s.causal, out=x.out)

        def run_loop(x):
            out = x.out
            for b in range(len(x.cu) - 1):
                lo, hi = x.cu[b], x.cu[b + 1]
                attnkit.attention(x.q[lo:hi][None], x.k[lo:hi][None], x.v[lo:hi][None], causal=s.causal,
                                  enable_gqa=s.Hq != s.Hkv, layout="BSHD", out=out[lo:hi][None])
            return out

        out = attnkit_contenders(run_varlen, notes)
        out.append(Contender("attnkit-loop", "peer", run_loop, set_threads=attnkit.set_num_threads,
                             note="loop over sequences"))
        torch = optional_torch()
        if torch is None:
            notes.append("torch-sdpa-padded: skipped (torch is not importable)")
            return out, notes

        def pad(x):  # once per input set, before the contender is verified or timed
            if x._padded is None:
                x._padded = padded_batch(torch, x, s)

        def run_torch(x):
            (q, k, v), mask, index = x._padded
            with torch.no_grad():
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                     enable_gqa=s.Hq != s.Hkv)
            return o.transpose(1, 2).reshape(-1, s.Hq, s.D)[index]

        out.append(Contender("torch-sdpa-padded", "peer", run_torch, set_threads=torch.set_num_threads,
                             note=f"torch {torch.__version__}, padded + mask", prepare_inputs=pad))
        return out, notes


class PagedInputs:
    def __init__(self, q, k_cache, v_cache, table, lens, cu_q):
        self.q, self.k_cache, self.v_cache, self.table, self.lens, self.cu_q = q, k_cache, v_cache, table, lens, cu_q


class PagedOp(_ServingOp):
    name = "paged"
    description = "attention over a paged KV cache: decode and mixed batches (attnkit.paged_attention)"
    shapes = PAGED_SHAPES
    default_shapes = ("P16", "P128", "M")
    shape_parser = _parse(PAGED_SHAPES)
    dtype_aliases = {"bfloat16": "bfloat16", "bf16": "bfloat16",
                     "float8_e4m3fn": "float8_e4m3fn", "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn"}

    def dtypes_for(self, shape, requested):
        return (["bfloat16", "float8_e4m3fn"] if requested is None else list(requested)), ""

    def counts(self, case):
        s = case.shape
        lens, q_lens = s.lengths(), s.q_lens()
        pairs = 0
        for n, nq in zip(lens, q_lens):
            pairs += int(n) * int(nq) if not s.causal else sum(min(int(n), int(n) - int(nq) + i + 1) for i in range(int(nq)))
        kv_bytes = float(lens.sum() * s.Hkv * 2 * s.D * itemsize(case.dtype))
        return Counts(flops=2.0 * s.Hq * 2 * s.D * pairs, mem_bytes=kv_bytes, memory_bound=s.prefills == 0,
                      extra={"pairs": pairs})

    def input_bytes(self, case):
        s = case.shape
        return int(s.lengths().sum()) * s.Hkv * 2 * s.D * itemsize(case.dtype)

    def make_inputs(self, case, rng):
        s = case.shape
        lens, q_lens = s.lengths().astype(np.int32), s.q_lens()
        used = (lens + s.block_size - 1) // s.block_size
        num_blocks = int(used.sum())
        ids = rng.permutation(num_blocks).astype(np.int32)
        table = np.full((s.n_seqs, int(used.max())), -1, dtype=np.int32)
        pos = 0
        for b, n in enumerate(used):
            table[b, :n] = ids[pos:pos + n]
            pos += n
        cdt = numpy_dtype(case.dtype)
        scale = 1.0 if case.dtype == "bfloat16" else 8.0  # fp8 values spread over its range
        shape = (num_blocks, s.block_size, s.Hkv, s.D)
        kc = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(cdt)
        vc = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(cdt)
        cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        q = rng.standard_normal((int(cu_q[-1]), s.Hq, s.D), dtype=np.float32).astype(numpy_dtype("bfloat16"))
        return PagedInputs(q, kc, vc, table, lens, cu_q)

    def _scales(self, case):
        return (1.0, 1.0) if case.dtype == "bfloat16" else (0.125, 0.125)

    def reference(self, case, inputs, rng=None):
        s = case.shape
        seqs = sorted({0, s.n_seqs - 1})
        heads = np.array(sorted({0, s.Hq // 2, s.Hq - 1}))
        ks, vs = self._scales(case)
        outs, mags = [], []
        for b in seqs:
            n, j = int(inputs.lens[b]), np.arange(int(inputs.lens[b]))
            rows = inputs.table[b, j // s.block_size], j % s.block_size
            q = inputs.q[inputs.cu_q[b]:inputs.cu_q[b + 1]]
            o, m = _ref_rows(q, inputs.k_cache[rows], inputs.v_cache[rows], n - q.shape[0], s.causal, heads,
                             s.Hq // s.Hkv, ks, vs)
            outs.append(o)
            mags.append(m)
        return ServingRef(seqs, heads, outs, mags)

    def verify(self, case, ref, out):
        cu_q = np.concatenate([[0], np.cumsum(case.shape.q_lens())]).astype(np.int32)
        return self._check_subset(case, ref, out, cu_q)

    def peak_of(self, row):
        """fp8 caches under the bf16 queries here convert exactly to bf16 and take the bf16
        paths (AMX tiles on avx512amx, vdpbf16ps on avx512bf16)."""
        import attnkit

        peak = exact_peak_of(row)
        if row.case.dtype.startswith("float8") and row.contender == "attnkit":
            peak = bf16_dot_of(attnkit.get_isa())
        return decode_peak_of(row, peak, row.case.shape.rows_per_kv_head())

    def contenders(self, case):
        import attnkit

        s = case.shape
        ks, vs = self._scales(case)
        notes = [f"queries bfloat16; cache {case.dtype}, block_size {s.block_size}, block table shuffled"]

        def run_paged(x):
            return attnkit.paged_attention(x.q, x.k_cache, x.v_cache, x.table, x.lens, x.cu_q, causal=s.causal,
                                           k_scale=ks, v_scale=vs)

        return attnkit_contenders(run_paged, notes), notes


register(VarlenOp())
register(PagedOp())

"""``--op sparse_mla``: DeepSeek-V3.2 sparse MLA prefill (attnkit.sparse_mla_prefill_fwd).

Shape B of docs/BENCH.md (s_q=1024, h_q=128, d_qk=576, d_v=512, topk=2048, s_kv=8192, one kv
head) in fp8 e4m3 (q8kv8, float32 per-tensor scales) and bf16, or a custom "key=value,..."
spec. Indices are distinct random kv rows per query row with round(5% of topk) slots set to
-1 at random positions, so the number of valid slots (and the FLOP count) is exact before the
inputs exist. The reference is float64 numpy on a few query rows (all heads): out, max_logits
and lse. Contenders: attnkit, attnkit's portable ("generic") kernel, and a torch reference
written as a user would (dequantise to fp32, gather, batched matmul, masked softmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from .machine import FP32_FMA, bf16_dot_of
from .registry import (BenchOp, Check, Contender, Counts, attnkit_contenders, itemsize, numpy_dtype,
                       optional_torch, register, shape_int)

FP8, BF16 = "float8_e4m3fn", "bfloat16"
DTYPE_ALIASES = {
    "float8_e4m3fn": FP8, "float8_e4m3": FP8, "fp8_e4m3": FP8, "fp8": FP8, "e4m3": FP8,
    "q8kv8": FP8, "fp8e4m3": FP8,
    "bfloat16": BF16, "bf16": BF16,
}
FP8_MAX = 448.0
SM_SCALE = 0.1352          # DeepSeek-V3.2's softmax scale (docs/BENCH.md), not 1/sqrt(d_qk)
INVALID_FRACTION = 0.05    # slots set to -1 per query row
QUICK_S_Q = 32
TORCH_CHUNK = 16           # query rows per batched matmul in the torch reference

# (atol, rtol): |x - ref| <= atol * rms(ref) + rtol * |ref|. out is bf16, rounded once from a
# float32 accumulation (2^-9 relative) of P·V, where P is rounded to bf16 on avx512bf16 (2^-9
# relative per term, as in FlashMLA); max_logits / lse are float32 (dot products of 576
# exact products accumulated in float32).
OUT_TOL = (1.6e-2, 1.6e-2)
STAT_TOL = (1e-4, 1e-4)
PEER_TOL_FACTOR = 2.0      # a peer vs attnkit: both sides carry rounding error


def n_invalid(topk: int) -> int:
    return int(math.floor(INVALID_FRACTION * topk + 0.5))


KEYS = ("s_q", "h_q", "d_qk", "d_v", "topk", "s_kv")


@dataclass(frozen=True)
class SparseShape:
    name: Optional[str]
    s_q: int
    h_q: int
    d_qk: int
    d_v: int
    topk: int
    s_kv: int
    dtypes: Optional[tuple] = None
    quick: bool = False

    def dims(self) -> str:
        return " ".join(f"{k}={getattr(self, k)}" for k in KEYS)

    @property
    def valid_per_row(self) -> int:
        return self.topk - n_invalid(self.topk)

    @property
    def label(self) -> str:
        base = self.name or self.dims().replace(" ", ",")
        return base + (f" (quick, s_q={self.s_q})" if self.quick else "")


NAMED = {"B": SparseShape("B", 1024, 128, 576, 512, 2048, 8192, (FP8, BF16))}
DEFAULT_SHAPES = ["B"]
CUSTOM_DEFAULT_DTYPES = (FP8, BF16)


def parse_shape(text: str) -> SparseShape:
    """"B", or "key=value,..." with keys s_q, h_q, d_qk, d_v, topk, s_kv (missing keys take
    B's values; may start with "B": "B,s_q=128")."""
    text = text.strip()
    tokens = [t for t in text.replace(";", ",").replace(" ", ",").split(",") if t]
    if not tokens:
        raise ValueError("empty shape")
    base = NAMED["B"]
    if "=" not in tokens[0]:
        name = tokens.pop(0)
        if name.upper() not in NAMED:
            raise ValueError(f"unknown shape {name!r} (named: {', '.join(NAMED)}; or keys "
                             f"{', '.join(KEYS)})")
        base = NAMED[name.upper()]
    vals = {k: getattr(base, k) for k in KEYS}
    lookup = {k.replace("_", ""): k for k in KEYS}
    for tok in tokens:
        if "=" not in tok:
            raise ValueError(f"expected key=value, got {tok!r} (keys: {', '.join(KEYS)})")
        k, v = (p.strip() for p in tok.split("=", 1))
        key = lookup.get(k.lower().replace("_", ""))
        if key is None:
            raise ValueError(f"unknown shape key {k!r} (keys: {', '.join(KEYS)})")
        vals[key] = shape_int(key, v)
    if vals["d_v"] > vals["d_qk"]:
        raise ValueError(f"shape {text!r}: d_v={vals['d_v']} must be <= d_qk={vals['d_qk']}")
    if vals["topk"] > vals["s_kv"]:
        raise ValueError(f"shape {text!r}: topk={vals['topk']} must be <= s_kv={vals['s_kv']} "
                         f"(indices are distinct kv rows)")
    shape = SparseShape(None, **vals)
    for named in NAMED.values():  # a spelled-out named shape keeps its name and dtypes
        if replace(named, name=None, dtypes=None) == shape:
            return named
    return shape


class SparseInputs:
    """q, kv (fp8 / bf16 numpy via ml_dtypes), indices int32, float32 one-element scales
    (fp8; None for bf16) and, on demand, zero-copy torch views of the same memory."""

    def __init__(self, q, kv, indices, q_scale, kv_scale, sm_scale):
        self.q, self.kv, self.indices = q, kv, indices
        self.q_scale, self.kv_scale, self.sm_scale = q_scale, kv_scale, sm_scale
        self._torch = None

    def scale_values(self):
        """(q_scale, kv_scale) as Python floats (1.0 for bf16)."""
        return tuple(1.0 if s is None else float(s.reshape(-1)[0])
                     for s in (self.q_scale, self.kv_scale))

    def torch(self):
        if self._torch is None:
            torch = optional_torch()

            def view(a):
                if a.dtype == np.int32:
                    return torch.from_numpy(a)
                if a.itemsize == 1:
                    return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
                return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)

            self._torch = (view(self.q), view(self.kv), view(self.indices))
        return self._torch


@dataclass
class SparseRef:
    rows: np.ndarray
    out: np.ndarray         # float64 [len(rows), h_q, d_v]
    max_logits: np.ndarray  # float64 [len(rows), h_q]
    lse: np.ndarray         # float64 [len(rows), h_q]


def _parts(x):
    """(out, max_logits or None, lse or None) of a contender's result."""
    if isinstance(x, tuple):
        return x[0], x[1], x[2]
    return x, None, None


def _rows_f64(x, rows=None) -> np.ndarray:
    """Rows of a numpy array (any ml_dtypes float) or torch tensor, as float64 numpy."""
    if isinstance(x, np.ndarray):
        x = x if rows is None else x[rows]
        return x.astype(np.float64)
    x = x.detach()
    if rows is not None:
        x = x[list(rows)] if not isinstance(rows, slice) else x[rows]
    return x.double().numpy()


class _Acc:
    """Accumulates a tolerance check over chunks (bounded memory for full-size outputs)."""

    def __init__(self, tol, scale):
        self.atol, self.rtol = tol
        self.scale = max(scale, 1e-30)
        self.err, self.bad, self.n = 0.0, 0, 0
        self.worst = None  # (excess, out value, ref value, index in chunk, chunk offset)

    def add(self, out, ref, offset=0, what=""):
        if out.shape != ref.shape:
            raise _Mismatch(f"{what}shape {out.shape} != expected {ref.shape}")
        self.n += out.size
        fin = np.isfinite(ref)
        # Non-finite reference values (a row with no valid slot) must be matched exactly.
        mism = (~fin) & (out != ref)
        nonfin = fin & ~np.isfinite(out)
        if np.any(mism) or np.any(nonfin):
            raise _Mismatch(f"{what}{int(np.sum(mism) + np.sum(nonfin))} non-finite values "
                            f"where the reference differs")
        diff = np.where(fin, np.abs(out - np.where(fin, ref, 0.0)), 0.0)
        bound = self.atol * self.scale + self.rtol * np.abs(np.where(fin, ref, 0.0))
        if diff.size:
            self.err = max(self.err, float(np.max(diff)) / self.scale)
            excess = diff - bound
            i = int(np.argmax(excess))
            if excess.flat[i] > 0:
                self.bad += int(np.sum(excess > 0))
                if self.worst is None or excess.flat[i] > self.worst[0]:
                    idx = np.unravel_index(i, diff.shape)
                    self.worst = (float(excess.flat[i]), float(out[idx]), float(ref[idx]),
                                  (idx[0] + offset,) + tuple(int(j) for j in idx[1:]), what)

    def check(self) -> Check:
        if self.bad:
            _, o, r, idx, what = self.worst
            return Check(False, self.err, f"{what}{self.bad}/{self.n} values out of tolerance; "
                                          f"worst at {tuple(int(i) for i in idx)}: {o:.6g} vs "
                                          f"{r:.6g}")
        return Check(True, self.err)


class _Mismatch(Exception):
    pass


def _rms(x) -> float:
    x = x[np.isfinite(x)]
    return float(np.sqrt(np.mean(np.square(x)))) if x.size else 1.0


def _checks(pairs) -> Check:
    """pairs: (what, out, ref, tol) with float64 arrays; the first failure, else the largest
    normalised error."""
    err = 0.0
    for what, out, ref, tol in pairs:
        acc = _Acc(tol, _rms(ref))
        try:
            acc.add(out, ref, what=what)
        except _Mismatch as e:
            return Check(False, math.inf, str(e))
        chk = acc.check()
        if not chk.ok:
            return chk
        err = max(err, chk.err)
    return Check(True, err)


class SparseMlaOp(BenchOp):
    name = "sparse_mla"
    description = "sparse MLA prefill (attnkit.sparse_mla_prefill_fwd vs a torch reference)"
    dtype_aliases = DTYPE_ALIASES
    quick_note = f"s_q at most {QUICK_S_Q}"

    # --- shapes -------------------------------------------------------------------------
    shapes = NAMED
    default_shapes = tuple(DEFAULT_SHAPES)
    shape_parser = staticmethod(parse_shape)

    def quick_shape(self, s):
        return replace(s, s_q=min(s.s_q, QUICK_S_Q), quick=True)

    def peak_of(self, row):
        # KV·Qᵀ and P·V run on the variant's bf16 instruction (AMX tiles on avx512amx, vdpbf16ps
        # on avx512bf16: fp8 and bf16 values are exact in bf16; P is rounded to bf16, as in FlashMLA)
        import attnkit

        if row.contender == "attnkit":
            return bf16_dot_of(attnkit.get_isa())
        return FP32_FMA

    def dtypes_for(self, shape, requested):
        if requested is None:
            return list(shape.dtypes or CUSTOM_DEFAULT_DTYPES), ""
        kept = [d for d in requested if d in (FP8, BF16)]
        skipped = [d for d in requested if d not in (FP8, BF16)]
        note = (f"sparse_mla: skipped {', '.join(skipped)} (the op takes {FP8} or {BF16})"
                if skipped else "")
        return kept, note

    # --- per case -----------------------------------------------------------------------
    def counts(self, case):
        s = case.shape
        valid = s.s_q * s.valid_per_row
        flops = 2.0 * s.h_q * (s.d_qk + s.d_v) * valid
        return Counts(flops=flops, extra={"valid_slots": valid})

    def input_bytes(self, case):
        s = case.shape
        return (itemsize(case.dtype) * (s.s_q * s.h_q * s.d_qk + s.s_kv * s.d_qk)
                + 4 * s.s_q * s.topk)

    def make_inputs(self, case, rng):
        s, dt = case.shape, numpy_dtype(case.dtype)

        def tensor(*shape):
            x = rng.standard_normal(shape, dtype=np.float32)
            if case.dtype == BF16:
                return x.astype(dt), None
            # Per-tensor scale mapping the largest magnitude to the fp8 maximum: the dequantised
            # values are ~N(0, 1), so logits have a standard deviation of ~3 with sm_scale.
            scale = np.float32(max(float(np.max(np.abs(x))), 1e-6) / FP8_MAX)
            return (x / scale).astype(dt), np.array([scale], dtype=np.float32)

        q, q_scale = tensor(s.s_q, s.h_q, s.d_qk)
        kv, kv_scale = tensor(s.s_kv, 1, s.d_qk)
        idx = np.empty((s.s_q, 1, s.topk), dtype=np.int32)
        for r in range(s.s_q):
            idx[r, 0] = rng.choice(s.s_kv, size=s.topk, replace=False)
        k = n_invalid(s.topk)
        if k:
            pos = np.argpartition(rng.random((s.s_q, s.topk)), k - 1, axis=1)[:, :k]
            np.put_along_axis(idx[:, 0], pos, -1, axis=1)
        return SparseInputs(q, kv, idx, q_scale, kv_scale, SM_SCALE)

    def reference(self, case, inputs, rng=None):
        s = case.shape
        rng = rng or np.random.default_rng(1234)
        fixed = {0, min(1, s.s_q - 1), s.s_q // 2, s.s_q - 1}
        extra = set(rng.choice(s.s_q, size=min(s.s_q, 4), replace=False).tolist())
        rows = np.array(sorted(fixed | extra))
        qs, ks = inputs.scale_values()
        out = np.zeros((len(rows), s.h_q, s.d_v))
        ml = np.full((len(rows), s.h_q), -np.inf)
        lse = np.full((len(rows), s.h_q), np.inf)
        for i, r in enumerate(rows):
            idx = inputs.indices[r, 0].astype(np.int64)
            idx = idx[(idx >= 0) & (idx < s.s_kv)]
            if idx.size == 0:
                continue  # no valid slot: out 0, max_logits -inf, lse +inf
            q = inputs.q[r].astype(np.float64) * qs                 # [h_q, d_qk]
            kv = inputs.kv[idx, 0].astype(np.float64) * ks          # [valid, d_qk]
            logits = (q @ kv.T) * inputs.sm_scale                   # [h_q, valid]
            m = np.max(logits, axis=1)
            p = np.exp(logits - m[:, None])
            den = np.sum(p, axis=1)
            out[i] = (p @ kv[:, :s.d_v]) / den[:, None]
            ml[i] = m
            lse[i] = m + np.log(den)
        return SparseRef(rows, out, ml, lse)

    def verify(self, case, ref, out):
        o, ml, lse = _parts(out)
        pairs = [("out: ", _rows_f64(o, ref.rows), ref.out, OUT_TOL)]
        if ml is not None:
            pairs.append(("max_logits: ", _rows_f64(ml, ref.rows), ref.max_logits, STAT_TOL))
        if lse is not None:
            pairs.append(("lse: ", _rows_f64(lse, ref.rows), ref.lse, STAT_TOL))
        return _checks(pairs)

    def compare(self, case, out, attnkit_out):
        """A peer's full output against attnkit's, in chunks of query rows."""
        o, ml, lse = _parts(out)
        ao, aml, alse = _parts(attnkit_out)
        if tuple(o.shape) != tuple(ao.shape):
            return Check(False, math.inf, f"out: shape {tuple(o.shape)} != {tuple(ao.shape)}")
        n, step = ao.shape[0], 64
        sq = 0.0
        for a in range(0, n, step):
            x = _rows_f64(ao, slice(a, a + step))
            sq += float(np.sum(np.square(x)))
        scale = math.sqrt(sq / max(1, int(np.prod(ao.shape)))) if n else 1.0
        f = PEER_TOL_FACTOR
        acc = _Acc((OUT_TOL[0] * f, OUT_TOL[1] * f), scale)
        try:
            for a in range(0, n, step):
                acc.add(_rows_f64(o, slice(a, a + step)), _rows_f64(ao, slice(a, a + step)),
                        offset=a, what="out: ")
        except _Mismatch as e:
            return Check(False, math.inf, str(e))
        chk = acc.check()
        if not chk.ok:
            return chk
        pairs = []
        if ml is not None and aml is not None:
            pairs.append(("max_logits: ", _rows_f64(ml), _rows_f64(aml),
                          (STAT_TOL[0] * f, STAT_TOL[1] * f)))
        if lse is not None and alse is not None:
            pairs.append(("lse: ", _rows_f64(lse), _rows_f64(alse),
                          (STAT_TOL[0] * f, STAT_TOL[1] * f)))
        stats = _checks(pairs)
        if not stats.ok:
            return stats
        return Check(True, max(chk.err, stats.err))

    def inject_error(self, case, ref, out):
        o, ml, lse = _parts(out)
        o = o.copy() if isinstance(o, np.ndarray) else o.clone()
        r = int(ref.rows[-1])
        bad = float(ref.out[-1, 0, 0]) + 1.0 + 10.0 * _rms(ref.out)
        o[r, 0, 0] = bad
        return (o, ml, lse) if isinstance(out, tuple) else o

    def contenders(self, case):
        import attnkit

        s = case.shape
        d_v = s.d_v
        notes = []

        def run_attnkit(x):
            return attnkit.sparse_mla_prefill_fwd(x.q, x.kv, x.indices, x.sm_scale, d_v,
                                                  q_scale=x.q_scale, kv_scale=x.kv_scale)

        out = attnkit_contenders(run_attnkit, notes)
        torch = optional_torch()
        if torch is None:
            notes.append("torch-ref: skipped (torch is not importable)")
        elif not hasattr(torch, "float8_e4m3fn") and case.dtype == FP8:
            notes.append("torch-ref: skipped (this torch has no float8_e4m3fn)")
        else:
            out.append(Contender("torch-ref", "peer", _torch_reference(torch, s),
                                 set_threads=torch.set_num_threads,
                                 note=f"torch {torch.__version__}, fp32, "
                                      f"{TORCH_CHUNK} query rows per batch"))
        return out, notes


def _torch_reference(torch, s: SparseShape):
    """Sparse MLA as a user would write it in torch: dequantise to fp32, gather the top-k kv
    rows (invalid slots clamped to row 0 and masked), batched q·kᵀ, masked softmax, P·V; in
    chunks of query rows so memory stays bounded. Returns bf16 out [s_q, h_q, d_v]."""
    d_v, s_kv = s.d_v, s.s_kv

    def run(x):
        q8, kv8, indices = x.torch()
        qs, ks = x.scale_values()
        with torch.no_grad():
            kv = kv8[:, 0].float()
            if ks != 1.0:
                kv = kv * ks
            out = torch.empty((q8.shape[0], q8.shape[1], d_v), dtype=torch.bfloat16)
            for a in range(0, q8.shape[0], TORCH_CHUNK):
                b = min(a + TORCH_CHUNK, q8.shape[0])
                idx = indices[a:b, 0].long()                           # [c, topk]
                valid = (idx >= 0) & (idx < s_kv)
                rows = kv[torch.where(valid, idx, 0)]                  # [c, topk, d_qk]
                q = q8[a:b].float()                                     # [c, h_q, d_qk]
                if qs != 1.0:
                    q = q * qs
                logits = torch.bmm(q, rows.transpose(1, 2)) * x.sm_scale  # [c, h_q, topk]
                logits.masked_fill_(~valid[:, None, :], float("-inf"))
                p = torch.softmax(logits, dim=-1)
                o = torch.bmm(p, rows[:, :, :d_v])                     # [c, h_q, d_v]
                o = torch.where(valid.any(dim=1)[:, None, None], o, 0.0)  # no valid slot: 0
                out[a:b] = o.to(torch.bfloat16)
            return out

    return run


register(SparseMlaOp())

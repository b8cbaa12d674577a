"""``--op attention``: dense scaled dot-product attention (attnkit.attention).

Shapes follow docs/BENCH.md (A, A', V, Dc) or a custom "key=value,..." spec. The reference is
float64 numpy on a subset of (batch, head, query row) triples, computed exactly with GQA and
top-left causal semantics; peers are torch SDPA and attnkit's portable ("generic") kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from .machine import AMX_BF16, BF16_DOT, FP32_FMA, bf16_dot_of
from .peers import onnxruntime_contender, openvino_contender
from .registry import (BenchOp, Check, Contender, Counts, attnkit_contenders, itemsize, numpy_dtype,
                       optional_torch, register, shape_int)

DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
}

# (atol, rtol): |out - ref| <= atol * rms(ref) + rtol * |ref|. fp32 accumulates in fp32 over up
# to Skv keys; bf16/fp16 outputs are rounded once (2^-9 / 2^-12 relative), inputs are exact.
TOLERANCES = {"float32": (1e-4, 1e-4), "bfloat16": (1.6e-2, 1.6e-2), "float16": (3e-3, 3e-3)}
# bf16 may also round P to bf16 before P·V (attnkit on avx512bf16, FlashAttention, torch):
# up to 2^-8 * sum_j p_j |v_j| / sum_j p_j more per output (the reference's `magnitude`).
P_ROUNDING = {"bfloat16": 2.0 ** -8}
PEER_TOL_FACTOR = 2.0  # a peer vs attnkit: both sides carry rounding error


def exact_peak_of(row):
    """The instruction whose peak bounds an exact-attention row: attnkit's bf16 products run
    on its variant's bf16 instruction (Q·Kᵀ and P·V: AMX's tdpbf16ps on avx512amx, vdpbf16ps
    on avx512bf16, fp32 FMAs elsewhere, attnkit-generic included); fp32 and fp16 inputs on
    fp32 FMAs. Peers with bf16
    inputs: AMX tiles where the CPU has them, else vdpbf16ps where it has that (torch's and
    OpenVINO's bf16 GEMMs go to oneDNN, which uses them), else fp32 FMA."""
    import attnkit
    from attnkit import _C

    if row.case.dtype != "bfloat16" or row.contender == "attnkit-generic":
        return FP32_FMA
    if row.role != "peer" or row.contender.startswith("attnkit"):  # attnkit's, modifiers included
        return bf16_dot_of(attnkit.get_isa())
    if row.contender == "onnxruntime-fp16":
        return FP32_FMA  # float16 through fp32 on CPUs without AVX512-FP16 (MLAS; assumed)
    features = _C.cpu_features().split()
    if "amx-bf16" in features:
        return AMX_BF16
    return BF16_DOT if "avx512bf16" in features else FP32_FMA


def decode_peak_of(row, peak, rows_per_kv_head):
    """The peak of an attnkit decode row (at most 8 query rows per kv head, docs/ARCHITECTURE.md)
    given `peak`, its call's: avx512vnni runs bf16 calls that only decode on avx512bf16's key
    blocks, vdpbf16ps (src/core/dispatch.cpp); bf16 queries, over bf16 or fp8 K and V."""
    import attnkit

    bf16_queries = row.case.dtype == "bfloat16" or row.case.dtype.startswith("float8")
    if (peak == FP32_FMA and bf16_queries and rows_per_kv_head <= 8 and row.contender.startswith("attnkit")
            and row.contender != "attnkit-generic" and attnkit.get_isa() == "avx512vnni"):
        return BF16_DOT
    return peak


@dataclass(frozen=True)
class AttnShape:
    name: Optional[str]
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Skv: int
    D: int
    Dv: int
    causal: bool
    dtypes: Optional[tuple] = None    # docs/BENCH.md dtypes of a named shape
    only_dtypes: bool = False         # the named shape is defined for `dtypes` only
    quick: bool = False

    @property
    def gqa(self) -> bool:
        return self.Hq != self.Hkv

    @property
    def is_decode(self) -> bool:
        return self.Sq <= 16

    def dims(self) -> str:
        h = f"H={self.Hq}" if self.Hq == self.Hkv else f"Hq={self.Hq} Hkv={self.Hkv}"
        s = f"S={self.Sq}" if self.Sq == self.Skv else f"Sq={self.Sq} Skv={self.Skv}"
        d = f"D={self.D}" if self.D == self.Dv else f"D={self.D} Dv={self.Dv}"
        return f"B={self.B} {h} {s} {d} {'causal' if self.causal else 'non-causal'}"

    @property
    def label(self) -> str:
        base = self.name or self.dims().replace(" ", ",")
        return base + (" (quick)" if self.quick else "")


NAMED = {
    "A": AttnShape("A", 1, 32, 8, 2048, 2048, 128, 128, True, ("float32", "bfloat16")),
    "A'": AttnShape("A'", 1, 32, 8, 2048, 2048, 128, 128, False, ("float32", "bfloat16")),
    "V": AttnShape("V", 1, 24, 24, 4608, 4608, 128, 128, False, ("bfloat16",), only_dtypes=True),
    "Dc": AttnShape("Dc", 1, 32, 8, 1, 8192, 128, 128, False, ("bfloat16",)),
    # a trivial call, for the per-call overhead of each entry point (not a docs/BENCH.md shape)
    "call": AttnShape("call", 1, 1, 1, 1, 16, 64, 64, False, ("float32",)),
}
ALIASES = {"a": "A", "a'": "A'", "ap": "A'", "aprime": "A'", "v": "V", "dc": "Dc",
           "decode": "Dc", "call": "call", "overhead": "call"}
DEFAULT_SHAPES = ["A", "A'", "V", "Dc"]
CUSTOM_DEFAULT_DTYPES = ("float32", "bfloat16")


def parse_shape(text: str) -> AttnShape:
    """"A" / "A'" / "Ap" / "V" / "Dc" / "call", or "B=1,Hq=32,Hkv=8,S=2048,D=128,causal" (keys B, Hq,
    Hkv, H (both), S (Sq and Skv), Sq, Skv, D, Dv; flags causal / noncausal). A custom spec
    may start from a named shape: "A,S=4096"."""
    text = text.strip()
    key = ALIASES.get(text.lower())
    if key is not None:
        return NAMED[key]
    tokens = [t for t in text.replace(";", ",").replace(" ", ",").split(",") if t]
    if not tokens:
        raise ValueError("empty shape")
    vals = dict(B=1, Hq=None, Hkv=None, Sq=None, Skv=None, D=128, Dv=None, causal=False)
    if tokens[0].lower() in ALIASES:
        base = NAMED[ALIASES[tokens.pop(0).lower()]]
        vals.update(B=base.B, Hq=base.Hq, Hkv=base.Hkv, Sq=base.Sq, Skv=base.Skv, D=base.D,
                    Dv=base.Dv, causal=base.causal)
    keys = {"b": "B", "hq": "Hq", "hkv": "Hkv", "h": "H", "s": "S", "sq": "Sq", "skv": "Skv",
            "d": "D", "dv": "Dv"}
    for tok in tokens:
        if "=" not in tok:
            flag = tok.lower()
            if flag == "causal":
                vals["causal"] = True
            elif flag in ("noncausal", "non-causal", "nocausal"):
                vals["causal"] = False
            else:
                raise ValueError(f"unknown shape flag {tok!r} (expected causal or noncausal)")
            continue
        k, v = (p.strip() for p in tok.split("=", 1))
        if k.lower() == "causal":
            vals["causal"] = v.lower() in ("1", "true", "yes", "top_left")
            continue
        if k.lower() not in keys:
            raise ValueError(f"unknown shape key {k!r} (keys: B, Hq, Hkv, H, S, Sq, Skv, D, Dv)")
        n = shape_int(k, v)
        k = keys[k.lower()]
        if k == "H":
            vals["Hq"] = vals["Hkv"] = n
        elif k == "S":
            vals["Sq"] = vals["Skv"] = n
        else:
            vals[k] = n
    if vals["Hq"] is None and vals["Hkv"] is None:
        raise ValueError(f"shape {text!r}: give the heads (H, or Hq and Hkv)")
    if vals["Hq"] is None:
        vals["Hq"] = vals["Hkv"]
    if vals["Hkv"] is None:
        vals["Hkv"] = vals["Hq"]
    if vals["Sq"] is None and vals["Skv"] is None:
        raise ValueError(f"shape {text!r}: give the sequence length (S, or Sq and Skv)")
    if vals["Sq"] is None:
        vals["Sq"] = vals["Skv"]
    if vals["Skv"] is None:
        vals["Skv"] = vals["Sq"]
    if vals["Dv"] is None:
        vals["Dv"] = vals["D"]
    if vals["Hq"] % vals["Hkv"]:
        raise ValueError(f"shape {text!r}: Hq={vals['Hq']} is not a multiple of Hkv={vals['Hkv']}")
    if vals["D"] > 512 or vals["Dv"] > 512:
        raise ValueError(f"shape {text!r}: D and Dv must be <= 512")
    shape = AttnShape(None, vals["B"], vals["Hq"], vals["Hkv"], vals["Sq"], vals["Skv"],
                      vals["D"], vals["Dv"], vals["causal"])
    for named in NAMED.values():  # a spelled-out named shape keeps its name and dtypes
        if replace(named, name=None, dtypes=None, only_dtypes=False) == shape:
            return named
    return shape


def visible_pairs(Sq: int, Skv: int, causal: bool) -> int:
    """Visible (query, key) pairs: Sq·Skv, or Σ_i min(i+1, Skv) for top-left causal."""
    if not causal:
        return Sq * Skv
    if Sq <= Skv:
        return Sq * (Sq + 1) // 2
    return Skv * (Skv + 1) // 2 + (Sq - Skv) * Skv


class AttnInputs:
    """q, k, v as numpy arrays (bf16 through ml_dtypes) and, where torch exists, zero-copy
    torch views of the same memory."""

    def __init__(self, q, k, v):
        self.q, self.k, self.v = q, k, v
        self._torch = None

    def torch(self):
        if self._torch is None:
            torch = optional_torch()

            def view(a):
                if a.dtype == np.float32 or a.dtype == np.float16:
                    return torch.from_numpy(a)
                return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)

            self._torch = tuple(view(a) for a in (self.q, self.k, self.v))
        return self._torch


@dataclass
class AttnRef:
    bs: np.ndarray
    heads: np.ndarray
    rows: np.ndarray
    out: np.ndarray  # float64 [len(bs), len(heads), len(rows), Dv]
    magnitude: np.ndarray  # sum_j p_j |v_j| / sum_j p_j, as out


def _as_f32(x) -> np.ndarray:
    """A float32 numpy copy/view of a numpy array or torch tensor of any float dtype."""
    if isinstance(x, np.ndarray):
        return x if x.dtype == np.float32 else x.astype(np.float32)
    return x.detach().float().numpy()


def _subset(x, bs, heads, rows) -> np.ndarray:
    if not isinstance(x, np.ndarray):  # torch
        x = x.detach()[list(bs)][:, list(heads)][:, :, list(rows)]
        return x.double().numpy()
    return x[np.ix_(bs, heads, rows)].astype(np.float64)


def _check(out, ref, dtype, factor=1.0, magnitude=None) -> Check:
    atol, rtol = TOLERANCES[dtype]
    atol, rtol = atol * factor, rtol * factor
    if out.shape != ref.shape:
        return Check(False, math.inf, f"shape {out.shape} != expected {ref.shape}")
    if not np.all(np.isfinite(out)):
        return Check(False, math.inf, f"{int(np.sum(~np.isfinite(out)))} non-finite values")
    if not np.all(np.isfinite(ref)):  # attnkit's output, when a peer is compared with it
        return Check(False, math.inf, f"{int(np.sum(~np.isfinite(ref)))} non-finite values on the reference side")
    scale = max(float(np.sqrt(np.mean(np.square(ref, dtype=np.float64)))), 1e-30)
    diff = np.abs(out.astype(np.float64) - ref)
    bound = atol * scale + rtol * np.abs(ref)
    if magnitude is not None:
        bound = bound + P_ROUNDING.get(dtype, 0.0) * factor * magnitude
    bad = diff > bound
    err = float(np.max(diff)) / scale if diff.size else 0.0
    if np.any(bad):
        idx = np.unravel_index(int(np.argmax(diff - bound)), diff.shape)
        return Check(False, err, f"{int(bad.sum())}/{bad.size} values out of tolerance; worst at "
                                 f"{tuple(int(i) for i in idx)}: {float(out[idx]):.6g} vs "
                                 f"{float(ref[idx]):.6g}")
    return Check(True, err)


def exact_reference(s: AttnShape, inputs, bs, heads, rows) -> np.ndarray:
    """float64 attention (GQA, top-left causal, scale 1/sqrt(D)) for the (batch, query head,
    query row) triples bs x heads x rows, and its magnitude (the same with |v|): two arrays
    [len(bs), len(heads), len(rows), Dv]."""
    group = s.Hq // s.Hkv
    scale = 1.0 / math.sqrt(s.D)
    rows = np.asarray(rows)
    out = np.empty((len(bs), len(heads), len(rows), s.Dv))
    magnitude = np.empty_like(out)
    cols = np.arange(s.Skv)
    for bi, b in enumerate(bs):
        for hi, h in enumerate(heads):
            kvh = h // group
            q = inputs.q[b, h, rows].astype(np.float64)
            k = inputs.k[b, kvh].astype(np.float64)
            v = inputs.v[b, kvh].astype(np.float64)
            sc = (q @ k.T) * scale
            if s.causal:
                sc = np.where(cols[None, :] <= rows[:, None], sc, -np.inf)
            mx = np.max(sc, axis=1, keepdims=True)
            visible = np.isfinite(mx)
            p = np.exp(sc - np.where(visible, mx, 0.0))
            den = np.sum(p, axis=1, keepdims=True)
            den = np.where(den > 0, den, 1.0)
            out[bi, hi] = np.where(visible, (p @ v) / den, 0.0)  # a row with no visible key gives 0
            magnitude[bi, hi] = np.where(visible, (p @ np.abs(v)) / den, 0.0)
    return out, magnitude


class AttentionOp(BenchOp):
    name = "attention"
    description = "dense scaled dot-product attention (attnkit.attention vs torch SDPA)"

    # --- shapes -------------------------------------------------------------------------
    shapes = NAMED
    default_shapes = tuple(DEFAULT_SHAPES)
    shape_parser = staticmethod(parse_shape)

    def quick_shape(self, s):
        # Sequence lengths / 4 (V: S=1152, A: S=512, Dc: Skv=2048); a decode row stays 1.
        sq = s.Sq if s.Sq == 1 else max(1, s.Sq // 4)
        return replace(s, Sq=sq, Skv=max(1, s.Skv // 4), quick=True)

    def peak_of(self, row):
        peak = exact_peak_of(row)
        s = row.case.shape
        # avx512amx runs decode's key blocks on tiles only over kv heads side by side (paged,
        # packed, [B, S, H, D]); this op's K and V are [B, H, S, D], so its decode rows (at
        # most 8 query rows per kv head: docs/ARCHITECTURE.md) stay on vdpbf16ps.
        if peak == AMX_BF16 and row.contender.startswith("attnkit") and s.Sq * (s.Hq // s.Hkv) <= 8:
            return BF16_DOT
        return decode_peak_of(row, peak, s.Sq * (s.Hq // s.Hkv))

    def dtypes_for(self, shape, requested):
        if requested is None:
            return list(shape.dtypes or CUSTOM_DEFAULT_DTYPES), ""
        if shape.only_dtypes:
            kept = [d for d in requested if d in shape.dtypes]
            skipped = [d for d in requested if d not in shape.dtypes]
            note = (f"{shape.name}: skipped {', '.join(skipped)} (docs/BENCH.md defines it for "
                    f"{', '.join(shape.dtypes)} only)") if skipped else ""
            return kept, note
        return list(requested), ""

    # --- per case -----------------------------------------------------------------------
    def counts(self, case):
        s = case.shape
        pairs = visible_pairs(s.Sq, s.Skv, s.causal)
        flops = 2.0 * s.B * s.Hq * (s.D + s.Dv) * pairs
        keys_read = min(s.Skv, s.Sq) if s.causal else s.Skv  # top-left causal: keys past Sq never seen
        kv_bytes = float(s.B * s.Hkv * keys_read * (s.D + s.Dv) * itemsize(case.dtype))
        return Counts(flops=flops, mem_bytes=kv_bytes, memory_bound=s.is_decode,
                      extra={"pairs": pairs})

    def input_bytes(self, case):
        s = case.shape
        return itemsize(case.dtype) * s.B * (s.Hq * s.Sq * s.D + s.Hkv * s.Skv * (s.D + s.Dv))

    def make_inputs(self, case, rng):
        s, dt = case.shape, numpy_dtype(case.dtype)

        def rand(*shape):
            x = rng.standard_normal(shape, dtype=np.float32)
            return x if dt == np.float32 else x.astype(dt)

        return AttnInputs(rand(s.B, s.Hq, s.Sq, s.D), rand(s.B, s.Hkv, s.Skv, s.D),
                          rand(s.B, s.Hkv, s.Skv, s.Dv))

    def reference(self, case, inputs, rng=None):
        s = case.shape
        rng = rng or np.random.default_rng(1234)
        bs = np.array(sorted({0, s.B - 1}))
        group = s.Hq // s.Hkv
        # Three query heads from different kv groups where possible (first, middle, last).
        heads = np.array(sorted({0, min(s.Hq - 1, (s.Hkv // 2) * group + group // 2), s.Hq - 1}))
        fixed = {0, min(1, s.Sq - 1), s.Sq // 2, s.Sq - 1}
        extra = set(rng.choice(s.Sq, size=min(s.Sq, 4), replace=False).tolist())
        rows = np.array(sorted(fixed | extra))
        return AttnRef(bs, heads, rows, *exact_reference(s, inputs, bs, heads, rows))

    def verify(self, case, ref, out):
        return _check(_subset(out, ref.bs, ref.heads, ref.rows), ref.out, case.dtype,
                      magnitude=ref.magnitude)

    def compare(self, case, out, attnkit_out):
        return _check(_as_f32(out), _as_f32(attnkit_out).astype(np.float64), case.dtype,
                      PEER_TOL_FACTOR)

    def inject_error(self, case, ref, out):
        out = out.copy() if isinstance(out, np.ndarray) else out.clone()
        b, h, r = int(ref.bs[0]), int(ref.heads[0]), int(ref.rows[-1])
        out[b, h, r, 0] = out[b, h, r, 0] * -3 + 1
        return out

    def contenders(self, case):
        import attnkit

        s = case.shape
        causal, gqa = s.causal, s.gqa
        notes = []

        def run_attnkit(x):
            return attnkit.attention(x.q, x.k, x.v, causal=causal, enable_gqa=gqa)

        out = attnkit_contenders(run_attnkit, notes)
        if s.name == "call":
            out += self.attnkit_torch_contender(s, notes)
        out += self.torch_sdpa_contender(s, notes)
        if s.name != "call":
            out += openvino_contender(s, case.dtype, notes) + onnxruntime_contender(s, case.dtype, notes)
        return out, notes

    @staticmethod
    def attnkit_torch_contender(s, notes) -> list:
        """attnkit.attention on the same inputs as torch tensors (eager, no grad): the torch
        entry point's cost per call, next to numpy's (attnkit) and torch's own SDPA."""
        torch = optional_torch()
        if torch is None:
            notes.append("attnkit-torch: skipped (torch is not importable)")
            return []
        import attnkit

        def run(x):
            q, k, v = x.torch()
            with torch.no_grad():
                return attnkit.attention(q, k, v, causal=s.causal, enable_gqa=s.gqa)

        notes.append("shape call: a trivial call; its times are each entry point's overhead per call "
                     "(attnkit: numpy arrays, attnkit-torch: torch tensors, eager)")
        return [Contender("attnkit-torch", "peer", run, set_threads=attnkit.set_num_threads,
                          note="attnkit.attention on torch tensors")]

    @staticmethod
    def torch_sdpa_contender(s, notes, **fields) -> list:
        """torch's scaled_dot_product_attention on the same inputs (a list of 0 or 1);
        `fields` go to the Contender (e.g. verify, compare_to)."""
        torch = optional_torch()
        if torch is None:
            notes.append("torch-sdpa: skipped (torch is not importable)")
            return []
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run_torch(x):
            q, k, v = x.torch()
            with torch.no_grad():
                if s.gqa:
                    return sdpa(q, k, v, is_causal=s.causal, enable_gqa=True)
                return sdpa(q, k, v, is_causal=s.causal)

        return [Contender("torch-sdpa", "peer", run_torch, set_threads=torch.set_num_threads,
                          note=f"torch {torch.__version__}", **fields)]


register(AttentionOp())

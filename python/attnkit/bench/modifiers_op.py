"""``--op modifiers``: the cost of attnkit.attention's score modifiers, side by side with
plain attention at the same shape in one run (interleaved, so drift hits all alike).

Shapes: A (BENCH.md's causal prefill; default dtypes fp32 and bf16) and W (A at S=8192,
where a sliding window of 1024 does 4.26x less useful work than full causal), or any
attention shape spec. Contenders, all attnkit on the best ISA: plain attention (role
attnkit, what the ratios are against), window=(1024, 0), softcap=50 (Gemma 2's), ALiBi
(BLOOM's slopes 2^(-8h/Hq)) and per-head sinks (at W plain and window only). Each is verified against its own float64
reference on a subset of rows. GFLOP/s count each row's useful FLOPs (the window row only
the pairs its window leaves visible); the ratio column is the time ratio: window should be
<= 1/3.6 at W, softcap <= 1.15 and ALiBi and sinks <= 1.05 at A.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from .attention_op import NAMED, AttentionOp, AttnRef, _check, _subset
from .registry import Contender, register

WINDOW = (1024, 0)
SOFTCAP = 50.0

MOD_NAMED = {"A": NAMED["A"], "W": replace(NAMED["A"], name="W", Sq=8192, Skv=8192)}


def variants(s):
    """(name, attention keywords) of every contender at shape s, plain first; at W only the
    window (its calls take seconds, and the other targets are set at A)."""
    slopes = (2.0 ** (-8.0 * (np.arange(s.Hq) + 1) / s.Hq)).astype(np.float32)
    sinks = np.random.default_rng(7).normal(0.0, 2.0, s.Hq).astype(np.float32)
    every = [("attnkit", {}), ("window", {"window": WINDOW}), ("softcap", {"softcap": SOFTCAP}),
             ("alibi", {"alibi_slopes": slopes}), ("sinks", {"sinks": sinks})]
    return every[:2] if s.name == "W" else every


def window_pairs(s, left, right) -> int:
    """Visible (query, key) pairs under a window (and causal, top-left, as the op's
    causal=True): query i at aligned position a sees keys max(0, a - left) .. a + right."""
    a = np.arange(s.Sq, dtype=np.int64) + (0 if s.causal else s.Skv - s.Sq)
    lo = np.maximum(a - left, 0) if left >= 0 else np.zeros_like(a)
    hi = np.minimum(a + right if right >= 0 else s.Skv - 1, s.Skv - 1)
    if s.causal:
        hi = np.minimum(hi, a)
    return int(np.sum(np.maximum(hi - lo + 1, 0)))


def modified_reference(s, inputs, bs, heads, rows, mods):
    """float64 attention with the modifiers (GQA, top-left causal as the op's causal=True,
    scale 1/sqrt(D)) for bs x heads x rows: (out, magnitude) as attention_op's."""
    group, scale = s.Hq // s.Hkv, 1.0 / math.sqrt(s.D)
    rows = np.asarray(rows)
    out = np.empty((len(bs), len(heads), len(rows), s.Dv))
    magnitude = np.empty_like(out)
    j = np.arange(s.Skv)[None, :]
    a = rows[:, None] if s.causal else rows[:, None] + (s.Skv - s.Sq)  # aligned positions
    visible = np.ones((len(rows), s.Skv), bool)
    if s.causal:
        visible &= j <= a
    if "window" in mods:
        left, right = mods["window"]
        visible &= (j >= a - left) if left >= 0 else True
        visible &= (j <= a + right) if right >= 0 else True
    for bi, b in enumerate(bs):
        for hi, h in enumerate(heads):
            q = inputs.q[b, h, rows].astype(np.float64)
            k, v = (x[b, h // group].astype(np.float64) for x in (inputs.k, inputs.v))
            sc = (q @ k.T) * scale
            if "softcap" in mods:
                sc = mods["softcap"] * np.tanh(sc / mods["softcap"])
            if "alibi_slopes" in mods:
                sc = sc - float(mods["alibi_slopes"][h]) * np.abs(a - j)
            sc = np.where(visible, sc, -np.inf)
            mx = np.max(sc, axis=1, keepdims=True)
            live = np.isfinite(mx)
            p = np.exp(sc - np.where(live, mx, 0.0))
            den = np.sum(p, axis=1, keepdims=True)
            if "sinks" in mods:
                den = den + np.exp(float(mods["sinks"][h]) - np.where(live, mx, 0.0))
            den = np.where(live, den, 1.0)
            out[bi, hi] = np.where(live, (p @ v) / den, 0.0)
            magnitude[bi, hi] = np.where(live, (p @ np.abs(v)) / den, 0.0)
    return out, magnitude


class ModifiersOp(AttentionOp):
    name = "modifiers"
    description = "attention's score modifiers (window, softcap, ALiBi, sinks) vs plain attention"
    shapes = MOD_NAMED
    default_shapes = ("A", "W")

    def parse_shape(self, text):
        key = text.strip().upper()
        return MOD_NAMED[key] if key in MOD_NAMED else super().parse_shape(text)

    def reference(self, case, inputs, rng=None):
        base = super().reference(case, inputs, rng)
        refs = {}
        for name, mods in variants(case.shape):
            refs[name] = AttnRef(base.bs, base.heads, base.rows,
                                 *modified_reference(case.shape, inputs, base.bs, base.heads, base.rows, mods))
        return refs

    def verify(self, case, ref, out):
        return self._verify(case, ref["attnkit"], out)

    def _verify(self, case, ref, out):
        return _check(_subset(out, ref.bs, ref.heads, ref.rows), ref.out, case.dtype, magnitude=ref.magnitude)

    def inject_error(self, case, ref, out):
        return super().inject_error(case, ref["attnkit"], out)

    def contenders(self, case):
        import attnkit

        s = case.shape
        best = attnkit.get_isa()
        out = []
        for name, mods in variants(s):
            def run(x, mods=mods):
                return attnkit.attention(x.q, x.k, x.v, causal=s.causal, enable_gqa=s.gqa, **mods)

            def verify(ref, got, name=name):
                return self._verify(case, ref[name], got)

            note = f"isa {best}" if not mods else ", ".join(f"{k}={v!r}" if k in ("window", "softcap")
                                                            else k for k, v in mods.items())
            flops = None  # the op's count (all visible pairs), but for the window's fewer pairs
            if "window" in mods:
                flops = 2.0 * s.B * s.Hq * (s.D + s.Dv) * window_pairs(s, *mods["window"])
            out.append(Contender(name, "attnkit" if not mods else "reference", run,
                                 prepare=lambda: attnkit.set_isa(best), set_threads=attnkit.set_num_threads,
                                 note=note, verify=verify, compare_to=None if not mods else "", flops=flops))
        return out, []


register(ModifiersOp())

"""``--op backward``: attnkit.attention_backward (dq, dk, dv) next to attnkit's forward and
torch's CPU SDPA backward, in one run (interleaved, so drift hits all alike). ``--op
varlen_backward``: the same for attnkit.varlen_attention_backward on the packed ragged batch
of ``--op varlen`` (shape R), torch's SDPA backward on the padded batch with a padding mask
(what users do today; the graph built once per input set, the gradients unpadded inside the
timed call); verified on two sequences' kv head Hkv-1 (all their rows).

Shapes: attention's (A, A', V or a spec; default A, fp32 and bf16). Contenders: attnkit's
backward (role attnkit, what the ratios are against), attnkit's forward on the same inputs
(reference role: its ratio is forward time / backward time, so 1 / ratio is "backward = N x
forward"), and torch SDPA's backward (peer: only ``out.backward(dout)`` is timed, on a graph
built once per input set with retain_graph, the forward untimed). Verification: every
gradient of kv head Hkv-1 of batch 0 (dk, dv, and dq of its query heads, all rows) against a
float64 reference; the forward against float64 attention on those heads. GFLOP/s count the
useful FLOPs: the backward's five products, 2 · B · Hq · (3·D + 2·Dv) · pairs, and the
forward row its two, 2 · B · Hq · (D + Dv) · pairs.
"""

from __future__ import annotations

import math

import numpy as np

from types import SimpleNamespace

from .attention_op import AttentionOp, AttnInputs, _as_f32, _check, exact_peak_of
from .registry import Check, Contender, Counts, numpy_dtype, optional_torch, register
from .serving_op import VarlenInputs, VarlenOp, padded_batch

# |got - ref| <= atol · max|ref| + rtol · |ref| per gradient (as tests/python/test_attention_backward.py)
GRAD_TOL = {"float32": (2e-5, 1e-4), "float16": (2e-3, 4e-3), "bfloat16": (1.6e-2, 2e-2)}
PEER_FACTOR = 2.0  # torch vs attnkit: both sides carry rounding error


class BackwardInputs(AttnInputs):
    """q, k, v, the forward's out and lse (attnkit's, untimed), dout; a torch graph for the peer."""

    def __init__(self, q, k, v, dout, causal, gqa):
        super().__init__(q, k, v)
        import attnkit

        self.dout = dout
        self.out, self.lse = attnkit.attention(q, k, v, causal=causal, enable_gqa=gqa, return_lse=True)
        self.graph = None  # (leaves, out, dout) of torch SDPA, built before timing (prepare_inputs)

    def torch_graph(self, causal, gqa):
        if self.graph is None:
            torch = optional_torch()
            leaves = [x.clone().requires_grad_() for x in self.torch()]
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa)
            dout = torch.from_numpy(self.dout.view(np.uint16)).view(torch.bfloat16) if \
                self.dout.dtype.itemsize == 2 and self.dout.dtype != np.float16 else torch.from_numpy(self.dout)
            self.graph = (leaves, out, dout)
        return self.graph


def backward_reference(s, inputs, b, kvh):
    """float64 (dq [group, Sq, D], dk [Skv, D], dv [Skv, Dv], out [group, Sq, Dv], magnitude)
    of batch b, kv head kvh (top-left causal as the op's causal=True, scale 1/sqrt(D))."""
    group, scale = s.Hq // s.Hkv, 1.0 / math.sqrt(s.D)
    k = inputs.k[b, kvh].astype(np.float64)
    v = inputs.v[b, kvh].astype(np.float64)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    dq = np.empty((group, s.Sq, s.D))
    out = np.empty((group, s.Sq, s.Dv))
    magnitude = np.empty_like(out)
    visible = np.arange(s.Skv)[None, :] <= np.arange(s.Sq)[:, None] if s.causal else np.ones((s.Sq, s.Skv), bool)
    for g in range(group):
        h = kvh * group + g
        q = inputs.q[b, h].astype(np.float64)
        do = inputs.dout[b, h].astype(np.float64)
        sc = np.where(visible, (q @ k.T) * scale, -np.inf)
        mx = np.max(sc, axis=1, keepdims=True)
        live = np.isfinite(mx)
        e = np.exp(sc - np.where(live, mx, 0.0))
        p = e / np.where(live, e.sum(axis=1, keepdims=True), 1.0)
        out[g], magnitude[g] = p @ v, p @ np.abs(v)
        dv += p.T @ do
        dp = do @ v.T
        ds = p * (dp - np.sum(do * out[g], axis=1, keepdims=True))
        dq[g] = ds @ k * scale
        dk += ds.T @ q * scale
    return dq, dk, dv, out, magnitude


def _grads_of(out):
    """(dq, dk, dv) as float32 numpy from attnkit's numpy triple or torch's leaf grads."""
    return [_as_f32(g) for g in out]


def _check_grads(got, ref, dtype, factor=1.0) -> Check:
    atol, rtol = GRAD_TOL[dtype]
    worst = 0.0
    for g, r, name in zip(got, ref, ("dq", "dk", "dv")):
        if g.shape != r.shape:
            return Check(False, math.inf, f"{name}: shape {g.shape} != expected {r.shape}")
        if not np.all(np.isfinite(g)):
            return Check(False, math.inf, f"{name}: {int(np.sum(~np.isfinite(g)))} non-finite values")
        if not np.all(np.isfinite(r)):  # attnkit's gradients, when a peer is compared with them
            return Check(False, math.inf, f"{name}: {int(np.sum(~np.isfinite(r)))} non-finite values on the reference side")
        top = max(float(np.max(np.abs(r))), 1e-30)
        diff = np.abs(g.astype(np.float64) - r)
        bad = diff > factor * (atol * top + rtol * np.abs(r))
        worst = max(worst, float(np.max(diff)) / top)
        if np.any(bad):
            idx = np.unravel_index(int(np.argmax(diff)), diff.shape)
            return Check(False, worst, f"{name}: {int(bad.sum())}/{bad.size} values out of tolerance; worst at "
                                       f"{tuple(int(i) for i in idx)}: {float(g[idx]):.6g} vs {float(r[idx]):.6g}")
    return Check(True, worst)


def backward_and_forward(run_backward, run_forward, verify_forward, forward_flops):
    """attnkit's backward (what the ratios are against) and its forward on the same inputs
    (reference role, its own verification and FLOPs), both on the active ISA."""
    import attnkit

    best = attnkit.get_isa()
    return [Contender("attnkit", "attnkit", run_backward, prepare=lambda: attnkit.set_isa(best),
                      set_threads=attnkit.set_num_threads, note=f"backward, isa {best}"),
            Contender("attnkit-forward", "reference", run_forward, prepare=lambda: attnkit.set_isa(best),
                      set_threads=attnkit.set_num_threads, note="forward: ratio = forward / backward",
                      verify=verify_forward, compare_to="", flops=forward_flops)]


class BackwardOp(AttentionOp):
    name = "backward"
    description = "attention backward (attnkit.attention_backward vs its forward and torch SDPA's backward)"
    default_shapes = ("A",)

    def peak_of(self, row):
        # As exact attention's rows: bf16 on the variant's bf16 instruction (attnkit's five
        # products; torch's oneDNN gemms), else fp32 FMAs; the forward's row as attention's.
        if row.contender == "attnkit-forward":
            return super().peak_of(row)
        return exact_peak_of(row)

    def counts(self, case):
        base = super().counts(case)
        s = case.shape
        pairs = base.extra["pairs"]
        return Counts(flops=2.0 * s.B * s.Hq * (3 * s.D + 2 * s.Dv) * pairs, extra={"pairs": pairs})

    def input_bytes(self, case):
        s = case.shape
        return super().input_bytes(case) + 2 * s.B * s.Hq * s.Sq * s.Dv * np.dtype(self._np(case)).itemsize

    @staticmethod
    def _np(case):
        from .registry import numpy_dtype
        return numpy_dtype(case.dtype)

    def make_inputs(self, case, rng):
        x = super().make_inputs(case, rng)
        s, dt = case.shape, self._np(case)
        dout = rng.standard_normal((s.B, s.Hq, s.Sq, s.Dv), dtype=np.float32)
        return BackwardInputs(x.q, x.k, x.v, dout if dt == np.float32 else dout.astype(dt), s.causal, s.gqa)

    def reference(self, case, inputs, rng=None):
        s = case.shape
        kvh = s.Hkv - 1
        dq, dk, dv, out, magnitude = backward_reference(s, inputs, 0, kvh)
        return {"kvh": kvh, "grads": (dq, dk, dv), "out": out, "magnitude": magnitude}

    def _subset(self, case, ref, grads):
        group = case.shape.Hq // case.shape.Hkv
        kvh = ref["kvh"]
        dq, dk, dv = _grads_of(grads)
        return dq[0, kvh * group:(kvh + 1) * group], dk[0, kvh], dv[0, kvh]

    def verify(self, case, ref, out):
        return _check_grads(self._subset(case, ref, out), ref["grads"], case.dtype)

    def verify_forward(self, case, ref, out):
        group = case.shape.Hq // case.shape.Hkv
        got = _as_f32(out)[0, ref["kvh"] * group:(ref["kvh"] + 1) * group].astype(np.float64)
        return _check(got, ref["out"], case.dtype, magnitude=ref["magnitude"])

    def compare(self, case, out, attnkit_out):
        got = _grads_of(out)
        ref = [g.astype(np.float64) for g in _grads_of(attnkit_out)]
        return _check_grads(got, ref, case.dtype, PEER_FACTOR)

    def inject_error(self, case, ref, out):
        dq = out[0].copy()
        group = case.shape.Hq // case.shape.Hkv
        dq[0, ref["kvh"] * group, -1, 0] = dq[0, ref["kvh"] * group, -1, 0] * -3 + 1
        return (dq,) + tuple(out[1:])

    def contenders(self, case):
        import attnkit

        s = case.shape
        notes = []
        forward_flops = super().counts(case).flops  # the forward's two products, not the five

        def run_backward(x):
            return attnkit.attention_backward(x.q, x.k, x.v, x.out, x.lse, x.dout, causal=s.causal,
                                              enable_gqa=s.gqa)

        def run_forward(x):
            return attnkit.attention(x.q, x.k, x.v, causal=s.causal, enable_gqa=s.gqa)

        out = backward_and_forward(run_backward, run_forward, lambda ref, got: self.verify_forward(case, ref, got),
                                   forward_flops)
        torch = optional_torch()
        if torch is None:
            notes.append("torch-sdpa-backward: skipped (torch is not importable)")
            return out, notes

        def run_torch(x):
            leaves, o, dout = x.torch_graph(s.causal, s.gqa)
            for leaf in leaves:
                leaf.grad = None
            o.backward(dout, retain_graph=True)
            return [leaf.grad for leaf in leaves]

        out.append(Contender("torch-sdpa-backward", "peer", run_torch, set_threads=torch.set_num_threads,
                             note=f"torch {torch.__version__}, out.backward only",
                             prepare_inputs=lambda x: x.torch_graph(s.causal, s.gqa)))  # untimed
        return out, notes


register(BackwardOp())


class VarlenBackwardInputs(VarlenInputs):
    """The packed batch, dout, and the forward's out and lse (attnkit's, untimed); a padded
    torch graph for the peer, built before timing (prepare_inputs)."""

    def __init__(self, x, dout, causal):
        super().__init__(x.q, x.k, x.v, x.cu)
        import attnkit

        self.dout = dout
        self.fwd_out, self.lse = attnkit.varlen_attention(x.q, x.k, x.v, x.cu, x.cu, causal=causal, return_lse=True)
        # Written before timing, as out is (VarlenInputs): fresh gradient buffers cost R fp32's
        # backward 250-450 ms of page faults per call here (1.35 s with these, 1.6-1.75 without).
        self.grads = tuple(np.zeros_like(a) for a in (x.q, x.k, x.v))
        self.graph = None

    def torch_graph(self, s):
        if self.graph is None:
            torch = optional_torch()
            (q, k, v, dout), mask, index = padded_batch(torch, self, s, (self.q, self.k, self.v, self.dout))
            leaves = [t.requires_grad_() for t in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=s.Hq != s.Hkv)
            self.graph = (leaves, out, dout, index)
        return self.graph


class VarlenBackwardOp(VarlenOp):
    name = "varlen_backward"
    description = ("backward of a packed ragged batch (attnkit.varlen_attention_backward vs its forward and "
                   "padded torch SDPA's backward)")

    def peak_of(self, row):
        return super().peak_of(row) if row.contender == "attnkit-forward" else exact_peak_of(row)

    def counts(self, case):
        base = super().counts(case)
        s = case.shape
        return Counts(flops=2.0 * s.Hq * 5 * s.D * base.extra["pairs"], extra=base.extra)

    def input_bytes(self, case):
        return super().input_bytes(case) * 2  # and dout, out

    def make_inputs(self, case, rng):
        x = super().make_inputs(case, rng)
        dout = rng.standard_normal(x.q.shape, dtype=np.float32).astype(numpy_dtype(case.dtype))
        return VarlenBackwardInputs(x, dout, case.shape.causal)

    def reference(self, case, inputs, rng=None):
        s = case.shape
        lengths = s.lengths()
        kvh, group = s.Hkv - 1, s.Hq // s.Hkv
        seqs, grads, outs = sorted({0, int(np.argmax(lengths))}), [], []
        for b in seqs:
            lo, hi = inputs.cu[b], inputs.cu[b + 1]
            n = hi - lo
            bhsd = lambda a: a[lo:hi].transpose(1, 0, 2)[None]  # noqa: E731
            shape = SimpleNamespace(Hq=s.Hq, Hkv=s.Hkv, Sq=n, Skv=n, D=s.D, Dv=s.D, causal=s.causal)
            seq = SimpleNamespace(q=bhsd(inputs.q), k=bhsd(inputs.k), v=bhsd(inputs.v), dout=bhsd(inputs.dout))
            dq, dk, dv, out, magnitude = backward_reference(shape, seq, 0, kvh)
            grads.append((dq, dk, dv))
            outs.append((out, magnitude))
        return {"seqs": seqs, "kvh": kvh, "group": group, "grads": grads, "out": outs}

    def _rows(self, ref, cu, b, x, heads):
        return np.asarray(_as_f32(x))[cu[b]:cu[b + 1], heads].transpose(1, 0, 2) if isinstance(heads, slice) else \
            np.asarray(_as_f32(x))[cu[b]:cu[b + 1], heads]

    def verify(self, case, ref, out):
        cu = np.concatenate([[0], np.cumsum(case.shape.lengths())])
        kvh, group = ref["kvh"], ref["group"]
        qheads = slice(kvh * group, (kvh + 1) * group)
        got, want = [[], [], []], [[], [], []]
        for i, b in enumerate(ref["seqs"]):
            for j, (g, heads) in enumerate(zip(out, (qheads, kvh, kvh))):
                got[j].append(self._rows(ref, cu, b, g, heads).reshape(-1))
                want[j].append(ref["grads"][i][j].reshape(-1))
        return _check_grads([np.concatenate(g) for g in got], [np.concatenate(w) for w in want], case.dtype)

    def verify_forward(self, case, ref, out):
        cu = np.concatenate([[0], np.cumsum(case.shape.lengths())])
        kvh, group = ref["kvh"], ref["group"]
        got = [self._rows(ref, cu, b, out, slice(kvh * group, (kvh + 1) * group)).reshape(-1) for b in ref["seqs"]]
        want = [o.reshape(-1) for o, _ in ref["out"]]
        magnitude = [m.reshape(-1) for _, m in ref["out"]]
        return _check(np.concatenate(got).astype(np.float64), np.concatenate(want), case.dtype,
                      magnitude=np.concatenate(magnitude))

    def compare(self, case, out, attnkit_out):
        ref = [g.astype(np.float64) for g in _grads_of(attnkit_out)]
        return _check_grads(_grads_of(out), ref, case.dtype, PEER_FACTOR)

    def reset_outputs(self, inputs):
        for buffer in (inputs.out,) + inputs.grads:
            buffer.fill(np.nan)

    def inject_error(self, case, ref, out):
        dq = out[0].copy()
        dq[0, ref["kvh"] * ref["group"], 0] = dq[0, ref["kvh"] * ref["group"], 0] * -3 + 1
        return (dq,) + tuple(out[1:])

    def contenders(self, case):
        import attnkit

        s = case.shape
        notes = []
        forward_flops = VarlenOp.counts(self, case).flops  # the forward's two products

        def run_backward(x):
            dq, dk, dv = x.grads
            return attnkit.varlen_attention_backward(x.q, x.k, x.v, x.fwd_out, x.lse, x.dout, x.cu, x.cu,
                                                     causal=s.causal, dq=dq, dk=dk, dv=dv)

        def run_forward(x):
            return attnkit.varlen_attention(x.q, x.k, x.v, x.cu, x.cu, causal=s.causal, out=x.out)

        out = backward_and_forward(run_backward, run_forward, lambda ref, got: self.verify_forward(case, ref, got),
                                   forward_flops)
        notes.append("attnkit and attnkit-forward write into preallocated dq, dk, dv and out, as an engine or "
                     "training loop reusing its buffers does; torch's backward allocates its gradients")
        torch = optional_torch()
        if torch is None:
            notes.append("torch-sdpa-padded-backward: skipped (torch is not importable)")
            return out, notes

        def run_torch(x):
            leaves, o, dout, index = x.torch_graph(s)
            for leaf in leaves:
                leaf.grad = None
            o.backward(dout, retain_graph=True)
            return [leaf.grad.transpose(1, 2).reshape(-1, leaf.shape[1], s.D)[index] for leaf in leaves]

        out.append(Contender("torch-sdpa-padded-backward", "peer", run_torch, set_threads=torch.set_num_threads,
                             note=f"torch {torch.__version__}, padded + mask, out.backward only",
                             prepare_inputs=lambda x: x.torch_graph(s)))  # untimed
        return out, notes


register(VarlenBackwardOp())

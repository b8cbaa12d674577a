"""attnkit.sparse_mla_prefill_fwd (general) and attnkit.sparse_mla_q8kv8_prefill_fwd (SGLang's
strict contract), DeepSeek-V3.2 sparse MLA prefill, against the float64 reference in
sparse_mla_reference.py; plus pad_heads / unpad_heads and the torch.library registration.

Tolerances (derived in sparse_mla_reference.py): out (bf16) rtol 1e-2 + atol 1e-4 * max|V|
(+ 2^-8 * Σp|V|/Σp on avx512bf16, where P is rounded to bf16 before P·V, as in FlashMLA);
max_logits / lse (float32) 1e-5 relative + 1e-5 * (logit magnitude + 1) absolute.
"""

import math

import numpy as np
import pytest

import attnkit
from conftest import assert_bits_equal, assert_unmodified, snapshot, strided_like
from reference import assert_close
import sparse_mla_reference as R

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

FP8, BF16 = "float8_e4m3fn", "bfloat16"
NAN_FP8 = (0x7F, 0xFF)


def general():
    return attnkit.sparse_mla_prefill_fwd


def torch_ops():
    """torch.ops.attnkit: attnkit registers its torch.library ops when its torch module is
    first imported (attnkit does that on the first torch tensor; do it here explicitly)."""
    import attnkit._torch_ops  # noqa: F401
    return torch.ops.attnkit


def strict():
    return attnkit.sparse_mla_q8kv8_prefill_fwd


def tt(x):
    """A torch tensor with numpy array x's values (bf16 / fp8 included), sharing memory."""
    if x is None or isinstance(x, (float, int)):
        return x
    x = np.asarray(x)
    if x.dtype == R.bf16_dtype():
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
    if x.dtype == R.fp8_dtype():
        return torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(x)


def f32(v):
    return np.array(v, dtype=np.float32)


class Case:
    """One set of inputs for the general op and its reference results."""

    def __init__(self, rng, s_q, h_q, s_kv, d_qk, d_v, topk, dtype=FP8, tl=False, sink=False,
                 tl_extra=(), **idx_kw):
        self.dtype, self.d_v = dtype, d_v
        self.q, self.kv = R.make_qkv(rng, s_q, h_q, s_kv, d_qk, dtype)
        self.indices = R.make_indices(rng, s_q, s_kv, topk, **idx_kw)
        self.sm_scale = 1.0 / math.sqrt(d_qk)
        if dtype == FP8:   # the e4m3 draws have rms ~2.8: bring logits to std ~2
            self.q_scale, self.kv_scale = f32(0.5), f32([0.375])
        else:
            self.q_scale = self.kv_scale = None
        self.topk_length = R.make_topk_length(rng, s_q, topk, tl_extra) if tl else None
        self.attn_sink = R.make_sink(rng, h_q) if sink else None

    def kwargs(self, **over):
        kw = dict(q_scale=self.q_scale, kv_scale=self.kv_scale, attn_sink=self.attn_sink,
                  topk_length=self.topk_length)
        kw.update(over)
        return kw

    def inputs(self):
        return [self.q, self.kv, self.indices, self.q_scale, self.kv_scale, self.attn_sink,
                self.topk_length]

    def run(self, q=None, kv=None, indices=None, **over):
        """The general op on these inputs; keyword overrides replace any of them."""
        q = self.q if q is None else q
        kv = self.kv if kv is None else kv
        indices = self.indices if indices is None else indices
        return general()(q, kv, indices, self.sm_scale, self.d_v, **self.kwargs(**over))

    def ref(self, **over):
        a = dict(q=self.q, kv=self.kv, indices=self.indices, q_scale=self.q_scale,
                 kv_scale=self.kv_scale, attn_sink=self.attn_sink, topk_length=self.topk_length)
        a.update(over)
        return R.sparse_mla_ref(a["q"], a["kv"], a["indices"], self.sm_scale, self.d_v,
                                a["q_scale"], a["kv_scale"], a["attn_sink"], a["topk_length"])

    def check(self, got, **over):
        """got = (out, max_logits, lse) against the reference, with the stated tolerances."""
        a = dict(q=self.q, kv=self.kv, indices=self.indices, q_scale=self.q_scale,
                 kv_scale=self.kv_scale, topk_length=self.topk_length)
        a.update({k: v for k, v in over.items() if k in a})
        ref = self.ref(**over)
        out, ml, lse = got
        s_q, h_q = R.to_np(a["q"]).shape[:2]
        assert tuple(out.shape) == (s_q, h_q, self.d_v) and tuple(ml.shape) == (s_q, h_q)
        assert tuple(lse.shape) == (s_q, h_q)
        assert R.to_np(out).dtype == R.bf16_dtype(), out.dtype
        assert R.to_np(ml).dtype == np.float32 and R.to_np(lse).dtype == np.float32
        _close_elementwise(R.to_np(out), ref[0], R.out_atol(a["kv"], self.d_v, a["kv_scale"], ref[3]), R.OUT_RTOL,
                           "out")
        mag = R.logit_magnitude(a["q"], a["kv"], a["indices"], self.sm_scale, a["q_scale"],
                                a["kv_scale"], a["topk_length"])
        atol = R.logit_tol(mag)
        for name, g, r in (("max_logits", ml, ref[1]), ("lse", lse, ref[2])):
            _close_elementwise(R.to_np(g), r, atol, R.LOGIT_RTOL, name)
        return ref


def _close_elementwise(got, ref, atol, rtol, name):
    """assert_close with an elementwise atol: scale both sides by 1/atol (a per-element
    positive factor, so NaN/inf positions and the pass/fail of each element are unchanged)."""
    g = got.astype(np.float64) / atol
    r = np.asarray(ref, dtype=np.float64) / atol
    # |g - r| <= 1 + rtol * |r| in the scaled units is exactly |got - ref| <= atol + rtol |ref|
    assert_close(g, r, 1.0, rtol, name)


def poisoned(s_q, h_q, d_v, kind="numpy"):
    out = np.full((s_q, h_q, d_v), np.nan, dtype=R.bf16_dtype())
    ml = np.full((s_q, h_q), np.nan, dtype=np.float32)
    lse = np.full((s_q, h_q), np.nan, dtype=np.float32)
    if kind == "torch":
        return tt(out), tt(ml), tt(lse)
    return out, ml, lse


# --- the reference itself -------------------------------------------------------------------

def _naive_ref(q, kv, indices, sm_scale, d_v, q_scale, kv_scale, sink, topk_length):
    """The spec as scalar loops, to check the vectorised reference."""
    qf, kvf = R.f64(q) * R.scalar(q_scale), R.f64(kv)[:, 0] * R.scalar(kv_scale)
    s_q, h_q, _ = qf.shape
    out = np.zeros((s_q, h_q, d_v))
    ml = np.full((s_q, h_q), -np.inf)
    lse = np.full((s_q, h_q), np.inf)
    for s in range(s_q):
        slots = [int(i) for t, i in enumerate(indices[s, 0])
                 if 0 <= i < kvf.shape[0] and (topk_length is None or t < topk_length[s])]
        if not slots:
            continue
        for h in range(h_q):
            lg = [float(qf[s, h] @ kvf[i]) * sm_scale for i in slots]
            m = max(lg)
            e = [math.exp(x - m) for x in lg]
            den = sum(e) + (0.0 if sink is None else
                            (math.inf if sink[h] == np.inf else math.exp(float(sink[h]) - m)))
            out[s, h] = sum(w * kvf[i, :d_v] for w, i in zip(e, slots)) / den
            ml[s, h], lse[s, h] = m, m + math.log(sum(e))
    return out, ml, lse


def test_reference_matches_naive_loops(rng):
    for dtype, tl, sink in ((FP8, True, True), (BF16, False, True), (FP8, False, False)):
        c = Case(rng, 5, 6, 30, 16, 8, 40, dtype, tl, sink)
        c.indices[0, 0, :] = -1
        ref = c.ref()
        naive = _naive_ref(c.q, c.kv, c.indices, c.sm_scale, 8, c.q_scale, c.kv_scale,
                           c.attn_sink, c.topk_length)
        for a, b in zip(ref, naive):
            assert_close(a, b, 1e-12, 1e-12, "reference")


# --- random cases against the reference ------------------------------------------------------

CASES = [
    # dtype, s_q, h_q, s_kv, d_qk, d_v, topk, topk_length, sink
    (FP8, 5, 1, 300, 64, 32, 100, False, False),
    (BF16, 4, 16, 200, 64, 64, 128, True, False),
    (FP8, 3, 24, 50, 576, 512, 128, True, True),      # s_kv < topk
    (FP8, 3, 43, 400, 512, 512, 100, False, True),    # 43 heads, padded internally
    (BF16, 3, 43, 90, 576, 512, 128, True, True),
    (FP8, 4, 64, 1000, 576, 512, 128, True, True),
    (FP8, 6, 128, 700, 576, 512, 256, True, True),    # the larger shape
    (BF16, 4, 128, 300, 576, 512, 256, False, True),
    (FP8, 2, 16, 3000, 576, 512, 2048, True, True),   # topk 2048, small s_q / h_q
    (BF16, 2, 1, 1500, 64, 64, 2048, False, False),   # topk 2048 > s_kv
    (FP8, 7, 16, 10, 512, 512, 1, True, True),        # topk 1
    (BF16, 5, 24, 33, 64, 1, 1, False, True),         # d_v 1
    (FP8, 4, 1, 8, 64, 17, 100, True, False),         # odd d_v, s_kv << topk
    (BF16, 3, 64, 129, 576, 512, 100, True, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_random_vs_reference(rng, case):
    dtype, s_q, h_q, s_kv, d_qk, d_v, topk, tl, sink = case
    c = Case(rng, s_q, h_q, s_kv, d_qk, d_v, topk, dtype, tl, sink,
             tl_extra=(topk + 1, 2**31 - 1) if tl else ())
    before = snapshot(*c.inputs())
    # caller buffers, NaN-poisoned: every element must be written
    out, ml, lse = poisoned(s_q, h_q, d_v)
    got = c.run(out=out, max_logits=ml, lse=lse)
    assert got[0] is out and got[1] is ml and got[2] is lse
    c.check(got)
    assert_unmodified(before, c.inputs())
    # and with attnkit-allocated outputs: the same bits
    got2 = c.run()
    for name, a, b in zip(("out", "max_logits", "lse"), got, got2):
        assert isinstance(b, np.ndarray)
        assert_bits_equal(a, b, name)


def test_empty_rows(rng):
    """Rows with no valid slot (all invalid indices, topk_length 0, all slots past
    topk_length invalid): out 0, max_logits -inf, lse +inf, with or without a sink."""
    s_q, h_q, s_kv, topk = 6, 24, 40, 100
    c = Case(rng, s_q, h_q, s_kv, 576, 512, topk, FP8, tl=True, sink=True)
    c.indices[0, 0, :] = -1
    c.indices[1, 0, :] = rng.choice([s_kv, -5, R.INT32_MAX, R.INT32_MIN], size=topk)
    c.topk_length[:] = [topk, topk, 0, 3, topk + 5, 0]
    c.indices[3, 0, :3] = [-1, s_kv, R.INT32_MIN]   # valid slots only after topk_length
    for sink in (c.attn_sink, None):
        out, ml, lse = poisoned(s_q, h_q, 512)
        c.run(attn_sink=sink, out=out, max_logits=ml, lse=lse)
        c.check((out, ml, lse), attn_sink=sink)
        for s in (0, 1, 2, 3, 5):
            o = out[s].astype(np.float32)
            assert np.all(o == 0), f"row {s}: out not 0"
            assert np.all(ml[s] == -np.inf), f"row {s}: max_logits {ml[s]}"
            assert np.all(lse[s] == np.inf), f"row {s}: lse {lse[s]}"
        assert np.isfinite(lse[4]).all()


def test_topk_length_negative_is_empty(rng):
    """A negative topk_length leaves no slot with t < topk_length: an empty row."""
    c = Case(rng, 3, 16, 300, 64, 64, 128, BF16, tl=True)
    c.topk_length[:] = [-1, R.INT32_MIN, 5]
    got = c.run()
    c.check(got)
    assert np.all(got[1][:2] == -np.inf) and np.all(got[2][:2] == np.inf)


def test_sink_specials(rng):
    """+inf sink: out 0; -inf sink: no effect (bitwise); any sink leaves max_logits and lse
    alone (bitwise), and finite sinks match the reference."""
    s_q, h_q = 4, 16
    c = Case(rng, s_q, h_q, 500, 576, 512, 128, FP8, tl=True, sink=False)
    base = c.run()
    sink = R.make_sink(rng, h_q)          # [+inf, -inf, 60, -60, finite...]
    got = c.run(attn_sink=sink)
    c.check(got, attn_sink=sink)
    live = c.topk_length > 0
    assert np.all(got[0][live, 0].astype(np.float32) == 0), "+inf sink must give out = 0"
    assert_bits_equal(got[0][:, 1], base[0][:, 1], "out with a -inf sink")
    assert_bits_equal(got[1], base[1], "max_logits (sink must not enter)")
    assert_bits_equal(got[2], base[2], "lse (sink must not enter)")
    all_neg = np.full(h_q, -np.inf, dtype=np.float32)
    for a, b, name in zip(c.run(attn_sink=all_neg), base, ("out", "max_logits", "lse")):
        assert_bits_equal(a, b, name + " with all -inf sinks")
    # a sink far above every logit: out tiny/zero, matching the reference
    big = np.full(h_q, 200.0, dtype=np.float32)
    c.check(c.run(attn_sink=big), attn_sink=big)


def test_duplicates_count_per_slot(rng):
    """A row index appearing in k valid slots weighs k times."""
    s_kv, d = 20, 64
    q, kv = R.make_qkv(rng, 2, 4, s_kv, d, BF16)
    idx = np.array([[[3, 3, 3, 7]], [[5, 5, 5, 5]]], dtype=np.int32)
    out, ml, lse = general()(q, kv, idx, 0.125, d)
    ref = R.sparse_mla_ref(q, kv, idx, 0.125, d)
    _close_elementwise(out, ref[0], R.out_atol(kv, d, None, ref[3]), R.OUT_RTOL, "out")
    # row 1: all slots the same row: softmax is uniform, out = V[5], lse = logit + log 4
    assert_close(out[1], np.broadcast_to(R.f64(kv)[5, 0], (4, d)), *R.out_tol(kv, d))
    logit = R.f64(q)[1] @ R.f64(kv)[5, 0] * 0.125
    _close_elementwise(lse[1], logit + math.log(4), 1e-5 * (np.abs(logit) + 1), 1e-5, "lse")
    _close_elementwise(ml[1], logit, 1e-5 * (np.abs(logit) + 1), 1e-5, "max_logits")


def test_topk_length_equals_neg1_tail_bitwise(rng):
    """topk_length and the same tail filled with -1 give bit-identical outputs."""
    s_q, h_q, topk = 8, 43, 256
    for dtype in (FP8, BF16):
        c = Case(rng, s_q, h_q, 600, 576, 512, topk, dtype, tl=True, sink=True,
                 tl_extra=(topk + 3, 2**31 - 1))
        a = c.run()
        tail = np.arange(topk)[None, :] >= c.topk_length.astype(np.int64)[:, None]
        idx2 = np.where(tail[:, None, :], -1, c.indices).astype(np.int32)
        b = c.run(indices=idx2, topk_length=None)
        for x, y, name in zip(a, b, ("out", "max_logits", "lse")):
            assert_bits_equal(x, y, f"{dtype} {name}")
        c.check(a)


def test_extreme_indices(rng):
    """Any int32 value in an invalid slot is safe; an all-extreme table is all empty rows."""
    s_q, topk, s_kv = 4, 128, 64
    c = Case(rng, s_q, 16, s_kv, 512, 512, topk, FP8)
    vals = np.array([R.INT32_MIN, R.INT32_MAX, -1, s_kv, s_kv + 1, 2**30, -2**30], np.int64)
    c.indices[:2] = rng.choice(vals, size=(2, 1, topk)).astype(np.int32)
    c.indices[2, 0, ::2] = R.INT32_MAX
    c.indices[3, 0, 1::2] = R.INT32_MIN
    got = c.run()
    c.check(got)
    assert np.all(got[2][:2] == np.inf)


# --- NaN propagation / invalid rows never read ------------------------------------------------

@pytest.mark.parametrize("code", NAN_FP8)
def test_fp8_nan_in_q_row_only(rng, code):
    s_q, h_q = 3, 24
    c = Case(rng, s_q, h_q, 300, 576, 512, 128, FP8, sink=True)
    c.indices[1, 0, :5] = [0, 1, 2, 3, 4]                  # row 1 surely non-empty
    qb = c.q.view(np.uint8)
    qb[1, 5, 100] = code                                  # NaN in q[1, 5], a K-only column
    c.indices[2, 0, :3] = [5, 6, 7]                       # row 2 surely non-empty
    qb[2, 7, 3] = code                                    # NaN in q[2, 7], a V column
    got = c.run()
    ref = c.check(got)
    assert np.isnan(got[0][1, 5].astype(np.float32)).all(), "out[1, 5] must be NaN"
    assert np.isnan(got[2][1, 5]), "lse[1, 5] must be NaN"
    assert np.isnan(got[1][1, 5]), "max_logits[1, 5] must be NaN"
    nan_rows = np.isnan(ref[0]).any(axis=-1)
    assert nan_rows.sum() == 2 and np.isnan(got[0][2, 7].astype(np.float32)).all()
    assert np.isfinite(got[0][~nan_rows].astype(np.float32)).all()


@pytest.mark.parametrize("column", ["k_only", "v_part"])
def test_fp8_nan_in_valid_kv_row(rng, column):
    """NaN in a kv row that some slot validly references: every head of those query rows is
    NaN; rows that don't reference it are unaffected."""
    s_q, h_q, s_kv, topk = 4, 16, 300, 128
    c = Case(rng, s_q, h_q, s_kv, 576, 512, topk, FP8, tl=True)
    c.topk_length[:] = topk
    r = 17
    c.indices[c.indices == r] = -1
    c.indices[0, 0, 10] = r                 # valid
    c.indices[2, 0, 11] = r
    c.topk_length[2] = 11                   # slot 11 of row 2 is past topk_length: invalid
    c.kv.view(np.uint8)[r, 0, 550 if column == "k_only" else 20] = 0xFF
    got = c.run()
    c.check(got)
    assert np.isnan(got[0][0].astype(np.float32)).all() and np.isnan(got[2][0]).all()
    for s in (1, 2, 3):
        assert np.isfinite(got[0][s].astype(np.float32)).all(), f"row {s} polluted"
        assert np.isfinite(got[1][s]).all() and np.isfinite(got[2][s]).all()


@pytest.mark.parametrize("dtype", [FP8, BF16])
def test_nan_in_unreferenced_rows_is_ignored(rng, dtype):
    """NaN filling every kv row that no valid slot references (unreferenced, referenced only
    past topk_length, or only by out-of-range neighbours) changes nothing, bitwise."""
    s_q, h_q, s_kv, topk = 5, 24, 400, 128
    c = Case(rng, s_q, h_q, s_kv, 576, 512, topk, dtype, tl=True, sink=True)
    base = c.run()
    used = np.zeros(s_kv, dtype=bool)
    v = R.valid_slots(c.indices, s_kv, c.topk_length)
    used[c.indices[:, 0, :][v]] = True
    kv2 = c.kv.copy()
    kv2[~used] = np.nan
    got = c.run(kv=kv2)
    for a, b, name in zip(got, base, ("out", "max_logits", "lse")):
        assert_bits_equal(a, b, name)
    c.check(got)


# --- determinism --------------------------------------------------------------------------

def test_bitwise_across_threads_and_runs(rng, restore_runtime):
    c = Case(rng, 9, 43, 700, 576, 512, 256, FP8, tl=True, sink=True)
    results = []
    for n in (1, 2, 1, 2):
        attnkit.set_num_threads(n)
        results.append(c.run())
    for r in results[1:]:
        for a, b, name in zip(r, results[0], ("out", "max_logits", "lse")):
            assert_bits_equal(a, b, name)
    c.check(results[0])


def test_each_isa(rng, isa):
    c = Case(rng, 3, 43, 300, 576, 512, 128, FP8, tl=True, sink=True)
    c.check(c.run())
    c2 = Case(rng, 3, 5, 100, 64, 48, 100, BF16, sink=True)
    c2.check(c2.run())


# --- scales -------------------------------------------------------------------------------

def test_scale_forms(rng):
    """q_scale / kv_scale as 0-d, 1-element, Python float, or torch tensors: same bits."""
    c = Case(rng, 3, 16, 200, 512, 512, 128, FP8)
    base = c.run(q_scale=f32(0.5), kv_scale=f32(0.375))
    c.check(base)
    forms = [(f32([0.5]), f32(0.375)), (0.5, 0.375), (f32([[0.5]]).reshape(1), 0.375)]
    for qs, ks in forms:
        got = c.run(q_scale=qs, kv_scale=ks)
        for a, b, name in zip(got, base, ("out", "max_logits", "lse")):
            assert_bits_equal(a, b, f"{name} with scales {qs!r}, {ks!r}")
    # torch inputs: 0-d / 1-element tensors and Python floats
    for qs, ks in [(torch.tensor(0.5), torch.tensor([0.375])), (0.5, torch.tensor(0.375))]:
        got = general()(tt(c.q), tt(c.kv), tt(c.indices), c.sm_scale, 512, q_scale=qs,
                        kv_scale=ks)
        for a, b, name in zip(got, base, ("out", "max_logits", "lse")):
            assert_bits_equal(a, b, f"{name} with torch scales {qs!r}, {ks!r}")
    # a scale of the other kind than q is refused
    with pytest.raises(ValueError, match="q_scale"):
        c.run(q_scale=torch.tensor(0.5))


@pytest.mark.parametrize("missing", ["q_scale", "kv_scale", "both"])
def test_fp8_requires_scales(rng, missing):
    c = Case(rng, 2, 4, 50, 64, 64, 100, FP8)
    over = {"q_scale": None, "kv_scale": None} if missing == "both" else {missing: None}
    name = "q_scale" if missing == "both" else missing
    with pytest.raises(ValueError, match=name):
        c.run(**over)


def test_bf16_scales(rng):
    """bf16: scales default to 1; given, they scale like fp8's."""
    c = Case(rng, 3, 16, 200, 576, 512, 128, BF16, sink=True)
    ones = c.run(q_scale=f32(1.0), kv_scale=1.0)
    for a, b, name in zip(c.run(), ones, ("out", "max_logits", "lse")):
        assert_bits_equal(a, b, name)
    c.check(c.run(q_scale=f32(0.5), kv_scale=f32([2.0])), q_scale=f32(0.5), kv_scale=f32(2.0))


# --- strided inputs (general op) ---------------------------------------------------------------

def test_strided_inputs(rng):
    c = Case(rng, 4, 24, 200, 64, 48, 100, FP8, tl=True, sink=True)
    base = c.run()
    q2, _ = strided_like(c.q, rng)                   # NaN-code padding
    kv2, _ = strided_like(c.kv, rng)
    idx2, _ = strided_like(c.indices, rng, fill=0)   # padding would be a valid index
    sink2 = np.full(2 * 24, np.nan, np.float32)[::2]
    sink2[:] = c.attn_sink
    tl2 = np.full(2 * 4, 0, np.int32)[::2]
    tl2[:] = c.topk_length
    got = c.run(q=q2, kv=kv2, indices=idx2, attn_sink=sink2, topk_length=tl2)
    for a, b, name in zip(got, base, ("out", "max_logits", "lse")):
        assert_bits_equal(a, b, name)
    c.check(got)


# --- caller buffers ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_caller_buffers_returned(rng, kind):
    c = Case(rng, 3, 16, 100, 64, 64, 100, BF16, sink=True)
    cv = (lambda x: tt(x)) if kind == "torch" else (lambda x: x)
    out, ml, lse = poisoned(3, 16, 64, kind)
    args = (cv(c.q), cv(c.kv), cv(c.indices), c.sm_scale, 64)
    got = general()(*args, attn_sink=cv(c.attn_sink), out=out, max_logits=ml, lse=lse)
    assert got[0] is out and got[1] is ml and got[2] is lse
    c.check(got)
    # only some buffers given: the others are allocated, the given one is used
    ml2 = poisoned(3, 16, 64, kind)[1]
    got2 = general()(*args, attn_sink=cv(c.attn_sink), max_logits=ml2)
    assert got2[1] is ml2
    for a, b, name in zip(got2, got, ("out", "max_logits", "lse")):
        assert_bits_equal(a, b, name)


S_Q, H_Q, D_QK, D_V, TOPK, S_KV = 2, 4, 64, 32, 100, 50


def _small(rng, dtype=BF16, h_q=H_Q, s_q=S_Q, d_v=D_V, s_kv=S_KV):
    return Case(rng, s_q, h_q, s_kv, D_QK if d_v <= D_QK else d_v, d_v, TOPK, dtype, sink=True)


def _bad_buffers(which, problem):
    """(out, max_logits, lse): NaN-poisoned, one of them broken by `problem`."""
    bufs = dict(zip(("out", "max_logits", "lse"), poisoned(S_Q, H_Q, D_V)))
    x = bufs[which]
    if problem == "shape":
        x = np.full(x.shape[:-1] + (x.shape[-1] + 1,), np.nan, x.dtype)
    elif problem == "rank":
        x = x[None]
    elif problem == "dtype":
        x = np.full(x.shape, np.nan, np.float32 if which == "out" else R.bf16_dtype())
    elif problem == "dtype64":
        x = np.full(x.shape, np.nan, np.float64)
    elif problem == "noncontig":
        x = strided_like(x, np.random.default_rng(3))[0]
        assert not x.flags.c_contiguous
    elif problem == "transposed":
        x = np.full(x.shape[::-1], np.nan, x.dtype).T
    bufs[which] = x
    return bufs


def _expect_error(fn, bufs, pattern):
    before = {k: np.array(R.to_np(v).astype(np.float32), copy=True) for k, v in bufs.items()
              if v is not None}
    with pytest.raises(ValueError, match=pattern):
        fn(**bufs)
    for k, b in before.items():   # a failed call writes nothing
        assert np.array_equal(R.to_np(bufs[k]).astype(np.float32), b, equal_nan=True), \
            f"{k} written by a failed call"


@pytest.mark.parametrize("which", ["out", "max_logits", "lse"])
@pytest.mark.parametrize("problem", ["shape", "rank", "dtype", "dtype64", "noncontig", "transposed"])
def test_caller_buffer_errors(rng, which, problem):
    c = _small(rng)
    bufs = _bad_buffers(which, problem)
    _expect_error(lambda **kw: c.run(**kw), bufs, which)


@pytest.mark.parametrize("which", ["out", "max_logits", "lse"])
def test_caller_buffer_errors_torch(rng, which):
    c = _small(rng)
    for problem in ("shape", "dtype", "noncontig"):
        bufs = {k: tt(v) for k, v in _bad_buffers(which, problem).items()}
        fn = lambda **kw: general()(tt(c.q), tt(c.kv), tt(c.indices), c.sm_scale, D_V,
                                    attn_sink=tt(c.attn_sink), **kw)
        _expect_error(fn, bufs, which)


def _byte_views(*specs):
    """Views of one shared byte buffer: specs are (byte offset, shape, dtype)."""
    n = max(off + int(np.prod(shape)) * np.dtype(dt).itemsize for off, shape, dt in specs)
    raw = np.zeros(n + 16, dtype=np.uint8)
    raw[:] = 0
    return [raw[off:off + int(np.prod(shape)) * np.dtype(dt).itemsize].view(dt).reshape(shape)
            for off, shape, dt in specs]


ALIAS_CASES = ["ml_is_lse", "lse_overlaps_out", "ml_overlaps_lse_tail", "out_is_q", "out_is_kv",
               "ml_is_sink", "lse_is_indices", "ml_is_topk_length", "lse_is_q_scale",
               "out_overlaps_kv"]


@pytest.mark.parametrize("alias", ALIAS_CASES)
def test_caller_buffer_aliasing(rng, alias):
    """Outputs may not overlap each other or any input (ValueError, nothing written)."""
    bf = R.bf16_dtype()
    s_q, h_q, d_v = S_Q, H_Q, D_V
    c = _small(rng)
    out, ml, lse = poisoned(s_q, h_q, d_v)
    over = {}
    if alias == "ml_is_lse":
        ml = lse
    elif alias == "lse_overlaps_out":
        out, lse = _byte_views((0, (s_q, h_q, d_v), bf), (8, (s_q, h_q), np.float32))
    elif alias == "ml_overlaps_lse_tail":
        lse, ml = _byte_views((0, (s_q, h_q), np.float32), (4 * (s_q * h_q - 1), (s_q, h_q), np.float32))
    elif alias == "out_is_q":
        c = _small(rng, d_v=D_QK)
        out = c.q
    elif alias == "out_is_kv":
        c = Case(rng, 3, 1, 3, 64, 64, 100, BF16)
        out, ml, lse = poisoned(3, 1, 64)
        out = c.kv
    elif alias == "out_overlaps_kv":
        c = Case(rng, 3, 1, 10, 64, 64, 100, BF16)
        out, ml, lse = poisoned(3, 1, 64)
        out = c.kv[5:8]
    elif alias == "ml_is_sink":
        c = _small(rng, s_q=1)
        out, ml, lse = poisoned(1, h_q, d_v)
        ml = c.attn_sink.reshape(1, h_q)
    elif alias == "lse_is_indices":
        c = Case(rng, s_q, TOPK, S_KV, 64, 32, TOPK, BF16)
        out, ml, lse = poisoned(s_q, TOPK, 32)
        idx, lse = _byte_views((0, (s_q, 1, TOPK), np.int32), (0, (s_q, TOPK), np.float32))
        idx[:] = c.indices
        over["indices"] = idx
    elif alias == "ml_is_topk_length":
        c = Case(rng, s_q, 1, S_KV, 64, 32, TOPK, BF16)
        out, ml, lse = poisoned(s_q, 1, 32)
        tl, ml = _byte_views((0, (s_q,), np.int32), (0, (s_q, 1), np.float32))
        tl[:] = [3, TOPK]
        over["topk_length"] = tl
    elif alias == "lse_is_q_scale":
        c = Case(rng, 1, 1, S_KV, 64, 32, TOPK, FP8)
        out, ml, lse = poisoned(1, 1, 32)
        lse = c.q_scale.reshape(1, 1)
    snap = snapshot(*c.inputs())
    with pytest.raises(ValueError):
        c.run(out=out, max_logits=ml, lse=lse, **over)
    assert_unmodified(snap, c.inputs())


# --- general-op argument errors --------------------------------------------------------------

def test_general_argument_errors(rng):
    c = _small(rng)
    g = general()
    cf = _small(rng, FP8)
    with pytest.raises(ValueError):           # mixed dtypes
        g(c.q, cf.kv, c.indices, 0.1, D_V)
    with pytest.raises(ValueError):           # float32 q/kv
        g(c.q.astype(np.float32), c.kv.astype(np.float32), c.indices, 0.1, D_V)
    with pytest.raises(ValueError, match="d_v"):
        g(c.q, c.kv, c.indices, 0.1, D_QK + 1)
    with pytest.raises(ValueError, match="d_v"):
        g(c.q, c.kv, c.indices, 0.1, 0)
    with pytest.raises(ValueError, match=rf"d_v must be in \[1, d_qk={D_QK}\], got -1"):  # before allocating out
        g(c.q, c.kv, c.indices, 0.1, -1)
    with pytest.raises(ValueError, match="d_v"):   # default d_v 512 > d_qk 64
        g(c.q, c.kv, c.indices, 0.1)
    with pytest.raises(ValueError, match="indices"):
        g(c.q, c.kv, c.indices.astype(np.int64), 0.1, D_V)
    with pytest.raises(ValueError, match="indices"):
        g(c.q, c.kv, c.indices[:1], 0.1, D_V)
    with pytest.raises(ValueError):
        g(c.q, np.concatenate([c.kv, c.kv], axis=1), np.concatenate([c.indices] * 2, axis=1),
          0.1, D_V)
    with pytest.raises(ValueError, match="kv"):
        g(c.q, c.kv[..., :32], c.indices, 0.1, D_V)
    with pytest.raises(ValueError, match="attn_sink"):
        g(c.q, c.kv, c.indices, 0.1, D_V, attn_sink=np.zeros(H_Q + 1, np.float32))
    with pytest.raises(ValueError, match="attn_sink"):
        g(c.q, c.kv, c.indices, 0.1, D_V, attn_sink=np.zeros(H_Q, np.float64))
    with pytest.raises(ValueError, match="topk_length"):
        g(c.q, c.kv, c.indices, 0.1, D_V, topk_length=np.zeros(S_Q + 1, np.int32))
    with pytest.raises(ValueError, match="topk_length"):
        g(c.q, c.kv, c.indices, 0.1, D_V, topk_length=np.zeros(S_Q, np.int64))
    # still works afterwards
    c.check(c.run())


@pytest.mark.parametrize("sm_scale", [float("nan"), float("inf"), 1e39])
def test_sm_scale_must_be_finite_in_float32(rng, sm_scale):
    """1e39 is finite in double but inf in the kernel's float32."""
    c = _small(rng)
    with pytest.raises(ValueError, match="sm_scale must be finite, got"):
        general()(c.q, c.kv, c.indices, sm_scale, D_V)


@pytest.mark.parametrize("name", ["q_scale", "kv_scale"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_scales_must_be_finite(rng, name, value):
    c = _small(rng, FP8)
    with pytest.raises(ValueError, match=f"{name} must be finite, got"):
        c.run(**{name: np.array([value], np.float32)})
    with pytest.raises(ValueError, match="sm_scale \\* q_scale \\* kv_scale must be finite"):
        c.run(q_scale=np.array([1e30], np.float32), kv_scale=np.array([1e30], np.float32))


# --- the strict (SGLang) op ----------------------------------------------------------------

class StrictCase(Case):
    def __init__(self, rng, s_q=3, h_q=64, s_kv=300, d_qk=576, topk=128, sink=True):
        super().__init__(rng, s_q, h_q, s_kv, d_qk, 512, topk, FP8, tl=True, sink=sink)
        self.q_scale, self.kv_scale = f32([0.5]), f32([0.375])

    def strict_args(self):
        return dict(q=self.q, kv=self.kv, indices=self.indices, sm_scale=self.sm_scale,
                    q_scale=self.q_scale, kv_scale=self.kv_scale, d_v=512,
                    attn_sink=self.attn_sink, topk_length=self.topk_length)


def call_strict(a, **bufs):
    return strict()(a["q"], a["kv"], a["indices"], a["sm_scale"], a["q_scale"], a["kv_scale"],
                    a["d_v"], a["attn_sink"], a["topk_length"], **bufs)


@pytest.mark.parametrize("shape", [(3, 64, 576, 128), (2, 128, 512, 256), (1, 64, 576, 2048)])
def test_strict_vs_reference_and_general(rng, shape):
    s_q, h_q, d_qk, topk = shape
    c = StrictCase(rng, s_q, h_q, 3000 if topk == 2048 else 400, d_qk, topk)
    c.topk_length[-1] = topk
    a = c.strict_args()
    before = snapshot(*c.inputs())
    out, ml, lse = poisoned(s_q, h_q, 512)
    got = call_strict(a, out=out, max_logits=ml, lse=lse)
    assert got[0] is out and got[1] is ml and got[2] is lse
    c.check(got)
    assert_unmodified(before, c.inputs())
    for x, y, name in zip(got, c.run(), ("out", "max_logits", "lse")):
        assert_bits_equal(x, y, name + " (strict vs general)")
    # without sink and topk_length
    a.update(attn_sink=None, topk_length=None)
    c.check(call_strict(a), attn_sink=None, topk_length=None)
    # topk_length alone
    a.update(topk_length=c.topk_length)
    c.check(call_strict(a), attn_sink=None)


def test_strict_keywords(rng):
    c = StrictCase(rng, s_q=2)
    got = strict()(c.q, c.kv, c.indices, c.sm_scale, c.q_scale, c.kv_scale, d_v=512,
                   attn_sink=c.attn_sink, topk_length=c.topk_length)
    c.check(got)


def _mut_noncontig(key):
    def f(a, rng):
        a[key] = strided_like(a[key], rng, fill=0 if key == "indices" else np.nan)[0]
    return f


def _set(**kw):
    def f(a, rng):
        a.update({k: (v(a) if callable(v) else v) for k, v in kw.items()})
    return f


def _heads(h):
    def f(a, rng):
        q = a["q"]
        reps = -(-h // q.shape[1])
        a["q"] = np.ascontiguousarray(np.concatenate([q] * reps, axis=1)[:, :h])
        a["attn_sink"] = None
        a["topk_length"] = None
    return f


def _topk(t):
    def f(a, rng):
        s_q = a["indices"].shape[0]
        a["indices"] = R.make_indices(rng, s_q, a["kv"].shape[0], t) if t else \
            np.zeros((s_q, 1, 0), np.int32)
        a["topk_length"] = None
        a["attn_sink"] = None
    return f


def _d_qk(d):
    def f(a, rng):
        a["q"] = np.ascontiguousarray(a["q"][..., :d])
        a["kv"] = np.ascontiguousarray(a["kv"][..., :d])
    return f


def _h_kv2(a, rng):
    a["kv"] = np.ascontiguousarray(np.concatenate([a["kv"]] * 2, axis=1))
    a["indices"] = np.ascontiguousarray(np.concatenate([a["indices"]] * 2, axis=1))


def _tl_value(v):
    def f(a, rng):
        tl = a["topk_length"].copy()
        tl[0] = v
        a["topk_length"] = tl
    return f


STRICT_ERRORS = {
    # name: (mutation, substrings the message must contain, exact message or None)
    "q_bf16": (_set(q=lambda a: a["q"].astype(R.bf16_dtype())), ["q", "float8_e4m3fn"], None),
    "kv_bf16": (_set(kv=lambda a: a["kv"].astype(R.bf16_dtype())), ["kv", "float8_e4m3fn"], None),
    "q_noncontig": (_mut_noncontig("q"), ["q must be contiguous"], None),
    "kv_noncontig": (_mut_noncontig("kv"), ["kv must be contiguous"], None),
    "indices_noncontig": (_mut_noncontig("indices"), ["indices must be contiguous"], None),
    "kv_d_qk_mismatch": (_set(kv=lambda a: np.ascontiguousarray(a["kv"][..., :512])),
                         ["kv", "576", "512"], None),
    "h_q_43": (_heads(43), [], "sparse_mla_q8kv8_prefill_fwd requires h_q padded to a positive "
                               "multiple of 64, got 43"),
    "h_q_96": (_heads(96), [], "sparse_mla_q8kv8_prefill_fwd requires h_q padded to a positive "
                               "multiple of 64, got 96"),
    "h_q_1": (_heads(1), [], "sparse_mla_q8kv8_prefill_fwd requires h_q padded to a positive "
                             "multiple of 64, got 1"),
    "h_kv_2": (_h_kv2, ["requires h_kv=1, got 2"], None),
    "d_qk_64": (_d_qk(64), ["supports d_qk=512/576, got 64"], None),
    "d_qk_256": (_d_qk(256), ["supports d_qk=512/576, got 256"], None),
    "d_v_256": (_set(d_v=256), ["d_v", "512", "256"], None),
    "topk_100": (_topk(100), ["topk", "128", "100"], None),
    "topk_129": (_topk(129), ["topk", "128", "129"], None),
    "topk_0": (_topk(0), ["topk", "128"], None),
    "indices_int64": (_set(indices=lambda a: a["indices"].astype(np.int64)),
                      ["indices", "int32", "int64"], None),
    "indices_s_q": (_set(indices=lambda a: np.ascontiguousarray(a["indices"][:-1])),
                    ["indices"], None),
    "q_scale_f64": (_set(q_scale=np.array([0.5])), ["q_scale", "float32", "float64"], None),
    "kv_scale_f64": (_set(kv_scale=np.array([0.5])), ["kv_scale", "float32", "float64"], None),
    "q_scale_2elem": (_set(q_scale=f32([0.5, 0.5])), ["q_scale", "2"], None),
    "kv_scale_2elem": (_set(kv_scale=f32([0.5, 0.5])), ["kv_scale", "2"], None),
    "q_scale_none": (_set(q_scale=None), ["q_scale"], None),
    "kv_scale_none": (_set(kv_scale=None), ["kv_scale"], None),
    "q_scale_pyfloat": (_set(q_scale=0.5), ["q_scale"], None),
    "sink_without_topk_length": (_set(topk_length=None), ["attn_sink", "topk_length"], None),
    "sink_f64": (_set(attn_sink=lambda a: a["attn_sink"].astype(np.float64)),
                 ["attn_sink", "float32", "float64"], None),
    "sink_shape": (_set(attn_sink=lambda a: np.zeros(a["q"].shape[1] + 1, np.float32)),
                   ["attn_sink", "65"], None),
    "topk_length_i64": (_set(topk_length=lambda a: a["topk_length"].astype(np.int64)),
                        ["topk_length", "int32", "int64"], None),
    "topk_length_shape": (_set(topk_length=lambda a: np.zeros(a["q"].shape[0] + 1, np.int32)),
                          ["topk_length"], None),
    "topk_length_neg": (_tl_value(-1), ["topk_length", "-1"], None),
    "topk_length_gt_topk": (_tl_value(129), ["topk_length", "129"], None),
}


@pytest.mark.parametrize("name", list(STRICT_ERRORS))
def test_strict_errors(rng, name):
    mutate, parts, exact = STRICT_ERRORS[name]
    c = StrictCase(rng, s_q=2, s_kv=200)
    a = c.strict_args()
    mutate(a, rng)
    out, ml, lse = poisoned(*a["q"].shape[:2], 512)
    with pytest.raises(ValueError) as info:
        call_strict(a, out=out, max_logits=ml, lse=lse)
    msg = str(info.value)
    if exact is not None:
        assert msg == exact, f"message {msg!r} != {exact!r}"
    for p in parts:
        assert p in msg, f"{p!r} not in message {msg!r}"
    assert np.isnan(ml).all() and np.isnan(lse).all(), "a failed call wrote an output"
    # the unmodified case still works
    c.check(call_strict(c.strict_args()))


def test_strict_errors_torch(rng):
    c = StrictCase(rng, s_q=2, s_kv=200)
    a = {k: tt(v) if isinstance(v, np.ndarray) else v for k, v in c.strict_args().items()}
    b = dict(a, q=tt(c.q.astype(R.bf16_dtype())))
    with pytest.raises(ValueError, match="q"):
        call_strict(b)
    b = dict(a, q=a["q"].transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="q must be contiguous"):
        call_strict(b)
    b = dict(a, q=tt(np.ascontiguousarray(np.concatenate([c.q] * 2, axis=1)[:, :43])),
             attn_sink=None, topk_length=None)
    with pytest.raises(ValueError) as info:
        call_strict(b)
    assert str(info.value) == ("sparse_mla_q8kv8_prefill_fwd requires h_q padded to a positive "
                               "multiple of 64, got 43")
    b = dict(a, q_scale=torch.tensor([0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="q_scale"):
        call_strict(b)


def test_strict_caller_buffer_errors(rng):
    c = StrictCase(rng, s_q=2, s_kv=200)
    a = c.strict_args()
    out, ml, lse = poisoned(2, 64, 512)
    with pytest.raises(ValueError, match="out"):
        call_strict(a, out=out[:, :, :256], max_logits=ml, lse=lse)
    with pytest.raises(ValueError):
        call_strict(a, out=out, max_logits=lse, lse=lse)
    with pytest.raises(ValueError, match="lse"):
        call_strict(a, out=out, max_logits=ml, lse=lse.astype(np.float64))
    assert np.isnan(out.astype(np.float32)).all()


# --- 43 heads: general op vs padded strict op ------------------------------------------------

def test_43_heads_general_and_padded_strict(rng):
    s_q, h = 4, 43
    c = Case(rng, s_q, h, 500, 576, 512, 128, FP8, tl=True, sink=True)
    c.q_scale, c.kv_scale = f32([0.5]), f32([0.375])
    got = c.run()
    c.check(got)
    q64 = attnkit.pad_heads(c.q, 64)
    sink64 = attnkit.pad_heads(c.attn_sink, 64, dim=0)
    assert q64.shape == (s_q, 64, 576) and sink64.shape == (64,)
    res = strict()(q64, c.kv, c.indices, c.sm_scale, c.q_scale, c.kv_scale, 512, sink64,
                   c.topk_length)
    un = [attnkit.unpad_heads(x, h) for x in res]
    assert un[0].shape == (s_q, h, 512) and un[1].shape == (s_q, h)
    c.check(tuple(un))


# --- pad_heads / unpad_heads ---------------------------------------------------------------

@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_pad_unpad_round_trip(rng, kind):
    cv = tt if kind == "torch" else (lambda x: x)
    q, _ = R.make_qkv(rng, 3, 43, 1, 64, FP8)
    for x, mult, dim, h, padded in [(q, 64, 1, 43, 64), (q, 16, 1, 43, 48), (q, 43, 1, 43, 43),
                                    (q, 2, 0, 3, 4)]:
        xx = cv(x)
        p = attnkit.pad_heads(xx, mult, dim=dim)
        assert type(p) is type(xx) and p.dtype == xx.dtype
        shape = list(x.shape)
        shape[dim] = padded
        assert tuple(p.shape) == tuple(shape)
        pn = R.to_np(p)
        sl = [slice(None)] * 3
        sl[dim] = slice(0, h)
        assert np.array_equal(pn[tuple(sl)].view(np.uint8), x.view(np.uint8))
        sl[dim] = slice(h, None)
        assert np.all(pn[tuple(sl)].view(np.uint8) == 0), "padding must be zeros"
        u = attnkit.unpad_heads(p, h, dim=dim)
        assert type(u) is type(xx) and tuple(u.shape) == x.shape
        assert np.array_equal(R.to_np(u).view(np.uint8), x.view(np.uint8))
    # other dtypes and the default dim: sink [h] float32 with dim=0, bf16 out
    s = cv(R.make_sink(rng, 43))
    ps = attnkit.pad_heads(s, 64, dim=0)
    assert tuple(ps.shape) == (64,) and np.all(R.to_np(ps)[43:] == 0)
    assert np.array_equal(R.to_np(attnkit.unpad_heads(ps, 43, dim=0)), R.to_np(s))
    o = cv(np.ones((2, 43, 8), R.bf16_dtype()))
    po = attnkit.pad_heads(o, 64)
    assert tuple(po.shape) == (2, 64, 8)
    assert tuple(attnkit.unpad_heads(po, 43).shape) == (2, 43, 8)


# --- torch ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [FP8, BF16])
def test_torch_general(rng, dtype):
    c = Case(rng, 3, 43, 300, 576, 512, 128, dtype, tl=True, sink=True)
    base = c.run()
    args = [tt(x) for x in (c.q, c.kv, c.indices)]
    kw = {k: tt(v) for k, v in c.kwargs().items()}
    before = snapshot(*c.inputs())        # the tensors share memory with these arrays
    got = general()(*args, c.sm_scale, 512, **kw)
    assert all(isinstance(x, torch.Tensor) for x in got)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    assert got[2].dtype == torch.float32
    for a, b, name in zip(got, base, ("out", "max_logits", "lse")):
        assert_bits_equal(a, b, name + " (torch vs numpy)")
    assert_unmodified(before, c.inputs())
    out, ml, lse = poisoned(3, 43, 512, "torch")
    got2 = general()(*args, c.sm_scale, 512, **kw, out=out, max_logits=ml, lse=lse)
    assert got2[0] is out and got2[1] is ml and got2[2] is lse
    c.check(got2)


def test_torch_strict(rng):
    c = StrictCase(rng, s_q=3, s_kv=300)
    a = {k: tt(v) if isinstance(v, np.ndarray) else v for k, v in c.strict_args().items()}
    got = call_strict(a)
    assert all(isinstance(x, torch.Tensor) for x in got)
    c.check(got)
    out, ml, lse = poisoned(3, 64, 512, "torch")
    got2 = call_strict(a, out=out, max_logits=ml, lse=lse)
    assert got2[0] is out and got2[1] is ml and got2[2] is lse
    for x, y, name in zip(got, got2, ("out", "max_logits", "lse")):
        assert_bits_equal(x, y, name)


@pytest.mark.parametrize("op", ["sparse_mla_prefill_fwd", "sparse_mla_q8kv8_prefill_fwd"])
def test_torch_library_registration(op):
    """Both ops are torch.library ops whose out / max_logits / lse are mutated arguments."""
    packet = getattr(torch_ops(), op)
    schemas = [getattr(packet, o)._schema for o in packet.overloads()]
    mutated = {a.name for s in schemas for a in s.arguments
               if a.alias_info is not None and a.alias_info.is_write}
    assert {"out", "max_logits", "lse"} <= mutated, (op, [str(s) for s in schemas])


@pytest.mark.parametrize("strict_op", [False, True])
def test_torch_ops_direct(rng, strict_op):
    """torch.ops.attnkit.* called directly: fills the caller's buffers, like the Python op."""
    c = StrictCase(rng, s_q=2, s_kv=300)
    op = (torch_ops().sparse_mla_q8kv8_prefill_fwd if strict_op
          else torch_ops().sparse_mla_prefill_fwd)
    out, ml, lse = poisoned(2, 64, 512, "torch")
    res = op(tt(c.q), tt(c.kv), tt(c.indices), c.sm_scale, 512, tt(c.q_scale), tt(c.kv_scale),
             tt(c.attn_sink), tt(c.topk_length), out, ml, lse)
    assert res is None
    c.check((out, ml, lse))
    for x, y, name in zip((out, ml, lse), c.run(), ("out", "max_logits", "lse")):
        assert_bits_equal(x, y, name)


@pytest.mark.parametrize("strict_op", [False, True])
def test_torch_opcheck(rng, strict_op):
    """torch.library.opcheck. Its test_schema step multiplies the inputs, which torch cannot do
    for float8_e4m3fn on CPU ("mul_cpu_reduced_float" not implemented), so the fp8-only strict
    op skips that step; the general op runs every step with bf16 inputs."""
    c = StrictCase(rng, s_q=2, s_kv=300)
    out, ml, lse = poisoned(2, 64, 512, "torch")
    if strict_op:
        op, utils = torch_ops().sparse_mla_q8kv8_prefill_fwd, ("test_autograd_registration",
                                                                "test_faketensor")
        q, kv = tt(c.q), tt(c.kv)
    else:
        op, utils = torch_ops().sparse_mla_prefill_fwd, ("test_schema", "test_autograd_registration",
                                                         "test_faketensor", "test_aot_dispatch_static",
                                                         "test_aot_dispatch_dynamic")
        q, kv = tt(c.q.astype(R.bf16_dtype())), tt(c.kv.astype(R.bf16_dtype()))
    args = (q, kv, tt(c.indices), c.sm_scale, 512, tt(c.q_scale), tt(c.kv_scale),
            tt(c.attn_sink), tt(c.topk_length), out, ml, lse)
    torch.library.opcheck(op.default, args, test_utils=utils)


# --- Python-side parsing: dtype messages, scale forms ----------------------------------------

@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_default_dtypes_name_what_the_op_takes(rng, kind):
    """numpy's and torch's default int (int64) and float (float64) get this op's dtypes."""
    c = _small(rng)
    conv = (lambda x: x) if kind == "numpy" else (
        lambda x: torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16) if x.dtype == ml_dtypes.bfloat16
        else torch.from_numpy(x))
    q, kv, idx = conv(c.q), conv(c.kv), conv(c.indices)
    with pytest.raises(ValueError, match=r"^indices must be int32, got (torch\.)?int64$"):
        general()(q, kv, idx.astype(np.int64) if kind == "numpy" else idx.long(), 0.1, D_V)
    q64 = c.q.astype(np.float64)
    with pytest.raises(ValueError, match=r"^q must be bfloat16 or float8_e4m3fn, got (torch\.)?float64$"):
        general()(q64 if kind == "numpy" else torch.from_numpy(q64), kv, idx, 0.1, D_V)


@pytest.mark.parametrize("make", [np.float32, np.float64, np.array, torch.tensor])
def test_sm_scale_numpy_and_tensor_scalars(rng, make):
    c = _small(rng)
    got = general()(c.q, c.kv, c.indices, make(0.125), D_V)
    want = general()(c.q, c.kv, c.indices, 0.125, D_V)
    for a, b in zip(got, want):
        assert_bits_equal(a, b)


@pytest.mark.parametrize("value", [10**400, "0.1", True, np.zeros(2)])
def test_sm_scale_refused_as_value_error(rng, value):
    c = _small(rng)
    with pytest.raises(ValueError, match="^sm_scale must be a float"):
        general()(c.q, c.kv, c.indices, value, D_V)


def test_mixed_kinds_say_tensor(rng):
    c = _small(rng)
    q = torch.from_numpy(c.q.view(np.uint16)).view(torch.bfloat16)
    with pytest.raises(ValueError, match="^kv must be a torch tensor like q, got ndarray$"):
        general()(q, c.kv, c.indices, 0.1, D_V)

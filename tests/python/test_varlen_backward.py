"""attnkit.varlen_attention_backward and the torch autograd of attnkit::varlen_attention,
against a float64 reference: torch autograd in float64, per sequence, through
test_attention_backward's explicit attention with the score modifiers (bottom-right
aligned, as varlen aligns every sequence), on the same rounded inputs; dsinks summed over
the sequences. Tolerances: test_attention_backward's GRAD_TOL (atol relative to the
largest |ref| of the three gradients, plus rtol).

Every gradient buffer is NaN-poisoned (and strided) before the call and checked fully
written; empty sequences (no queries, no keys, neither) must give exact zeros.
"""

import numpy as np
import pytest

import attnkit
from conftest import DTYPES, assert_bits_equal, assert_unmodified, poison, randn, snapshot, strided_like
from test_attention_backward import check_mod_grads, grad_ref_mods, random_mods

torch = pytest.importorskip("torch")


def ragged(rng, batch, max_q, max_k, empty=True):
    """cu_seqlens_q, cu_seqlens_k (int32) of `batch` random lengths, some zero when `empty`."""
    lo = 0 if empty else 1
    nq = rng.integers(lo, max_q + 1, batch)
    nk = rng.integers(lo, max_k + 1, batch)
    return (np.concatenate([[0], np.cumsum(nq)]).astype(np.int32),
            np.concatenate([[0], np.cumsum(nk)]).astype(np.int32))


def varlen_grad_ref(q, k, v, dout, cu_q, cu_k, causal, scale=None, dlse=None, window=None, softcap=None,
                    alibi_slopes=None, sinks=None):
    """(dq, dk, dv[, dsinks]) float64: each sequence's dense reference (B = 1, bottom-right)."""
    dq, dk, dv = (np.zeros(x.shape) for x in (q, k, v))
    dsinks = None if sinks is None else np.zeros(np.shape(sinks))
    for b in range(len(cu_q) - 1):
        a0, a1, b0, b1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if a1 == a0 or b1 == b0:
            continue  # no query reads its keys, or no key: zero gradients
        bhsd = lambda x: np.ascontiguousarray(x.transpose(1, 0, 2)[None])  # noqa: E731
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.ndim == 1 else alibi_slopes[b]
        got = grad_ref_mods(bhsd(q[a0:a1]), bhsd(k[b0:b1]), bhsd(v[b0:b1]), bhsd(dout[a0:a1]),
                            causal="bottom_right" if causal else False, scale=scale,
                            enable_gqa=True, window=window, softcap=softcap, alibi_slopes=slopes, sinks=sinks,
                            dlse=None if dlse is None else np.ascontiguousarray(dlse[a0:a1].T[None]))
        dq[a0:a1] = got[0][0].transpose(1, 0, 2)
        dk[b0:b1] = got[1][0].transpose(1, 0, 2)
        dv[b0:b1] = got[2][0].transpose(1, 0, 2)
        if sinks is not None:
            dsinks += got[3]
    return [dq, dk, dv] + ([] if sinks is None else [dsinks])


def poisoned(rng, *arrays):
    """NaN-filled strided buffers shaped like `arrays`."""
    return [strided_like(poison(x.shape, x.dtype), rng)[0] for x in arrays]


def all_written(*arrays):
    for x in arrays:
        assert not np.isnan(np.asarray(x, dtype=np.float64)).any(), "an element was left unwritten"


# ---------------------------------------------------------------------------------------
# Random ragged batches: lengths 0..n (queries longer or shorter than keys), GQA/MQA, odd
# head dims, causal or not, scale, the four modifiers, dlse, strided inputs and outputs.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_ragged(dtype, seed):
    rng = np.random.default_rng(4200 + seed)
    batch = int(rng.integers(1, 6))
    Hkv = int(rng.choice([1, 2]))
    Hq = Hkv * int(rng.choice([1, 2, 3]))
    cu_q, cu_k = ragged(rng, batch, int(rng.choice([1, 9, 70])), int(rng.choice([6, 40, 210])))
    D, Dv = int(rng.choice([8, 33, 64])), int(rng.choice([16, 17, 64]))
    causal = bool(seed % 2)
    scale = [None, 0.3][seed % 3 == 2]
    mods = random_mods(rng, Hq, batch)
    q = randn(rng, (cu_q[-1], Hq, D), dtype)
    k, v = randn(rng, (cu_k[-1], Hkv, D), dtype), randn(rng, (cu_k[-1], Hkv, Dv), dtype)
    if seed % 4 == 3:
        q, k, v = (strided_like(x, rng)[0] for x in (q, k, v))
    kw = dict(causal=causal, scale=scale, **mods)
    out, lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    dout = randn(rng, out.shape, dtype)
    dlse = randn(rng, lse.shape) if seed % 3 else None
    before = snapshot(q, k, v, out, lse, dout, dlse)
    dq, dk, dv = poisoned(rng, q, k, v)
    got = attnkit.varlen_attention_backward(q, k, v, out, lse, dout, cu_q, cu_k, dlse=dlse, dq=dq, dk=dk, dv=dv, **kw)
    assert got[0] is dq and got[1] is dk and got[2] is dv and len(got) == (4 if "sinks" in mods else 3)
    assert_unmodified(before, (q, k, v, out, lse, dout, dlse))
    all_written(*got)
    ref = varlen_grad_ref(q, k, v, dout, cu_q, cu_k, dlse=dlse, **kw)
    check_mod_grads(got, ref, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_sequences_several_key_blocks(rng, dtype):
    """Sequences longer than the backward's key blocks (192) and row blocks, next to short ones."""
    cu_q = np.array([0, 300, 301, 301, 750], np.int32)
    cu_k = np.array([0, 420, 425, 431, 900], np.int32)
    q = randn(rng, (750, 4, 64), dtype)
    k, v = randn(rng, (900, 2, 64), dtype), randn(rng, (900, 2, 64), dtype)
    out, lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    dout = randn(rng, out.shape, dtype)
    got = attnkit.varlen_attention_backward(q, k, v, out, lse, dout, cu_q, cu_k, causal=True,
                                            dq=poison(q.shape, q.dtype), dk=poison(k.shape, k.dtype),
                                            dv=poison(v.shape, v.dtype))
    all_written(*got)
    check_mod_grads(got, varlen_grad_ref(q, k, v, dout, cu_q, cu_k, True), dtype)


def test_matches_dense_backward_per_sequence(rng):
    """Each sequence's gradients are attention_backward's on its own rows, bit for bit."""
    cu_q, cu_k = np.array([0, 5, 17, 18], np.int32), np.array([0, 9, 20, 44], np.int32)
    q, k, v = randn(rng, (18, 6, 40)), randn(rng, (44, 3, 40)), randn(rng, (44, 3, 24))
    sinks = randn(rng, (6,))
    kw = dict(window=(7, -1), softcap=4.0, sinks=sinks)
    out, lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True, **kw)
    dout = randn(rng, out.shape)
    dq, dk, dv, dsinks = attnkit.varlen_attention_backward(q, k, v, out, lse, dout, cu_q, cu_k, causal=True, **kw)
    total = np.zeros(6, np.float64)
    for b in range(3):
        a0, a1, b0, b1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        bhsd = lambda x: np.ascontiguousarray(x.transpose(1, 0, 2)[None])  # noqa: E731
        g = attnkit.attention_backward(bhsd(q[a0:a1]), bhsd(k[b0:b1]), bhsd(v[b0:b1]), bhsd(out[a0:a1]),
                                       np.ascontiguousarray(lse[a0:a1].T[None]), bhsd(dout[a0:a1]),
                                       causal="bottom_right", enable_gqa=True, **kw)
        for x, y, name in zip(g[:3], (dq[a0:a1], dk[b0:b1], dv[b0:b1]), ("dq", "dk", "dv")):
            assert_bits_equal(np.ascontiguousarray(x[0].transpose(1, 0, 2)), np.ascontiguousarray(y), name)
        total += g[3]
    np.testing.assert_allclose(dsinks, total, rtol=1e-6, atol=1e-7)


def test_empty(rng):
    """No sequences; sequences without queries (their keys: zero dk, dv), without keys (their
    queries: zero dq), and without either; no queries at all; no keys at all."""
    def run(cu_q, cu_k, Hq=2, Hkv=1, sinks=False):
        cu_q, cu_k = np.array(cu_q, np.int32), np.array(cu_k, np.int32)
        q, k, v = randn(rng, (cu_q[-1], Hq, 8)), randn(rng, (cu_k[-1], Hkv, 8)), randn(rng, (cu_k[-1], Hkv, 8))
        s = randn(rng, (Hq,)) if sinks else None
        out, lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True, sinks=s)
        dout = randn(rng, out.shape)
        grads = poisoned(rng, q, k, v)
        dsinks = poison((Hq,), np.float32) if sinks else None
        got = attnkit.varlen_attention_backward(q, k, v, out, lse, dout, cu_q, cu_k, causal=True, sinks=s,
                                                dq=grads[0], dk=grads[1], dv=grads[2], dsinks=dsinks)
        all_written(*got)
        return q, k, v, dout, cu_q, cu_k, s, got

    for cu_q, cu_k in (([0], [0]), ([0, 0, 0], [0, 0, 0]), ([0, 0, 3], [0, 4, 4]), ([0, 0], [0, 5]),
                       ([0, 4], [0, 0]), ([0, 2, 2, 5], [0, 3, 6, 6])):
        q, k, v, dout, cq, ck, s, got = run(cu_q, cu_k, sinks=True)
        for b in range(len(cq) - 1):
            if cq[b + 1] == cq[b]:
                assert not np.asarray(got[1][ck[b]:ck[b + 1]]).any() and not np.asarray(got[2][ck[b]:ck[b + 1]]).any()
            if ck[b + 1] == ck[b]:
                assert not np.asarray(got[0][cq[b]:cq[b + 1]]).any()
        check_mod_grads(got, varlen_grad_ref(q, k, v, dout, cq, ck, True, sinks=s), "float32")


# Long sequences share each one's passes between the threads; many short ones (a few query
# rows and keys) run whole, one per thread, side by side; the second batch mixes both.
@pytest.mark.parametrize("lengths", [([130, 1, 269], [500, 20, 380]),
                                     ([5, 0, 17, 3, 600, 9, 1, 12, 0, 30], [5, 4, 17, 8, 620, 9, 2, 40, 0, 30])])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bitwise_across_threads(rng, restore_runtime, dtype, lengths):
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in lengths)
    q, k, v = (randn(rng, (int(cu[-1]), h, 64), dtype) for cu, h in ((cu_q, 4), (cu_k, 1), (cu_k, 1)))
    sinks = randn(rng, (4,))
    out, lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True, sinks=sinks)
    dout = randn(rng, out.shape, dtype)
    results = []
    for n in (1, 2, 3, 1):
        attnkit.set_num_threads(n)
        results.append(attnkit.varlen_attention_backward(q, k, v, out, lse, dout, cu_q, cu_k, causal=True,
                                                         sinks=sinks))
    for other in results[1:]:
        for a, b, name in zip(results[0], other, ("dq", "dk", "dv", "dsinks")):
            assert_bits_equal(a, b, name)


def test_every_isa(isa, rng):
    cu_q, cu_k = np.array([0, 3, 40, 41], np.int32), np.array([0, 30, 41, 90], np.int32)
    q, k, v = randn(rng, (41, 4, 48), "bfloat16"), randn(rng, (90, 2, 48), "bfloat16"), randn(rng, (90, 2, 32), "bfloat16")
    kw = dict(causal=True, window=(20, 3), alibi_slopes=(rng.random(4) * 0.2).astype(np.float32))
    out, lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    dout = randn(rng, out.shape, "bfloat16")
    got = attnkit.varlen_attention_backward(q, k, v, out, lse, dout, cu_q, cu_k, **kw)
    check_mod_grads(got, varlen_grad_ref(q, k, v, dout, cu_q, cu_k, **kw), "bfloat16")


# ---------------------------------------------------------------------------------------
# Torch autograd: loss.backward() through attnkit.varlen_attention, sinks' gradient, lse in
# the loss; opcheck; torch.compile of a training step.
# ---------------------------------------------------------------------------------------

def _torch_inputs(rng, dtype=torch.float32, sinks=True):
    cu_q, cu_k = torch.tensor([0, 7, 7, 30], dtype=torch.int32), torch.tensor([0, 12, 19, 41], dtype=torch.int32)
    leaf = lambda shape: torch.from_numpy(rng.standard_normal(shape)).to(dtype).requires_grad_()  # noqa: E731
    q, k, v = leaf((30, 4, 32)), leaf((41, 2, 32)), leaf((41, 2, 16))
    s = torch.from_numpy(rng.standard_normal(4)).float().requires_grad_() if sinks else None
    return q, k, v, cu_q, cu_k, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd(rng, dtype):
    q, k, v, cu_q, cu_k, sinks = _torch_inputs(rng, dtype)
    kw = dict(causal=True, softcap=5.0, sinks=sinks)
    out, lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    dout = torch.from_numpy(rng.standard_normal(out.shape)).to(dtype)
    dlse = torch.from_numpy(rng.standard_normal(lse.shape)).float()
    ((out.float() * dout.float()).sum() + (torch.where(lse.isfinite(), lse, 0) * dlse).sum()).backward()
    # the same gradients as the numpy-style call on the same tensors
    want = attnkit.varlen_attention_backward(q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dout,
                                             cu_q, cu_k, dlse=dlse, causal=True, softcap=5.0,
                                             sinks=sinks.detach())
    for x, w, name in zip((q, k, v, sinks), want, ("dq", "dk", "dv", "dsinks")):
        assert_bits_equal(x.grad, w, name)
    name = "float32" if dtype == torch.float32 else "bfloat16"
    as_np = lambda t: t.detach().float().numpy()  # noqa: E731
    ref = varlen_grad_ref(as_np(q), as_np(k), as_np(v), as_np(dout), cu_q.numpy(), cu_k.numpy(), True,
                          dlse=dlse.numpy(), softcap=5.0, sinks=as_np(sinks))
    check_mod_grads([as_np(x.grad) for x in (q, k, v, sinks)], ref, name)


def test_opcheck(rng):
    q, k, v, cu_q, cu_k, sinks = _torch_inputs(rng)
    torch.library.opcheck(torch.ops.attnkit.varlen_attention.default,
                          (q, k, v, cu_q, cu_k, None, None, True, None), dict(window_left=5, sinks=sinks))
    out, lse = torch.ops.attnkit.varlen_attention(q, k, v, cu_q, cu_k, None, None, True, None)
    torch.library.opcheck(torch.ops.attnkit.varlen_attention_backward.default,
                          (q.detach(), k.detach(), v.detach(), cu_q, cu_k, None, None, True, None, out.detach(),
                           lse.detach(), torch.randn(out.shape), None))


def test_torch_compile_training_step(rng):
    q, k, v, cu_q, cu_k, sinks = _torch_inputs(rng)

    def step(q, k, v, sinks):
        out = attnkit.varlen_attention(q, k, v, cu_q, cu_k, causal=True, sinks=sinks)
        return out.square().sum()

    compiled = torch.compile(step, fullgraph=True)
    compiled(q, k, v, sinks).backward()
    got = [x.grad.clone() for x in (q, k, v, sinks)]
    for x in (q, k, v, sinks):
        x.grad = None
    step(q, k, v, sinks).backward()
    for a, x, name in zip(got, (q, k, v, sinks), ("dq", "dk", "dv", "dsinks")):
        assert_bits_equal(a, x.grad, name)


def test_out_form_and_alibi_gradient_refused(rng):
    q, k, v, cu_q, cu_k, _ = _torch_inputs(rng, sinks=False)
    with pytest.raises(ValueError, match=r"attnkit.varlen_attention with out= has no backward yet, and q requires grad"):
        attnkit.varlen_attention(q, k, v, cu_q, cu_k, out=torch.empty(30, 4, 16))
    slopes = torch.rand(4).requires_grad_()
    with pytest.raises(ValueError, match=r"computes no gradient for alibi_slopes"):
        attnkit.varlen_attention(q, k, v, cu_q, cu_k, alibi_slopes=slopes)


# ---------------------------------------------------------------------------------------
# Errors: every check of varlen_attention_backward (src/ops/serving.cpp), and the
# forward's through it.
# ---------------------------------------------------------------------------------------

def _err_inputs(rng):
    cu_q, cu_k = np.array([0, 2, 6], np.int32), np.array([0, 5, 9], np.int32)
    q, k, v = randn(rng, (6, 2, 8)), randn(rng, (9, 1, 8)), randn(rng, (9, 1, 4))
    out, lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True)
    return q, k, v, out, lse, randn(rng, out.shape), cu_q, cu_k


@pytest.mark.parametrize("case,match", [
    ("dout_shape", r"dout must have out's shape \[6, 2, 4\], got \[6, 2, 5\]"),
    ("dout_rank", r"dout must be a 3-d tensor with out's shape \[6, 2, 4\], got 4-d"),
    ("dout_dtype", r"dout must have out's dtype float32, got float16"),
    ("dq_shape", r"dq must have q's shape \[6, 2, 8\], got \[6, 2, 9\]"),
    ("dk_dtype", r"dk must have k's dtype float32, got bfloat16"),
    ("dv_shape", r"dv must have v's shape \[9, 1, 4\], got \[8, 1, 4\]"),
    ("dq_aliases_q", r"dq must not alias q \(their memory overlaps\)"),
    ("dk_aliases_dv", r"dk must not alias dv"),
    ("dv_aliases_dout", r"dv must not alias dout"),
    ("dlse_shape", r"dlse must have lse's shape \[6, 2\] \(\[total_q, Hq\]\), got \[6, 3\]"),
    ("dlse_dtype", r"dlse must be float32, got float16"),
    ("dsinks_missing", r"dsinks must be given with sinks \(float32 \[2\]\), got None"),
    ("dsinks_without_sinks", r"dsinks must be None without sinks, got a tensor"),
    ("dsinks_shape", r"dsinks must be float32 of shape \[2\] \(sinks' shape\), got float32 of shape \[3\]"),
    ("lse_shape", r"lse must have shape \[6, 2\] \(\[total_q, Hq\]\), got \[6, 3\]"),
    ("cu_seqlens", r"cu_seqlens_k\[B\] must equal total_k=9, got 8"),
    ("heads", r"GQA/MQA requires query heads to be a multiple of KV heads, got q_heads=2 and kv_heads=3"),
])
def test_errors(rng, case, match):
    q, k, v, out, lse, dout, cu_q, cu_k = _err_inputs(rng)
    a = dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
             dq=np.empty_like(q), dk=np.empty_like(k), dv=np.empty_like(v))
    if case == "dout_shape":
        a["dout"] = randn(rng, (6, 2, 5))
    elif case == "dout_rank":
        a["dout"] = randn(rng, (1, 6, 2, 4))
    elif case == "dout_dtype":
        a["dout"] = dout.astype(np.float16)
    elif case == "dq_shape":
        a["dq"] = np.empty((6, 2, 9), np.float32)
    elif case == "dk_dtype":
        a["dk"] = poison(k.shape, "bfloat16")
    elif case == "dv_shape":
        a["dv"] = np.empty((8, 1, 4), np.float32)
    elif case == "dq_aliases_q":
        a["dq"] = q
    elif case == "dk_aliases_dv":
        buf = np.empty((9, 1, 8), np.float32)
        a["dk"], a["dv"] = buf, buf[:, :, :4]
    elif case == "dv_aliases_dout":
        buf = np.empty((9, 2, 4), np.float32)
        a["dv"], a["dout"] = buf[:, :1], buf[:6]
    elif case == "dlse_shape":
        a["dlse"] = np.zeros((6, 3), np.float32)
    elif case == "dlse_dtype":
        a["dlse"] = np.zeros((6, 2), np.float16)
    elif case == "dsinks_missing":
        a["sinks"] = np.zeros(2, np.float32)
        a["dsinks"] = None
    elif case == "dsinks_without_sinks":
        a["dsinks"] = np.zeros(2, np.float32)
    elif case == "dsinks_shape":
        a["sinks"], a["dsinks"] = np.zeros(2, np.float32), np.zeros(3, np.float32)
    elif case == "lse_shape":
        a["lse"] = np.zeros((6, 3), np.float32)
    elif case == "cu_seqlens":
        a["cu_seqlens_k"] = np.array([0, 5, 8], np.int32)
    elif case == "heads":
        a["k"], a["v"] = randn(rng, (9, 3, 8)), randn(rng, (9, 3, 4))
        a["dk"], a["dv"] = np.empty((9, 3, 8), np.float32), np.empty((9, 3, 4), np.float32)
    positional = [a.pop(n) for n in ("q", "k", "v", "out", "lse", "dout", "cu_seqlens_q", "cu_seqlens_k")]
    if case == "dsinks_missing":  # the Python layer allocates dsinks itself: the C++ check, under it
        from attnkit.serving import run_varlen_backward
        with pytest.raises(ValueError, match=match):
            q, k, v, out, lse, dout, cu_q, cu_k = positional
            run_varlen_backward(q, k, v, cu_q, cu_k, out, lse, dout, a["dq"], a["dk"], a["dv"], None, None, None, False, None,
                                ((-1, -1), None, None, a["sinks"]), None)
        return
    with pytest.raises(ValueError, match=match):
        attnkit.varlen_attention_backward(*positional, **a)


def test_python_argument_errors(rng):
    q, k, v, out, lse, dout, cu_q, cu_k = _err_inputs(rng)
    with pytest.raises(ValueError, match=r"dout must be a numpy array like q, got Tensor"):
        attnkit.varlen_attention_backward(q, k, v, out, lse, torch.from_numpy(dout), cu_q, cu_k)
    with pytest.raises(ValueError, match=r"max_seqlen_q must be an int or None, got float"):
        attnkit.varlen_attention_backward(q, k, v, out, lse, dout, cu_q, cu_k, max_seqlen_q=2.0)
    with pytest.raises(ValueError, match=r"max_seqlen_k must be at least the longest key sequence \(5\), got 4"):
        attnkit.varlen_attention_backward(q, k, v, out, lse, dout, cu_q, cu_k, max_seqlen_k=4)

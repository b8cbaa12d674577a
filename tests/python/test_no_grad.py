"""The ops without a backward (all but the functional attention and varlen attention, whose
backward test_attention_backward.py and test_varlen_backward.py check), through every torch
entry point, refuse an input that requires grad while grad mode is on (a ValueError naming
the op and the input), instead of returning a result whose backward leaves q.grad None.
With grad mode off (torch.no_grad, torch.inference_mode, set_grad_enabled(False)) or
detached inputs, the ops compute as usual."""

import pytest

import attnkit
from conftest import assert_bits_equal, make_qkv, to_torch
from reference import assert_close, attention_ref, tolerance

torch = pytest.importorskip("torch")


def qkv(rng, B=1, Hq=2, Hkv=2, Sq=5, Skv=6, D=8, Dv=8, dtype="float32"):
    return tuple(to_torch(x) for x in make_qkv(rng, B, Hq, Hkv, Sq, Skv, D, Dv, dtype))


def sparse_args(rng):
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    kv = torch.randn(9, 1, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    indices = torch.randint(-1, 9, (3, 1, 8), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    return q, kv, indices


def calls(rng):
    """(name of the op in the message, the call, the tensors it takes by name)."""
    q, k, v = qkv(rng)
    mask = torch.zeros(5, 6)
    out = torch.empty(1, 2, 5, 8)
    lse = torch.empty(1, 2, 5)
    sq, skv, idx = sparse_args(rng)
    sout, smax, slse = torch.empty(3, 4, 16, dtype=torch.bfloat16), torch.empty(3, 4), torch.empty(3, 4)
    op = torch.ops.attnkit
    return [
        ("attnkit.attention", lambda t: attnkit.attention(t["q"], t["k"], t["v"], attn_mask=t["attn_mask"]),
         dict(q=q, k=k, v=v, attn_mask=mask)),
        ("attnkit.attention", lambda t: attnkit.attention(t["q"], t["k"], t["v"], out=t["out"]),
         dict(q=q, k=k, v=v, out=out)),
        ("torch.ops.attnkit.attention",
         lambda t: op.attention(t["q"], t["k"], t["v"], t["attn_mask"], 0, None, 0.0, None, False, "BHSD"),
         dict(q=q, k=k, v=v, attn_mask=mask)),
        ("torch.ops.attnkit.attention_out",
         lambda t: op.attention_out(t["q"], t["k"], t["v"], None, 0, None, 0.0, None, False, "BHSD",
                                    t["out"], t["lse"]),
         dict(q=q, k=k, v=v, out=out, lse=lse)),
        ("torch.ops.attnkit.sage_attention",
         lambda t: attnkit.sage_attention(t["q"], t["k"], t["v"]), dict(q=q, k=k, v=v)),
        ("torch.ops.attnkit.sparse_mla_prefill_fwd",
         lambda t: attnkit.sparse_mla_prefill_fwd(t["q"], t["kv"], idx, 0.25, d_v=16, out=sout,
                                                  max_logits=smax, lse=slse),
         dict(q=sq, kv=skv)),
    ]


# Cases 0 and 2 (the functional attention) have a backward for q, k and v
# (test_attention_backward.py); the others, and the mask, refuse inputs that require grad.
REFUSED = [1, 3, 4, 5]


@pytest.mark.parametrize("case", REFUSED)
def test_requires_grad_is_refused(rng, case):
    name, call, tensors = calls(rng)[case]
    for which in tensors:
        if not tensors[which].dtype.is_floating_point:
            continue
        t = dict(tensors)
        t[which] = tensors[which].clone().requires_grad_(True)
        with pytest.raises(ValueError, match=f"^{name}( with out=)? has no backward yet, and {which} requires grad"):
            call(t)


@pytest.mark.parametrize("case", range(6))
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad_disabled", "detach"])
def test_grad_mode_off_computes(rng, case, mode):
    name, call, tensors = calls(rng)[case]
    want = call(tensors)
    t = {n: (x.clone().requires_grad_(True) if x.dtype.is_floating_point and n not in ("out", "lse") else x)
         for n, x in tensors.items()}
    if mode == "detach":
        got = call({n: x.detach() for n, x in t.items()})
    else:
        ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
               "grad_disabled": lambda: torch.set_grad_enabled(False)}[mode]
        with ctx():
            got = call(t)
    if got is not None:
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert_bits_equal(a.detach(), b)


def test_no_grad_matches_reference(rng):
    q, k, v = qkv(rng)
    for x in (q, k, v):
        x.requires_grad_(True)
    with torch.no_grad():
        out = attnkit.attention(q, k, v)
    assert not out.requires_grad
    assert_close(out, attention_ref(q.detach(), k.detach(), v.detach())[0], *tolerance("float32"))


@pytest.mark.parametrize("case", [0, 2])
def test_mask_gets_no_gradient(rng, case):
    _, call, tensors = calls(rng)[case]
    t = dict(tensors, attn_mask=tensors["attn_mask"].clone().requires_grad_(True))
    with pytest.raises(ValueError, match="(computes no gradient for|and) attn_mask"):
        call(t)


def test_compiled_call_refuses_grad(rng):
    """torch.compile goes through the registered ops, whose Autograd kernels refuse too."""
    q, k, v = qkv(rng)
    f = torch.compile(lambda q, k, v: attnkit.sage_attention(q, k, v), fullgraph=True, backend="eager")
    q.requires_grad_(True)
    with pytest.raises(Exception, match="has no backward yet, and q requires grad"):
        f(q, k, v)


def serving_and_dsa_calls():
    """(op name in the message, the input that requires grad, the call) of the serving, merge
    and DSA ops, each on small valid inputs."""
    from attnkit import dsa

    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, 16, generator=g)
    kc, vc = torch.randn(4, 8, 2, 16, generator=g), torch.randn(4, 8, 2, 16, generator=g)
    table, lens = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32), torch.tensor([10, 5], dtype=torch.int32)
    cu_q = torch.tensor([0, 1, 3], dtype=torch.int32)
    k = torch.randn(3, 2, 16, generator=g)
    lse = torch.randn(3, 4, generator=g)
    logits = torch.randn(2, 50, generator=g)
    qm = torch.randn(1, 1, 16, 64, generator=g).to(torch.bfloat16)
    kv = torch.randn(2, 8, 1, 64, generator=g).to(torch.bfloat16)
    sq = torch.randn(2, 64, 512, generator=g).to(torch.float8_e4m3fn)
    skv = torch.randn(300, 1, 512, generator=g).to(torch.float8_e4m3fn)
    idx = torch.randint(-1, 300, (2, 1, 128), dtype=torch.int32, generator=g)
    one = torch.ones(1)
    return [
        ("paged_attention", "q", lambda x: attnkit.paged_attention(x, kc, vc, table, lens, cu_q), q),
        ("append_kv_cache", "k", lambda x: attnkit.append_kv_cache(x, k, kc.clone(), vc.clone(),
                                                                   torch.tensor([0, 1, 2], dtype=torch.int32)), k),
        ("merge_attention_states", "out_a", lambda x: attnkit.merge_attention_states(x, lse, q, lse), q),
        ("topk_transform", "logits", lambda x: dsa.topk(x, torch.tensor([50, 50], dtype=torch.int32), 4), logits),
        ("flash_mla_with_kvcache", "q", lambda x: dsa.flash_mla_with_kvcache(
            x, kv, torch.tensor([[0]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32), 32), qm),
        ("sparse_mla_q8kv8_prefill_fwd", "q_scale", lambda x: attnkit.sparse_mla_q8kv8_prefill_fwd(
            sq, skv, idx, 0.05, x, one), one),
    ]


@pytest.mark.parametrize("case", range(6))
def test_serving_and_dsa_ops_refuse_grad(case):
    name, which, call, x = serving_and_dsa_calls()[case]
    with pytest.raises(ValueError, match=f"^torch.ops.attnkit.{name} has no backward yet, and {which} requires grad"):
        call(x.clone().requires_grad_(True))
    with torch.no_grad():
        call(x.clone().requires_grad_(True))


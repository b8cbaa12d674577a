"""attnkit as a backend of diffusers' attention dispatcher: a small randomly initialised
FluxTransformer2DModel (diffusers' own class; joint text+image attention through
dispatch_attention_fn) on the "attnkit" backend against the same model on diffusers'
"native" backend (torch SDPA), and the opt-in "attnkit_sage" int8 backend.

Tolerances: exact backend, fp32 output 1e-4 absolute (two transformer blocks on top of
attention that agrees to ~1e-6); sage, cosine similarity >= 0.999 (its accuracy contract)."""

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
dispatch = pytest.importorskip("diffusers.models.attention_dispatch")

import attnkit.integrations.diffusers as ak_df  # noqa: E402

ak_df.register()


def tiny_flux():
    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8)).eval()


def flux_inputs(batch=2, height=6, width=5, text=7):
    g = torch.Generator().manual_seed(1)
    seq = height * width
    img_ids = torch.zeros(seq, 3)
    img_ids[:, 1] = torch.arange(height).repeat_interleave(width).float()
    img_ids[:, 2] = torch.arange(width).repeat(height).float()
    return dict(hidden_states=torch.randn(batch, seq, 8, generator=g),
                encoder_hidden_states=torch.randn(batch, text, 32, generator=g),
                pooled_projections=torch.randn(batch, 32, generator=g),
                timestep=torch.tensor([0.3, 0.7][:batch]), img_ids=img_ids, txt_ids=torch.zeros(text, 3),
                return_dict=False)


def run(model, backend):
    model.set_attention_backend(backend)
    with torch.no_grad():
        return model(**flux_inputs())[0]


@pytest.fixture(scope="module")
def flux():
    return tiny_flux()


def test_backends_registered():
    names = dispatch._AttentionBackendRegistry.list_backends()
    assert dispatch.AttentionBackendName("attnkit") in names
    assert dispatch.AttentionBackendName("attnkit_sage") in names
    assert ak_df.register() == ("attnkit", "attnkit_sage")  # idempotent


def test_flux_exact_matches_native(flux, monkeypatch):
    calls = []
    real = ak_df.attnkit.attention
    monkeypatch.setattr(ak_df.attnkit, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = run(flux, "attnkit")
    assert len(calls) == 2  # one joint block, one single block: every attention went through attnkit
    want = run(flux, "native")
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert (got - want).abs().max().item() < 1e-4


def test_flux_sage_opt_in(flux):
    got = run(flux, "attnkit_sage").flatten()
    want = run(flux, "native").flatten()
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=0).item()
    assert cos >= 0.999, cos


def test_context_manager_and_direct_call():
    """The dispatcher with the attention_backend() context, on [B, S, H, D] tensors with a
    mask and GQA, against torch SDPA on the permuted tensors."""
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 9, 4, 16, generator=g), torch.randn(2, 11, 2, 16, generator=g), torch.randn(
        2, 11, 2, 16, generator=g)
    mask = torch.rand(2, 1, 9, 11, generator=g) < 0.8
    with dispatch.attention_backend("attnkit"):
        got = dispatch.dispatch_attention_fn(q, k, v, attn_mask=mask, enable_gqa=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True).transpose(1, 2)
    assert (got - want).abs().max().item() < 1e-5


def test_sage_refuses_mask_and_dropout():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="attn_mask is not supported by the attnkit_sage backend"):
        ak_df.sage_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout_p=0.1 is not supported"):
        ak_df.sage_attention(q, q, q, dropout_p=0.1)


def _reference_grads(q, k, v, mask, dout):
    """float64 autograd of softmax(q k^T / sqrt(D) + mask) v in [B, S, H, D], GQA by repeat."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    kk, vv = (x.repeat_interleave(rep, dim=2).transpose(1, 2) for x in (k, v))
    s = q.transpose(1, 2) @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = s.masked_fill(~mask, float("-inf"))
    out = (s.softmax(-1) @ vv).transpose(1, 2)
    out.backward(dout.double())
    return q.grad, k.grad, v.grad


def test_exact_backend_trains_with_attnkit_backward():
    """Grad mode runs attnkit's backward on the "attnkit" backend (no warning): GQA and a bool
    mask, against a float64 reference; fp32 gradients within 1e-5 of the largest entry."""
    import warnings
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 37, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 29, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 29, 2, 24, generator=g, requires_grad=True)
    mask = torch.rand(2, 1, 37, 29, generator=g) > 0.3
    mask[..., 0] = True
    dout = torch.randn(2, 37, 4, 24, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ak_df.exact_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.backward(dout)
    for got, want in zip((q.grad, k.grad, v.grad), _reference_grads(q, k, v, mask, dout)):
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item(), err


def test_sage_grad_falls_back_to_native():
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    ak_df._warn_once.reasons.discard("inputs require grad and attnkit_sage has no backward")
    with pytest.warns(UserWarning, match="attnkit_sage has no backward; using diffusers' native backend"):
        out = ak_df.sage_attention(q, q, q)
    out.sum().backward()
    assert q.grad is not None


def test_two_dim_mask_pads_keys_per_batch_entry():
    """A [B, Skv] mask means [B, 1, 1, Skv] to diffusers' native backend; the same here, also
    where Sq == B would let it broadcast as [Sq, Skv] instead."""
    g = torch.Generator().manual_seed(3)
    for sq in (2, 3):
        q, k, v = torch.randn(2, sq, 2, 8, generator=g), torch.randn(2, 5, 2, 8, generator=g), torch.randn(
            2, 5, 2, 8, generator=g)
        mask = torch.tensor([[True, True, False, False, False], [True, True, True, True, False]])
        got = dispatch.dispatch_attention_fn(q, k, v, attn_mask=mask, backend="attnkit")
        want = dispatch.dispatch_attention_fn(q, k, v, attn_mask=mask, backend="native")
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_dropout_under_fullgraph_compile():
    """Dropout compiles (fullgraph): without grad the op draws its seed at run time; with grad
    (the backward would need a seed drawn at trace time) the call goes to the native backend."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=g) for _ in range(3))
    fn = torch.compile(lambda q, k, v: dispatch.dispatch_attention_fn(q, k, v, dropout_p=0.1, backend="attnkit"),
                       fullgraph=True)
    assert fn(q, k, v).shape == (1, 6, 2, 8)
    qg = q.clone().requires_grad_()
    fn(qg, k, v).sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()

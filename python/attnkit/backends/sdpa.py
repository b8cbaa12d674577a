"""SDPABackend: exact attention through attnkit.attention (PyTorch SDPA semantics)."""

from .base import DTYPES, MODIFIERS, AttentionBackend, AttentionImpl, Capabilities


class SDPAImpl(AttentionImpl):
    """Exact attention; honours softmax_scale, causal, dropout_p (with an optional seed),
    GQA/MQA and every score modifier."""

    def _compute(self, query, key, value):
        return self._exact(query, key, value)


class SDPABackend(AttentionBackend):
    name = "sdpa"
    aliases = ("torch_sdpa",)
    capabilities = Capabilities(
        head_sizes=None, head_size_range=(1, 512), dtypes=DTYPES, gqa=True,
        causal=(False, True, "top_left", "bottom_right"), dropout=True, deterministic=True,
        notes="exact; float32 softmax and accumulation; dropout is bit-reproducible given a "
              "seed (seed=None draws a fresh one per call)",
        modifiers=MODIFIERS)
    impl_cls = SDPAImpl


SDPAImpl.backend = SDPABackend

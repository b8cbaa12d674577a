"""Shared pieces of the attention backends: the configuration type, capability records,
validation helpers and the backend / impl base classes.

The shape follows SGLang's diffusion attention backends: a backend class answers
``get_supported_head_sizes()`` and ``get_impl_cls()``; an impl is built as
``Impl(num_heads, head_size, causal, softmax_scale, num_kv_heads=None, **extra_impl_args)``
and called as ``impl.forward(query, key, value, attn_metadata=None)`` on tensors laid out
[batch, seq, heads, head_dim]. Unlike SGLang, every backend either honours softmax_scale,
causal, dropout_p and the score modifiers (window, softcap, alibi_slopes, sinks: extra impl
args with attnkit.attention's meaning) or refuses the configuration in ``validate``, and
nothing here ever writes to an input.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from typing import ClassVar, Optional, Tuple

logger = logging.getLogger("attnkit")

DTYPES = ("float32", "float16", "bfloat16")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "fp32": "float32", "float": "float32"}


def gqa_divisibility_message(q_heads, kv_heads) -> str:
    """SGLang's message for a query head count that is not a multiple of the KV head count."""
    return ("GQA/MQA requires query heads to be a multiple of KV heads, "
            f"got q_heads={q_heads} and kv_heads={kv_heads}")


def dtype_name(dtype) -> Optional[str]:
    """The attnkit name of a dtype given as a name ("bfloat16", "bf16", "torch.float16"), a
    numpy / ml_dtypes dtype or scalar type, or a torch dtype; None stays None. Unknown
    dtypes come back as their str() so validate can name them in its reason."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = dtype.strip().lower()
        name = name[len("torch."):] if name.startswith("torch.") else name
        return _DTYPE_ALIASES.get(name, name)
    if type(dtype).__module__.split(".")[0] == "torch":  # torch.dtype, without importing torch
        return str(dtype)[len("torch."):]
    try:
        import numpy as np
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


_INVALID = object()


def causal_value(causal):
    """causal as a plain bool or one of attnkit's causal strings; an unrecognised value
    becomes a sentinel that no backend accepts."""
    if isinstance(causal, str):
        return causal
    if type(causal).__name__ in ("bool", "bool_"):  # bool, numpy.bool_
        return bool(causal)
    return _INVALID


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


MODIFIERS = ("window", "softcap", "alibi", "sinks")  # the score modifiers a backend may honour


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """What a backend is asked to serve. num_kv_heads=None means num_heads (MHA); dtype
    None means "not known yet" (it is then checked on the tensors in forward); dtype may be
    a name ("bfloat16") or a numpy / torch dtype."""

    head_size: int
    num_heads: int
    num_kv_heads: Optional[int] = None
    dtype: object = None
    causal: object = False
    dropout_p: float = 0.0
    window: object = None    # None or (left, right), -1 unbounded (attnkit.attention's window)
    softcap: object = None   # None or c > 0
    alibi: bool = False      # ALiBi slopes are given
    sinks: bool = False      # attention sinks are given

    @property
    def modifiers(self) -> Tuple[str, ...]:
        """The score modifiers this configuration asks for, in MODIFIERS order."""
        # (a window that is not a pair counts as asked for: _modifier_value_reasons refuses it)
        window_asked = self.window is not None and (not isinstance(self.window, (tuple, list))
                                                    or tuple(self.window) != (-1, -1))
        asked = (window_asked, self.softcap is not None,
                 bool(self.alibi), bool(self.sinks))
        return tuple(m for m, on in zip(MODIFIERS, asked) if on)

    @property
    def kv_heads(self):
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def dtype_name(self) -> Optional[str]:
        return dtype_name(self.dtype)

    def describe(self) -> str:
        text = (f"head_size={self.head_size!r}, num_heads={self.num_heads!r}, "
                f"num_kv_heads={self.kv_heads!r}, dtype={self.dtype_name}, "
                f"causal={self.causal!r}, dropout_p={self.dropout_p!r}")
        for name in ("window", "softcap"):
            if getattr(self, name) is not None:
                text += f", {name}={getattr(self, name)!r}"
        for name in ("alibi", "sinks"):
            if getattr(self, name):
                text += f", {name}=True"
        return text


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend declares it can serve (validate() is the authority; this is the
    summary). head_sizes None means any size in head_size_range. gqa: serves
    num_heads != num_kv_heads (num_heads a multiple of num_kv_heads). causal: the accepted
    values of the causal flag. dropout: honours dropout_p > 0. deterministic: the same
    inputs (and dropout seed) give bit-identical outputs. lossy: the results differ from
    exact attention by more than rounding (quantized); select() only picks such a backend
    on its own when the caller passes allow_lossy=True. modifiers: the score modifiers
    (names of MODIFIERS) it honours."""

    head_sizes: Optional[Tuple[int, ...]]
    head_size_range: Tuple[int, int]
    dtypes: Tuple[str, ...]
    gqa: bool
    causal: Tuple[object, ...]
    dropout: bool
    deterministic: bool
    lossy: bool = False
    notes: str = ""
    modifiers: Tuple[str, ...] = ()


class AttentionBackend:
    """Base class; subclasses set ``name``, ``aliases``, ``capabilities`` and ``impl_cls``
    and may add reasons in ``_extra_reasons``."""

    name: ClassVar[str] = ""
    aliases: ClassVar[Tuple[str, ...]] = ()
    capabilities: ClassVar[Capabilities]
    impl_cls: ClassVar[type]

    @classmethod
    def get_name(cls) -> str:
        return cls.name

    @classmethod
    def get_supported_head_sizes(cls):
        """None (any head size in capabilities.head_size_range) or a list of head sizes."""
        hs = cls.capabilities.head_sizes
        return None if hs is None else list(hs)

    @classmethod
    def get_impl_cls(cls):
        return cls.impl_cls

    @classmethod
    def get_capabilities(cls) -> Capabilities:
        return cls.capabilities

    @classmethod
    def validate(cls, config: Optional[AttentionConfig] = None, **fields) -> list:
        """Every reason this backend refuses ``config`` (or an AttentionConfig built from
        ``fields``); an empty list means it can serve it."""
        if config is None:
            config = AttentionConfig(**fields)
        elif fields:
            config = dataclasses.replace(config, **fields)
        reasons = cls._common_reasons(config)
        reasons += cls._extra_reasons(config)
        return reasons

    @classmethod
    def _common_reasons(cls, c: AttentionConfig) -> list:
        caps = cls.capabilities
        reasons = []
        lo, hi = caps.head_size_range
        if not _is_int(c.head_size):
            reasons.append(f"head_size must be an int, got {c.head_size!r}")
        elif caps.head_sizes is not None and c.head_size not in caps.head_sizes:
            reasons.append(f"head_size={c.head_size} is not supported by {cls.__name__} "
                           f"(supported: {', '.join(map(str, caps.head_sizes))})")
        elif not lo <= c.head_size <= hi:
            reasons.append(f"head_size={c.head_size} is not supported by {cls.__name__} "
                           f"(supported: {lo}..{hi})")
        heads_ok = True
        for field, value in (("num_heads", c.num_heads), ("num_kv_heads", c.kv_heads)):
            if not _is_int(value) or value < 1:
                reasons.append(f"{field} must be a positive int, got {value!r}")
                heads_ok = False
        if heads_ok and c.num_heads != c.kv_heads:
            if c.num_heads % c.kv_heads != 0:
                reasons.append(gqa_divisibility_message(c.num_heads, c.kv_heads))
            elif not caps.gqa:
                reasons.append(f"{cls.__name__} does not support GQA/MQA "
                               f"(num_heads={c.num_heads} != num_kv_heads={c.kv_heads})")
        name = c.dtype_name
        if name is not None and name not in caps.dtypes:
            reasons.append(f"dtype {name} is not supported by {cls.__name__} "
                           f"(supported: {', '.join(caps.dtypes)})")
        if causal_value(c.causal) not in caps.causal:
            reasons.append(f"causal={c.causal!r} is not supported by {cls.__name__} "
                           f"(supported: {', '.join(map(repr, caps.causal))})")
        if not _is_real(c.dropout_p) or not 0.0 <= c.dropout_p < 1.0:
            reasons.append(f"dropout_p must be a float in [0, 1), got {c.dropout_p!r}")
        elif c.dropout_p > 0:
            reason = cls._dropout_reason(c)
            if reason:
                reasons.append(reason)
        reasons += cls._modifier_value_reasons(c)
        for name in c.modifiers:
            reason = cls._modifier_reason(c, name)
            if reason:
                reasons.append(reason)
        return reasons

    @staticmethod
    def _modifier_value_reasons(c: AttentionConfig) -> list:
        reasons = []
        w = c.window
        if w is not None and not (isinstance(w, (tuple, list)) and len(w) == 2
                                  and all(_is_int(x) and x >= -1 for x in w)):
            reasons.append(f"window must be None or a pair (left, right) of ints >= -1 "
                           f"(-1 unbounded), got {w!r}")
        if c.softcap is not None and not (_is_real(c.softcap) and math.isfinite(c.softcap)
                                          and c.softcap > 0):
            reasons.append(f"softcap must be a finite float > 0 or None, got {c.softcap!r}")
        return reasons

    @classmethod
    def _modifier_reason(cls, c: AttentionConfig, name: str) -> Optional[str]:
        """Why the score modifier `name` (asked for by c) is refused, or None if honoured."""
        if name in cls.capabilities.modifiers:
            return None
        return f"{name} is not supported by {cls.__name__}"

    @classmethod
    def _dropout_reason(cls, c: AttentionConfig) -> Optional[str]:
        """Why dropout_p > 0 is refused, or None if it is honoured."""
        if cls.capabilities.dropout:
            return None
        return (f"dropout_p={c.dropout_p} > 0 is not supported by {cls.__name__}: "
                "quantized attention has no dropout")

    @classmethod
    def _extra_reasons(cls, c: AttentionConfig) -> list:
        return []

    @classmethod
    def refusal_message(cls, config: AttentionConfig, reasons) -> str:
        return (f"{cls.__name__} ({cls.name}) cannot serve {config.describe()}:\n"
                + "\n".join(f"  - {r}" for r in reasons))


class AttentionImpl:
    """Base impl: validates its configuration at construction (ValueError with every
    reason) and its tensors in forward, then runs ``_compute``. Tensors are
    [batch, seq, heads, head_dim] numpy arrays or CPU torch tensors; the output has the
    same layout and kind. Extra args: dropout_p (default 0.0), seed (dropout seed, None =
    a fresh one per call), dtype (checked at construction when given), the score modifiers
    window, softcap, alibi_slopes, sinks (attnkit.attention's meaning; refused in validate
    by a backend that cannot honour one). Other extras are kept in ``extra_impl_args`` and
    ignored, as SGLang passes backend-specific ones."""

    backend: ClassVar[type]

    def __init__(self, num_heads: int, head_size: int, causal: bool, softmax_scale,
                 num_kv_heads: Optional[int] = None, prefix: str = "", **extra_impl_args):
        extra = dict(extra_impl_args)
        dropout_p = extra.pop("dropout_p", 0.0)
        seed = extra.pop("seed", None)
        dtype = extra.pop("dtype", None)
        window, softcap = extra.pop("window", None), extra.pop("softcap", None)
        alibi_slopes, sinks = extra.pop("alibi_slopes", None), extra.pop("sinks", None)
        self.config = AttentionConfig(head_size=head_size, num_heads=num_heads,
                                      num_kv_heads=num_kv_heads, dtype=dtype, causal=causal,
                                      dropout_p=dropout_p, window=window, softcap=softcap,
                                      alibi=alibi_slopes is not None, sinks=sinks is not None)
        reasons = self.backend.validate(self.config)
        if softmax_scale is not None and (not _is_real(softmax_scale)
                                          or not math.isfinite(softmax_scale)):
            reasons.append(f"softmax_scale must be a finite float or None, got {softmax_scale!r}")
        if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**64):
            reasons.append(f"seed must be None or an int in [0, 2**64), got {seed!r}")
        if reasons:
            raise ValueError(self.backend.refusal_message(self.config, reasons))
        self.num_heads = num_heads
        self.num_kv_heads = self.config.kv_heads
        self.head_size = head_size
        self.causal = causal_value(causal)
        self.softmax_scale = None if softmax_scale is None else float(softmax_scale)
        self.dropout_p = float(dropout_p)
        self.seed = None if seed is None else int(seed)
        # The score modifiers, as attnkit.attention's keywords (the op checks the tensors).
        self.modifiers = dict(window=None if window is None else tuple(window), softcap=softcap,
                              alibi_slopes=alibi_slopes, sinks=sinks)
        self.prefix = prefix
        self.extra_impl_args = extra

    def forward(self, query, key, value, attn_metadata=None):
        self._check_tensors(query, key, value)
        return self._compute(query, key, value)

    __call__ = forward

    def _check_tensors(self, query, key, value):
        for x, name in ((query, "query"), (key, "key"), (value, "value")):
            shape = getattr(x, "shape", None)
            if shape is None or len(shape) != 4:
                raise ValueError(f"{name} must be a 4-d [batch, seq, heads, head_dim] array, "
                                 f"got {type(x).__name__} of shape {shape}")
        hq, hkv = query.shape[2], key.shape[2]
        if value.shape[2] != hkv:
            raise ValueError(f"key and value must have the same number of heads, got "
                             f"{hkv} and {value.shape[2]}")
        if hkv != hq and (hkv < 1 or hq % hkv != 0):
            raise ValueError(gqa_divisibility_message(hq, hkv))
        got = (hq, hkv, query.shape[3])
        want = (self.num_heads, self.num_kv_heads, self.head_size)
        if got != want:
            raise ValueError(
                f"{type(self).__name__} was built for num_heads={want[0]}, num_kv_heads="
                f"{want[1]}, head_size={want[2]}; the tensors have q_heads={got[0]}, "
                f"kv_heads={got[1]}, head_dim={got[2]}")
        reasons = self.backend.validate(self.config, dtype=query.dtype)
        built_for, got_dtype = self.config.dtype_name, dtype_name(query.dtype)
        if built_for is not None and got_dtype != built_for:
            reasons.append(f"{type(self).__name__} was built for dtype {built_for}, the tensors are "
                           f"{got_dtype}")
        if reasons:
            raise ValueError(self.backend.refusal_message(
                dataclasses.replace(self.config, dtype=query.dtype), reasons))

    def _compute(self, query, key, value):  # pragma: no cover - abstract
        raise NotImplementedError

    def _exact(self, query, key, value):
        """Exact attention on BSHD tensors with this impl's scale, causal, dropout, seed and
        score modifiers (the path shared by SDPABackend and SageAttention3's GQA fallback, so
        both give bit-identical outputs)."""
        from .. import attention
        return attention(query, key, value, causal=self.causal, scale=self.softmax_scale,
                         dropout_p=self.dropout_p, seed=self.seed, enable_gqa=True,
                         layout="BSHD", **self.modifiers)

"""A Llama-family model's architecture (`LlamaConfig`), its RoPE scaling, and the seeded tiny
model's shape (`TinyConfig`): checked when built, so a forward never meets an impossible shape."""

from __future__ import annotations

import math

import attrs
import torch

# What `TinyConfig` accepts; a real model may also run in half precision.
DTYPES: dict[str, torch.dtype] = {"float64": torch.float64, "float32": torch.float32}
MODEL_DTYPES: dict[str, torch.dtype] = {**DTYPES, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What K/V may be kept in (`--kv-cache-dtype`); float64 only for the float64 tiny model.
KV_DTYPES: dict[str, torch.dtype] = {**MODEL_DTYPES}
ROPE_KINDS = ("linear", "llama3", "factors")


def _at_least_one(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}: expected an integer >= 1, got {value!r}"
        )


def _positive_number(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}: expected a finite number > 0, got {value!r}"
        )


@attrs.frozen(slots=True, kw_only=True)
class RopeScaling:
    """How a checkpoint stretches RoPE past its training length (Hugging Face's `rope_scaling`).

    `linear` divides every frequency by `factor`; `llama3` divides the low frequencies by `factor`
    and blends the band between `low_freq_factor` and `high_freq_factor` (Llama 3.1's recipe);
    `factors` divides frequency i by `factors[i]` (what llama.cpp stores as `rope_freqs.weight`).
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    factors: tuple[float, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RopeScaling.kind: expected one of {ROPE_KINDS}, got {self.kind!r}")
        _positive_number(self, attrs.fields(RopeScaling).factor, self.factor)
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "RopeScaling: expected 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.kind == "factors" and (not self.factors or not all(f > 0 for f in self.factors)):
            raise ValueError(f"RopeScaling.factors: expected positive numbers, got {self.factors!r}")


@attrs.frozen(slots=True, kw_only=True)
class LlamaConfig:
    """Every architecture knob of a Llama-family model, plus what identifies its weights.

    Equal configs compute equal K/V: `compat.model_fingerprint` hashes `attrs.asdict(config)`, so
    `weights` carries a digest of the weights a loader read (empty for seeded random weights,
    which `TinyConfig.seed` identifies). `dtype` is a torch dtype name.
    """

    layers: int = attrs.field(validator=_at_least_one)
    q_heads: int = attrs.field(validator=_at_least_one)
    kv_heads: int = attrs.field(validator=_at_least_one)
    head_dim: int = attrs.field(validator=_at_least_one)
    hidden: int = attrs.field(validator=_at_least_one)
    vocab: int = attrs.field(validator=_at_least_one)
    ffn: int = attrs.field(validator=_at_least_one)
    dtype: str = "float32"
    rope_base: float = 10000.0
    rms_eps: float = attrs.field(default=1e-6, validator=_positive_number)
    rope_scaling: RopeScaling | None = None
    tied_embeddings: bool = False
    qkv_bias: bool = False
    name: str = ""
    weights: str = ""

    def __attrs_post_init__(self) -> None:
        kind = type(self).__name__
        if self.q_heads % self.kv_heads != 0:
            raise ValueError(
                f"{kind}.q_heads: expected a multiple of kv_heads={self.kv_heads}, got {self.q_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"{kind}.head_dim: expected an even number (RoPE), got {self.head_dim}")
        if self.vocab < 2:
            raise ValueError(f"{kind}.vocab: expected at least 2 tokens, got {self.vocab}")
        allowed = self._dtypes()
        if self.dtype not in allowed:
            raise ValueError(f"{kind}.dtype: expected one of {sorted(allowed)}, got {self.dtype!r}")
        base = self.rope_base
        if isinstance(base, bool) or not isinstance(base, int | float) or not 1.0 < base < math.inf:
            raise ValueError(f"{kind}.rope_base: expected a finite number > 1, got {base!r}")
        scaling = self.rope_scaling
        if scaling is not None and not isinstance(scaling, RopeScaling):
            raise ValueError(f"{kind}.rope_scaling: expected a RopeScaling or None, got {scaling!r}")
        if scaling is not None and scaling.kind == "factors" and len(scaling.factors) != self.head_dim // 2:
            raise ValueError(
                f"{kind}.rope_scaling: expected {self.head_dim // 2} frequency factors (head_dim / 2), "
                f"got {len(scaling.factors)}"
            )

    def _dtypes(self) -> dict[str, torch.dtype]:
        return MODEL_DTYPES

    @property
    def d_model(self) -> int:
        return self.hidden

    @property
    def torch_dtype(self) -> torch.dtype:
        return MODEL_DTYPES[self.dtype]

    def kv_shape(self, length: int) -> tuple[int, int, int, int, int]:
        """Shape of the K/V of `length` tokens: `(layers, 2, length, kv_heads, head_dim)`."""
        return (self.layers, 2, length, self.kv_heads, self.head_dim)


@attrs.frozen(slots=True)
class TinyConfig(LlamaConfig):
    """Shape and seed of a `TinyModel`; equal configs give bit-identical models.

    The width is `q_heads * head_dim`. The inherited keyword-only knobs (`qkv_bias`,
    `tied_embeddings`, `rope_scaling`, `rms_eps`) also apply, so the exact tests can cover them.
    """

    layers: int = attrs.field(default=2, validator=_at_least_one)
    q_heads: int = attrs.field(default=4, validator=_at_least_one)
    kv_heads: int = attrs.field(default=2, validator=_at_least_one)
    head_dim: int = attrs.field(default=16, validator=_at_least_one)
    vocab: int = attrs.field(default=512, validator=_at_least_one)
    ffn: int = attrs.field(default=128, validator=_at_least_one)
    seed: int = 0
    dtype: str = "float64"
    rope_base: float = 10000.0
    hidden: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"TinyConfig.seed: expected an integer in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "hidden", self.q_heads * self.head_dim)
        LlamaConfig.__attrs_post_init__(self)

    def _dtypes(self) -> dict[str, torch.dtype]:
        return DTYPES

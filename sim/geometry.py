"""Model geometry: KV bytes and FLOPs per token, from the architecture's published shapes.

KV cache per token (all layers):
- MHA/GQA: 2 (K and V) x layers x kv_heads x head_dim x bytes per element;
- MLA (DeepSeek-V2/V3): layers x (kv_lora_rank + qk_rope_head_dim) x bytes per element — the
  compressed latent and the decoupled RoPE key are cached, not per-head K and V.
FLOPs per token: 2 x active parameters for the weights, plus attention over the context,
2 x 2 x layers x context x (q_heads x head_dim) (QK^T and AV).
"""

from __future__ import annotations

import attrs


@attrs.frozen(slots=True)
class ModelGeometry:
    name: str
    layers: int
    q_heads: int
    kv_heads: int  # MHA: == q_heads; GQA: fewer; MLA: unused
    head_dim: int
    active_params: float  # parameters touched per token (MoE: the activated ones)
    total_params: float  # parameters held in memory (weights read per decode step, MoE: all experts resident)
    dtype_bytes: int = 2  # bf16
    mla_kv_lora_rank: int = 0  # > 0 selects MLA
    mla_rope_dim: int = 0

    def __attrs_post_init__(self) -> None:
        for field in ("layers", "q_heads", "head_dim", "dtype_bytes"):
            if getattr(self, field) < 1:
                raise ValueError(f"model {self.name!r}: {field} must be >= 1, got {getattr(self, field)}")
        if self.mla_kv_lora_rank == 0 and not 1 <= self.kv_heads <= self.q_heads:
            raise ValueError(f"model {self.name!r}: kv_heads must be in 1..q_heads, got {self.kv_heads}")

    @property
    def is_mla(self) -> bool:
        return self.mla_kv_lora_rank > 0

    @property
    def kv_bytes_per_token(self) -> int:
        if self.is_mla:
            return self.layers * (self.mla_kv_lora_rank + self.mla_rope_dim) * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def flops_per_token(self, context: int = 0) -> float:
        """FLOPs to process one token attending to `context` earlier tokens."""
        return 2.0 * self.active_params + 4.0 * self.layers * context * self.q_heads * self.head_dim

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.dtype_bytes


# Shapes from each model's published config.json on its model card.
PRESETS: dict[str, ModelGeometry] = {
    # meta-llama/Meta-Llama-3-8B: 32 layers, 32 heads, 8 KV heads, head_dim 4096/32 = 128, 8.03 B params.
    "llama-3-8b": ModelGeometry("llama-3-8b", 32, 32, 8, 128, 8.03e9, 8.03e9),
    # Qwen/Qwen2.5-32B: 64 layers, 40 heads, 8 KV heads, head_dim 5120/40 = 128, 32.5 B params.
    "qwen2.5-32b": ModelGeometry("qwen2.5-32b", 64, 40, 8, 128, 32.5e9, 32.5e9),
    # Qwen/Qwen3-32B: 64 layers, 64 heads, 8 KV heads, head_dim 128 (set in its config; hidden size
    # 5120), 32.8 B params. Same KV bytes per token as Qwen2.5-32B, 1.6x the attention FLOPs.
    "qwen3-32b": ModelGeometry("qwen3-32b", 64, 64, 8, 128, 32.8e9, 32.8e9),
    # meta-llama/Meta-Llama-3-70B: 80 layers, 64 heads, 8 KV heads, head_dim 8192/64 = 128, 70.6 B
    # params: 320 KiB of KV per token, the figure Mooncake (FAST'25) uses for its LLaMA3-70B.
    "llama-3-70b": ModelGeometry("llama-3-70b", 80, 64, 8, 128, 70.6e9, 70.6e9),
    # deepseek-ai/DeepSeek-V3: 61 layers, 128 heads, MLA kv_lora_rank 512 + qk_rope_head_dim 64,
    # 671 B params of which 37 B are activated per token. head_dim here is the attention's
    # per-head QK dimension (qk_nope 128 + qk_rope 64 = 192), used for the attention FLOPs.
    "deepseek-v3": ModelGeometry(
        "deepseek-v3", 61, 128, 128, 192, 37e9, 671e9, mla_kv_lora_rank=512, mla_rope_dim=64
    ),
}


def model_preset(name: str) -> ModelGeometry:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; expected one of: {', '.join(sorted(PRESETS))}") from None

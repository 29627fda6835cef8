"""One rank's part of a tensor-parallel Llama model, split as Megatron and SGLang split it.

Each of `size` ranks holds `kv_heads / size` KV heads (and the query heads that read them), the
matching rows of o_proj, and `ffn / size` columns of gate/up with the matching rows of down. The
row-split projections give partial sums that `reduce` (an all-reduce over the group) adds up, so
every rank ends each block with the same hidden state, the same logits and the same token; the
embedding, the norms and the output head are whole on every rank. A rank's K/V pages hold only
its heads: the shard's `config` has `kv_heads / size` of them, and `full_config` is the model's.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from hicache.runtime.model.llama import LlamaConfig, LlamaLayer, LlamaModel, LlamaWeights


def check_split(config: LlamaConfig, size: int) -> str | None:
    """Why `config` cannot be split over `size` ranks (None when it can), in one line."""
    for name in ("kv_heads", "q_heads", "ffn"):
        value = getattr(config, name)
        if value % size:
            return f"--tp-size {size}: the model's {name} ({value}) is not a multiple of it"
    return None


def head_range(config: LlamaConfig, rank: int, size: int) -> tuple[int, int]:
    """The KV heads [lo, hi) of `rank`."""
    per = config.kv_heads // size
    return rank * per, (rank + 1) * per


def shard_config(config: LlamaConfig, size: int) -> LlamaConfig:
    """The geometry one rank computes with: a `size`-th of the heads and of the MLP."""
    fields = {f.name: getattr(config, f.name) for f in attrs.fields(LlamaConfig)}
    fields.update(q_heads=config.q_heads // size, kv_heads=config.kv_heads // size, ffn=config.ffn // size)
    return LlamaConfig(**fields)


def _cols(w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return w[..., lo:hi]


def _shard_layer(layer: LlamaLayer, full: LlamaConfig, rank: int, size: int) -> LlamaLayer:
    d = full.head_dim
    qw, kw = full.q_heads * d, full.kv_heads * d
    q_lo, q_hi = rank * qw // size, (rank + 1) * qw // size
    k_lo, k_hi = rank * kw // size, (rank + 1) * kw // size
    f_lo, f_hi = rank * full.ffn // size, (rank + 1) * full.ffn // size

    def qkv_part(t: torch.Tensor) -> torch.Tensor:
        wq, wk, wv = t.split((qw, kw, kw), dim=-1)
        return torch.cat((_cols(wq, q_lo, q_hi), _cols(wk, k_lo, k_hi), _cols(wv, k_lo, k_hi)), dim=-1)

    gate, up = layer.gate_up.split(full.ffn, dim=1)
    return LlamaLayer(
        attn_norm=layer.attn_norm,
        qkv=qkv_part(layer.qkv).contiguous(),
        qkv_bias=None if layer.qkv_bias is None else qkv_part(layer.qkv_bias).contiguous(),
        wo=layer.wo[q_lo:q_hi].contiguous(),
        mlp_norm=layer.mlp_norm,
        gate_up=torch.cat((gate[:, f_lo:f_hi], up[:, f_lo:f_hi]), dim=1).contiguous(),
        w_down=layer.w_down[f_lo:f_hi].contiguous(),
    )


def shard_model(
    model: LlamaModel, rank: int, size: int, reduce: Callable[[torch.Tensor], torch.Tensor]
) -> LlamaModel:
    """Rank `rank`'s part of `model`; its forward passes call `reduce` twice per layer, so every
    rank of the group must run the same forward at the same time."""
    full = model.config
    why = check_split(full, size)
    if why is not None:
        raise ValueError(why)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank}: expected 0 <= rank < {size}")
    w = model.weights
    weights = LlamaWeights(
        embed=w.embed,
        layers=tuple(_shard_layer(layer, full, rank, size) for layer in w.layers),
        final_norm=w.final_norm,
        head=w.head,
    )
    part = LlamaModel(
        shard_config(full, size),
        weights,
        eos_token_ids=model.eos_token_ids,
        kv_dtype=model.kv_dtype_name,
        device=model.device,
    )
    part.reduce = reduce
    part.full_config = full
    return part

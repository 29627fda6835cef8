"""A Llama-family model's weights in the layout the forward multiplies by (`LlamaLayer`,
`LlamaWeights`), built from a checkpoint's separate matrices (`build_layer`, for the loaders) or
drawn from a seed (`tiny_weights`, the exact tests' model)."""

from __future__ import annotations

import math

import attrs
import torch

from hicache.runtime.model.llama_config import LlamaConfig, TinyConfig


@attrs.frozen(slots=True, eq=False)
class LlamaLayer:
    """One block's weights, contiguous `(in, out)` for `x @ w`; q/k/v and gate/up are fused so a
    step runs one matmul for each (the loaders build these with `build_layer`). For the few rows
    of a decode step MKL runs this layout up to twice as fast as the `(out, in)` of `nn.Linear`."""

    attn_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # (hidden, (q_heads + 2 * kv_heads) * head_dim): Wq | Wk | Wv
    qkv_bias: torch.Tensor | None  # ((q_heads + 2 * kv_heads) * head_dim,) or None
    wo: torch.Tensor  # (q_heads * head_dim, hidden)
    mlp_norm: torch.Tensor  # (hidden,)
    gate_up: torch.Tensor  # (hidden, 2 * ffn): W_gate | W_up
    w_down: torch.Tensor  # (ffn, hidden)


@attrs.frozen(slots=True, eq=False)
class LlamaWeights:
    """All of a model's weights; `head` is `(hidden, vocab)`, a view of `embed` when tied."""

    embed: torch.Tensor  # (vocab, hidden)
    layers: tuple[LlamaLayer, ...]
    final_norm: torch.Tensor  # (hidden,)
    head: torch.Tensor  # (hidden, vocab)

    def to(self, device: torch.device) -> LlamaWeights:
        """The same weights on `device` (themselves when already there); a tied head stays a
        view of the moved embedding, so a GPU holds the matrix once."""
        if self.embed.device == device:
            return self
        embed = self.embed.to(device)
        tied = self.head.data_ptr() == self.embed.data_ptr()

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        layers = tuple(
            LlamaLayer(**{f.name: move(getattr(layer, f.name)) for f in attrs.fields(LlamaLayer)})
            for layer in self.layers
        )
        head = embed.t() if tied else self.head.to(device)
        return LlamaWeights(embed=embed, layers=layers, final_norm=self.final_norm.to(device), head=head)


def build_layer(
    config: LlamaConfig,
    *,
    attn_norm: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    wo: torch.Tensor,
    mlp_norm: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    bq: torch.Tensor | None = None,
    bk: torch.Tensor | None = None,
    bv: torch.Tensor | None = None,
    where: str = "layer",
) -> LlamaLayer:
    """A `LlamaLayer` from separate `(in, out)` matrices (transposed views are fine), checked
    against `config` and cast to its dtype; `where` names the layer in errors."""
    cfg, dtype = config, config.torch_dtype
    q_width, kv_width = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    want = {
        "attn_norm": (attn_norm, (cfg.hidden,)),
        "wq": (wq, (cfg.hidden, q_width)),
        "wk": (wk, (cfg.hidden, kv_width)),
        "wv": (wv, (cfg.hidden, kv_width)),
        "wo": (wo, (q_width, cfg.hidden)),
        "mlp_norm": (mlp_norm, (cfg.hidden,)),
        "w_gate": (w_gate, (cfg.hidden, cfg.ffn)),
        "w_up": (w_up, (cfg.hidden, cfg.ffn)),
        "w_down": (w_down, (cfg.ffn, cfg.hidden)),
    }
    biases = {"bq": (bq, (q_width,)), "bk": (bk, (kv_width,)), "bv": (bv, (kv_width,))}
    present = [name for name, (t, _) in biases.items() if t is not None]
    if present and len(present) != 3 or bool(present) != cfg.qkv_bias:
        raise ValueError(
            f"{where}: qkv_bias={cfg.qkv_bias} expects {'all' if cfg.qkv_bias else 'none'} of bq, bk, bv; "
            f"got {present or 'none'}"
        )
    if cfg.qkv_bias:
        want.update(biases)
    for name, (tensor, shape) in want.items():
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{where}.{name}: expected shape {shape}, got {got}")
    bias = torch.cat((bq, bk, bv)).to(dtype) if cfg.qkv_bias else None  # type: ignore[arg-type]
    return LlamaLayer(
        attn_norm=attn_norm.to(dtype).contiguous(),
        qkv=torch.cat((wq, wk, wv), dim=1).to(dtype),
        qkv_bias=bias,
        wo=wo.to(dtype).contiguous(),
        mlp_norm=mlp_norm.to(dtype).contiguous(),
        gate_up=torch.cat((w_gate, w_up), dim=1).to(dtype),
        w_down=w_down.to(dtype).contiguous(),
    )


def tiny_weights(cfg: TinyConfig) -> LlamaWeights:
    """Weights drawn from `cfg.seed`: equal configs give bit-identical weights."""
    dtype = cfg.torch_dtype
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)

    def draw(rows: int, cols: int) -> torch.Tensor:
        # Drawn in float64 whatever the model's dtype, so float32 models share the same weights.
        return torch.randn((rows, cols), generator=gen, dtype=torch.float64) / math.sqrt(rows)

    def norm_weight() -> torch.Tensor:
        # Near one, but not exactly, so the norm weights take part in every check.
        return 1.0 + 0.1 * torch.randn((cfg.d_model,), generator=gen, dtype=torch.float64)

    d, kv_width = cfg.d_model, cfg.kv_heads * cfg.head_dim
    embed = torch.randn((cfg.vocab, d), generator=gen, dtype=torch.float64).to(dtype)
    parts = [
        {
            "attn_norm": norm_weight(),
            "wq": draw(d, d),
            "wk": draw(d, kv_width),
            "wv": draw(d, kv_width),
            "wo": draw(d, d),
            "mlp_norm": norm_weight(),
            "w_gate": draw(d, cfg.ffn),
            "w_up": draw(d, cfg.ffn),
            "w_down": draw(cfg.ffn, d),
        }
        for _ in range(cfg.layers)
    ]
    final_norm = norm_weight().to(dtype)
    head = embed.t() if cfg.tied_embeddings else draw(d, cfg.vocab).to(dtype)
    if cfg.qkv_bias:  # drawn last, so the other weights are those of the same config without
        for p in parts:
            p.update(bq=0.1 * draw(1, d)[0], bk=0.1 * draw(1, kv_width)[0], bv=0.1 * draw(1, kv_width)[0])
    layers = tuple(build_layer(cfg, where=f"layers.{i}", **p) for i, p in enumerate(parts))
    return LlamaWeights(embed=embed, layers=layers, final_norm=final_norm, head=head)

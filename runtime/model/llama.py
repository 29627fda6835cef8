"""One Llama-family decoder that computes real K/V for the runtime's nodes, tiny or real.

`LlamaModel` runs any Llama-shaped checkpoint (Llama, Qwen2/2.5, SmolLM, Mistral): token
embedding, then per layer RMSNorm -> GQA attention with RoPE (optionally scaled) and optional
q/k/v biases -> residual, RMSNorm -> SwiGLU MLP -> residual; a final RMSNorm and a tied or untied
output head. The forward pass is written once (`_run`); what differs between callers is only
where the K/V of earlier positions lives:

- `forward` / `prefill` / `decode_step` / `generate`: a contiguous past, one sequence;
- `forward_paged` / `decode_batch` / `prefill_into`: the pages of a KV pool, many sequences at
  once. This is what the nodes serve from: one batched forward per decode step, the new tokens'
  K/V written straight into the pool's pages.

`TinyModel` is the same model with seeded random weights (`TinyConfig`). End-to-end checks
compare assembled K/V with one monolithic pass over the whole sequence, so it runs in float64 by
default: summing in a different order (one pass versus prefix + increment, or a batch) moves
results by ~1e-15, far below the 1e-9 the checks allow, and never flips a greedy token.

K/V layout, shared with the paged pools: a sequence's K/V is one tensor of shape
`(layers, 2, length, kv_heads, head_dim)` (index 0 of the second axis is K, after RoPE, as cached;
1 is V); one page holds all layers' K and V for `page_size` tokens, shape
`(layers, 2, page_size, kv_heads, head_dim)`, and a pool is `(num_pages, *page_shape)`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Sequence

import attrs
import torch
import torch.nn.functional as F

# What `TinyConfig` accepts; a real model may also run in half precision.
DTYPES: dict[str, torch.dtype] = {"float64": torch.float64, "float32": torch.float32}
MODEL_DTYPES: dict[str, torch.dtype] = {**DTYPES, "bfloat16": torch.bfloat16, "float16": torch.float16}
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


# -- weights --------------------------------------------------------------------------------------


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


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """RoPE's `head_dim / 2` angular frequencies in float64, after the checkpoint's scaling."""
    half = config.head_dim // 2
    exponents = torch.arange(half, dtype=torch.float64) * 2.0 / config.head_dim
    inv_freq = 1.0 / (float(config.rope_base) ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "factors":
        return inv_freq / torch.tensor(scaling.factors, dtype=torch.float64)
    # llama3: long wavelengths slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = scaling.original_context / scaling.low_freq_factor
    high_wavelen = scaling.original_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype in (torch.float16, torch.bfloat16):
        # As Hugging Face does: normalise in float32, scale in the model's dtype.
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype) * weight
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def greedy_token(logits: torch.Tensor) -> int:
    """The argmax of `logits`; among equal maxima the lowest index (torch.argmax returns the first)."""
    return int(torch.argmax(logits).item())


# -- where earlier positions' K/V lives -----------------------------------------------------------


class _ContiguousKV:
    """One sequence: its past K/V in one tensor; the new tokens' K/V collected into `kv_new`."""

    def __init__(self, past_kv: torch.Tensor | None, past_len: int, kv_new: torch.Tensor) -> None:
        self.past_kv, self.past_len, self.kv_new = past_kv, past_len, kv_new

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv_new[layer, 0] = k
        self.kv_new[layer, 1] = v

    def attend(self, layer: int, q: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        k, v = self.kv_new[layer, 0], self.kv_new[layer, 1]
        if self.past_kv is not None and self.past_len > 0:
            k = torch.cat((self.past_kv[layer, 0], k), dim=0)
            v = torch.cat((self.past_kv[layer, 1], v), dim=0)
        queries_from = k.shape[0] - 1 if rows is not None else self.past_len
        return _attend(q, k, v, queries_from)


class _PagedKV:
    """Many sequences whose K/V lives in a pool's pages; new tokens' K/V is written there first.

    Request b has `counts[b]` new rows (consecutive in the flat batch) at positions
    `starts[b] ..`; its keys are gathered from the first pages of its page table, padded to the
    longest request, and masked causally, so padding never contributes. Slots past a request's
    positions are read (then masked), so they must hold finite values: a `KVPool` starts zeroed,
    and a reused page holds old, finite K/V.
    """

    def __init__(
        self,
        pool: torch.Tensor,
        page_tables: Sequence[Sequence[int]],
        starts: Sequence[int],
        counts: Sequence[int],
    ) -> None:
        page_size = pool.shape[3]
        self.pool = pool
        self.batch = len(counts)
        self.ends = [s + n for s, n in zip(starts, counts, strict=True)]  # keys 0 .. end-1
        positions = torch.cat([torch.arange(s, e) for s, e in zip(starts, self.ends, strict=True)])
        self.positions = positions
        self.write_pages = torch.tensor(
            [
                page_tables[b][p // page_size]
                for b in range(self.batch)
                for p in range(starts[b], self.ends[b])
            ],
            dtype=torch.int64,
        )
        self.write_slots = positions % page_size
        need = [-(-e // page_size) for e in self.ends]
        width = max(need)
        # Padding entries repeat a page the request owns: always a valid index, and masked out.
        self.gather = torch.tensor(
            [
                list(page_tables[b][: need[b]]) + [page_tables[b][0]] * (width - need[b])
                for b in range(self.batch)
            ],
            dtype=torch.int64,
        )
        self.key_len = width * page_size
        # The pool as rows of one page's K (or V) for one layer: row (page * layers + layer) * 2 + kv.
        layers = pool.shape[1]
        self.rows_view = pool.view(pool.shape[0] * layers * 2, -1)
        base = self.gather * (layers * 2)
        self.page_rows = torch.stack((base, base + 1))  # (2, B, width): K rows, V rows of layer 0
        self.single_rows = all(n == 1 for n in counts)
        offsets = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
        self.offsets = offsets
        self.max_rows = max(counts)
        if not self.single_rows and self.batch > 1:
            # Row r of the flat batch sits at (request, index within the request) in a padded grid.
            self.grid_b = torch.repeat_interleave(torch.arange(self.batch), torch.tensor(list(counts)))
            self.grid_i = torch.arange(int(offsets[-1])) - offsets[:-1][self.grid_b]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.pool[self.write_pages, layer, 0, self.write_slots] = k
        self.pool[self.write_pages, layer, 1, self.write_slots] = v

    def last_rows(self) -> torch.Tensor:
        """Flat indices of each request's last new row: only those need logits."""
        return self.offsets[1:] - 1

    def attend(self, layer: int, q: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        b, heads, dim = self.batch, self.pool.shape[-2], self.pool.shape[-1]
        # One gather of whole contiguous rows (a page's K or V for one layer) into (2, B, L, ...).
        which = (self.page_rows + 2 * layer).view(-1)
        kv = torch.index_select(self.rows_view, 0, which).view(2, b, self.key_len, heads, dim)
        k, v = kv[0], kv[1]
        if b == 1:
            # One sequence: exactly its keys, and the same attention call as the contiguous path.
            end = self.ends[0]
            return _attend(q, k[0, :end], v[0, :end], end - q.shape[0])
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, kv_heads, L, head_dim)
        key_pos = torch.arange(self.key_len)
        if rows is not None or self.single_rows:
            # One query per request: its last new position sees every key up to it.
            q_pos = torch.tensor(self.ends) - 1
            mask = key_pos[None, None, None, :] <= q_pos[:, None, None, None]  # (B, 1, 1, L)
            out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)
            return out[:, :, 0].reshape(b, -1)
        grid = q.new_zeros((b, self.max_rows, *q.shape[1:]))
        grid[self.grid_b, self.grid_i] = q
        q_pos = torch.tensor(self.ends)[:, None] - 1 + torch.zeros(1, self.max_rows, dtype=torch.int64)
        q_pos[self.grid_b, self.grid_i] = self.positions  # padding rows repeat the last position
        mask = key_pos[None, None, None, :] <= q_pos[:, None, :, None]  # (B, 1, rows, L)
        out = F.scaled_dot_product_attention(grid.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2)[self.grid_b, self.grid_i].reshape(q.shape[0], -1)


class LlamaModel:
    """A Llama-family decoder, CPU, no autograd; forward passes over contiguous or paged K/V.

    `eos_token_ids` are the tokens that end a generation (empty for random weights).
    """

    def __init__(
        self, config: LlamaConfig, weights: LlamaWeights, *, eos_token_ids: Iterable[int] = ()
    ) -> None:
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config: expected a LlamaConfig, got {type(config).__name__}")
        if len(weights.layers) != config.layers:
            raise ValueError(f"weights: expected {config.layers} layers, got {len(weights.layers)}")
        self.config = config
        self.weights = weights
        self.eos_token_ids: frozenset[int] = frozenset(int(t) for t in eos_token_ids)
        self._inv_freq = rope_inv_freq(config)  # (head_dim / 2,), float64
        # Tensor parallelism (`runtime/model/tp_model.py`): the sum over ranks of the row-split
        # o_proj and down projections' partial outputs; None on a whole model.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.full_config: LlamaConfig = config  # the whole model's, also on a rank's part

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every weight by name (views, not copies): for comparing models and checksums."""
        cfg, w = self.config, self.weights
        out = {"embed": w.embed, "final_norm": w.final_norm, "head": w.head}
        q_width, kv_width = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        for i, layer in enumerate(w.layers):
            wq, wk, wv = layer.qkv.split((q_width, kv_width, kv_width), dim=1)
            w_gate, w_up = layer.gate_up.split(cfg.ffn, dim=1)
            named = {
                "attn_norm": layer.attn_norm,
                "wq": wq,
                "wk": wk,
                "wv": wv,
                "wo": layer.wo,
                "mlp_norm": layer.mlp_norm,
                "w_gate": w_gate,
                "w_up": w_up,
                "w_down": layer.w_down,
            }
            if layer.qkv_bias is not None:
                bq, bk, bv = layer.qkv_bias.split((q_width, kv_width, kv_width))
                named.update(bq=bq, bk=bk, bv=bv)
            out.update({f"layers.{i}.{name}": t for name, t in named.items()})
        return out

    # -- the forward pass, written once ---------------------------------------------------------

    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv: _ContiguousKV | _PagedKV,
        last: torch.Tensor,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits of rows `last` of the flat batch `tokens` (each at its position in `positions`).

        Every row's K/V goes to `kv.store`; every row attends through `kv.attend`. At the last
        layer only rows `last` go on (nothing after the last K/V needs the others). `on_layer(i)`
        is called once layer i's K/V is stored (prefill ships it from there, layer by layer).
        """
        cfg, w = self.config, self.weights
        q_width, kv_width = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        n = tokens.shape[0]
        cos, sin = self._rope(positions)
        x = w.embed[tokens]  # (n, hidden)
        for index, layer in enumerate(w.layers):
            h = _rms_norm(x, layer.attn_norm, cfg.rms_eps)
            qkv = h @ layer.qkv
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            q, k, v = qkv.split((q_width, kv_width, kv_width), dim=1)
            k = _apply_rope(k.reshape(n, cfg.kv_heads, cfg.head_dim), cos, sin)
            kv.store(index, k, v.reshape(n, cfg.kv_heads, cfg.head_dim))
            if on_layer is not None:
                on_layer(index)
            rows = None
            if index == cfg.layers - 1 and last.shape[0] < n:
                rows = last
                x, q, cos, sin = x[last], q[last], cos[last], sin[last]
            q = _apply_rope(q.reshape(-1, cfg.q_heads, cfg.head_dim), cos, sin)
            attn = kv.attend(index, q, rows) @ layer.wo
            x = x + (attn if self.reduce is None else self.reduce(attn))
            h = _rms_norm(x, layer.mlp_norm, cfg.rms_eps)
            gate, up = (h @ layer.gate_up).split(cfg.ffn, dim=1)
            mlp = (F.silu(gate) * up) @ layer.w_down
            x = x + (mlp if self.reduce is None else self.reduce(mlp))
        if last.shape[0] < x.shape[0]:
            x = x[last]
        return _rms_norm(x, w.final_norm, cfg.rms_eps) @ w.head

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles are computed per position from exact integer positions, so a position gets the
        # same rotation whether it is reached in one pass, in pieces, or in any batch.
        angles = torch.outer(positions.to(torch.float64), self._inv_freq)
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # (n, 1, head_dim)
        dtype = self.config.torch_dtype
        return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)

    # -- one sequence, contiguous K/V ------------------------------------------------------------

    def forward(
        self, tokens: torch.Tensor, past_kv: torch.Tensor | None = None, past_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `n` new tokens at positions `past_len .. past_len+n-1`, and the last one's logits.

        The new tokens attend causally to `past_kv` (shape `(layers, 2, past_len, kv_heads,
        head_dim)`, or None for an empty past) and to themselves. `past_len` defaults to the length
        of `past_kv`; when given it must agree. Returns `kv_new` of shape `(layers, 2, n, kv_heads,
        head_dim)` (K after RoPE, as cached) and the logits of the last new token, shape `(vocab,)`.
        """
        cfg = self.config
        tokens = self._check_tokens(tokens)
        past_len = self._check_past(past_kv, past_len)
        n = tokens.shape[0]
        kv_new = torch.empty(cfg.kv_shape(n), dtype=cfg.torch_dtype)
        positions = torch.arange(past_len, past_len + n)
        logits = self._run(tokens, positions, _ContiguousKV(past_kv, past_len, kv_new), torch.tensor([n - 1]))
        return kv_new, logits[0]

    def _check_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(f"tokens: expected a torch.Tensor of int64, got {type(tokens).__name__}")
        if tokens.dtype != torch.int64 or tokens.dim() != 1 or tokens.shape[0] == 0:
            raise ValueError(
                f"tokens: expected a non-empty 1-D int64 tensor, got dtype={tokens.dtype} "
                f"shape={tuple(tokens.shape)}"
            )
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.config.vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"tokens: expected ids in [0, {self.config.vocab}), got {bad}")
        return tokens

    def _check_past(self, past_kv: torch.Tensor | None, past_len: int | None) -> int:
        cfg = self.config
        if past_kv is None:
            if past_len not in (None, 0):
                raise ValueError(f"past_len: expected 0 when past_kv is None, got {past_len}")
            return 0
        if not isinstance(past_kv, torch.Tensor):
            raise TypeError(f"past_kv: expected a torch.Tensor or None, got {type(past_kv).__name__}")
        length = past_kv.shape[2] if past_kv.dim() == 5 else -1
        if tuple(past_kv.shape) != cfg.kv_shape(length) or past_kv.dtype != cfg.torch_dtype:
            raise ValueError(
                f"past_kv: expected shape {cfg.kv_shape(-1)} with -1 the past length and dtype "
                f"{cfg.torch_dtype}, got shape {tuple(past_kv.shape)} dtype {past_kv.dtype}"
            )
        if past_len is not None and past_len != length:
            raise ValueError(f"past_len: expected the length of past_kv ({length}), got {past_len}")
        return length

    def prefill(self, tokens: torch.Tensor, past_kv: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """K/V of `tokens` (after `past_kv`, if any) and the greedy token that follows them.

        Only the new tokens' K/V is returned; the sequence's K/V is
        `torch.cat((past_kv, kv), dim=2)`.
        """
        kv, logits = self.forward(tokens, past_kv)
        return kv, greedy_token(logits)

    def decode_step(self, token: int, past_kv: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """K/V of one `token` placed after `past_kv`, shape `(layers, 2, 1, ...)`, and the next token."""
        kv, logits = self.forward(torch.tensor([int(token)], dtype=torch.int64), past_kv)
        return kv, greedy_token(logits)

    def generate(self, prompt_tokens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference decode: one forward over the prompt, then `n` greedy steps.

        Returns the `n` generated tokens (int64, shape `(n,)`) and `full_kv`, the K/V of the prompt
        followed by all `n` tokens (each generated token is fed back, as the next turn of a
        conversation will need its K/V), so `full_kv` equals `monolithic_kv(cat(prompt, tokens))`
        up to rounding. It never stops early, EOS or not.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected an integer >= 0, got {n!r}")
        kv, token = self.prefill(prompt_tokens)
        pieces, generated = [kv], []
        for _ in range(n):
            generated.append(token)
            step_kv, token = self.decode_step(token, torch.cat(pieces, dim=2))
            pieces.append(step_kv)
        return torch.tensor(generated, dtype=torch.int64), torch.cat(pieces, dim=2)

    def monolithic_kv(self, tokens: torch.Tensor) -> torch.Tensor:
        """K/V of `tokens` from one forward pass over all of them at once (the reference)."""
        return self.forward(tokens)[0]

    # -- many sequences, K/V in a pool's pages ---------------------------------------------------

    def forward_paged(
        self,
        pool: torch.Tensor,
        page_tables: Sequence[Sequence[int]],
        starts: Sequence[int],
        tokens: Sequence[Sequence[int]],
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """One batched forward over several requests whose K/V lives in `pool`'s pages.

        `pool` is `(num_pages, layers, 2, page_size, kv_heads, head_dim)` in the model's dtype
        (`KVPool.data`). Request b's new tokens `tokens[b]` sit at positions `starts[b] ..`; its
        K/V for positions `0 .. starts[b]-1` is already in pages `page_tables[b]` (page i holds
        positions `i*page_size ..`). The new tokens' K (after RoPE) and V are written into those
        pages in place, and the logits `(B, vocab)` of each request's last new token come back.
        """
        tables, first, lists = self._check_paged(pool, page_tables, starts, tokens)
        counts = [len(t) for t in lists]
        kv = _PagedKV(pool, tables, first, counts)
        flat = torch.tensor([t for row in lists for t in row], dtype=torch.int64)
        return self._run(flat, kv.positions, kv, kv.last_rows(), on_layer)

    def decode_batch(
        self,
        pool: torch.Tensor,
        page_tables: Sequence[Sequence[int]],
        positions: Sequence[int],
        tokens: Sequence[int],
    ) -> torch.Tensor:
        """One decode step for B requests: `tokens[b]` at `positions[b]`, K/V written into
        `pool[page_tables[b][positions[b] // page_size], :, :, positions[b] % page_size]`;
        returns every request's next-token logits `(B, vocab)`."""
        if not isinstance(tokens, Sequence | torch.Tensor):
            raise TypeError(f"tokens: expected a sequence of ints, got {type(tokens).__name__}")
        return self.forward_paged(pool, page_tables, positions, [[t] for t in list(tokens)])

    def prefill_into(
        self,
        pool: torch.Tensor,
        page_table: Sequence[int],
        start: int,
        tokens: Sequence[int] | torch.Tensor,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """K/V of `tokens` at positions `start ..` (attending to positions `0 .. start-1` already
        in `page_table`'s pages) written into those pages; returns the last token's logits
        `(vocab,)`. Only the increment is computed; `on_layer(i)` hears each layer stored."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        return self.forward_paged(pool, [page_table], [start], [tokens], on_layer)[0]

    def _check_paged(
        self,
        pool: torch.Tensor,
        page_tables: Sequence[Sequence[int]],
        starts: Sequence[int],
        tokens: Sequence[Sequence[int]],
    ) -> tuple[list[list[int]], list[int], list[list[int]]]:
        """`(page_tables, starts, tokens)` checked, as plain ints (numpy or torch ints accepted)."""
        cfg = self.config
        if not isinstance(pool, torch.Tensor) or pool.dim() != 6:
            got = tuple(pool.shape) if isinstance(pool, torch.Tensor) else type(pool).__name__
            raise ValueError(
                "pool: expected shape (num_pages, layers, 2, page_size, kv_heads, head_dim), got " + str(got)
            )
        want = (cfg.layers, 2, pool.shape[3], cfg.kv_heads, cfg.head_dim)
        if tuple(pool.shape[1:]) != want or pool.dtype != cfg.torch_dtype or not pool.is_contiguous():
            raise ValueError(
                f"pool: expected a contiguous (num_pages, {', '.join(map(str, want))}) tensor of "
                f"{cfg.torch_dtype} (page_size {pool.shape[3]}), got {tuple(pool.shape)} {pool.dtype}"
            )
        num_pages, page_size = pool.shape[0], pool.shape[3]
        batch = len(tokens)
        if batch == 0 or len(page_tables) != batch or len(starts) != batch:
            raise ValueError(
                f"page_tables, starts/positions and tokens: expected equal non-zero lengths, got "
                f"{len(page_tables)}, {len(starts)} and {batch}"
            )
        lists: list[list[int]] = []
        tables: list[list[int]] = []
        first: list[int] = []
        written: set[tuple[int, int]] = set()
        for b in range(batch):
            row = [_index(t) for t in tokens[b]]
            start, table = _index(starts[b]), page_tables[b]
            if not row or not all(t is not None and 0 <= t < cfg.vocab for t in row):
                got = list(tokens[b])
                raise ValueError(
                    f"tokens[{b}]: expected a non-empty list of ids in [0, {cfg.vocab}), got {got}"
                )
            if start is None or start < 0:
                raise ValueError(f"positions[{b}]: expected an integer >= 0, got {starts[b]!r}")
            need = -(-(start + len(row)) // page_size)
            if len(table) < need:
                raise ValueError(
                    f"page_tables[{b}]: positions up to {start + len(row) - 1} need {need} pages of "
                    f"{page_size} tokens, got {len(table)}"
                )
            pages = [_index(page) for page in table[:need]]
            for i, page in enumerate(pages):
                if page is None or not 0 <= page < num_pages:
                    raise ValueError(
                        f"page_tables[{b}][{i}]: expected a page in [0, {num_pages}), got {table[i]!r}"
                    )
            table = pages  # type: ignore[assignment]
            for p in range(start, start + len(row)):
                target = (table[p // page_size], p % page_size)
                if target in written:
                    raise ValueError(
                        f"page_tables[{b}]: position {p} would write page {target[0]} slot {target[1]}, "
                        "which another new token of this batch writes too"
                    )
                written.add(target)
            lists.append(row)  # type: ignore[arg-type]
            tables.append(table)  # type: ignore[arg-type]
            first.append(start)
        return tables, first, lists


class TinyModel(LlamaModel):
    """Seeded random weights: the exact tests' model. Equal configs give bit-identical weights."""

    def __init__(self, config: TinyConfig | None = None) -> None:
        cfg = config if config is not None else TinyConfig()
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
        super().__init__(cfg, LlamaWeights(embed=embed, layers=layers, final_norm=final_norm, head=head))


def _index(value: object) -> int | None:
    """`value` as an int if it is an integer of any kind (int, numpy, 0-d tensor) but a bool."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        return int(value) if value.dim() == 0 and not value.is_floating_point() else None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (GPT-NeoX style) over `x` of shape `(n, heads, head_dim)`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, queries_from: int) -> torch.Tensor:
    """Causal GQA attention of queries at positions `queries_from ..` over keys at `0 ..`.

    `q` is `(m, q_heads, head_dim)`, `k`/`v` are `(s, kv_heads, head_dim)` with `s = queries_from + m`;
    returns `(m, q_heads * head_dim)`. Query head `h` reads key head `h // (q_heads / kv_heads)`.
    """
    m, s = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if m == s:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    elif m == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)
    else:
        # Query i sits at position queries_from + i and sees keys 0 .. queries_from + i.
        rows = torch.arange(queries_from, queries_from + m)[:, None]
        mask = torch.arange(s)[None, :] <= rows
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(m, -1)


# -- pages ----------------------------------------------------------------------------------------


def to_pages(kv: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cut `kv` `(layers, 2, length, kv_heads, head_dim)` into pages of `page_size` tokens.

    Returns a new tensor `(num_pages, layers, 2, page_size, kv_heads, head_dim)` with
    `num_pages = ceil(length / page_size)`; the tail of the last partial page is zero. Values are
    copied exactly (no arithmetic).
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected an integer >= 1, got {page_size!r}")
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:
        shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"kv: expected shape (layers, 2, length, kv_heads, head_dim), got {shape}")
    layers, _, length, heads, dim = kv.shape
    num_pages = -(-length // page_size)
    padded = kv.new_zeros((layers, 2, num_pages * page_size, heads, dim))
    padded[:, :, :length] = kv
    pages = padded.view(layers, 2, num_pages, page_size, heads, dim).permute(2, 0, 1, 3, 4, 5)
    return pages.contiguous()  # `padded` is ours, so even a view of it is a fresh tensor


def from_pages(pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens' K/V `(layers, 2, length, kv_heads, head_dim)` held by `pages`.

    `pages` is `(num_pages, layers, 2, page_size, kv_heads, head_dim)` in sequence order, and must
    hold at least `length` tokens. Returns a new contiguous tensor; values are copied exactly.
    """
    if not isinstance(pages, torch.Tensor) or pages.dim() != 6 or pages.shape[2] != 2:
        shape = tuple(pages.shape) if isinstance(pages, torch.Tensor) else type(pages).__name__
        raise ValueError(
            f"pages: expected shape (num_pages, layers, 2, page_size, kv_heads, head_dim), got {shape}"
        )
    num_pages, layers, _, page_size, heads, dim = pages.shape
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= num_pages * page_size:
        raise ValueError(
            f"length: expected an integer in [0, {num_pages * page_size}] ({num_pages} pages of "
            f"{page_size} tokens), got {length!r}"
        )
    kv = pages.permute(1, 2, 0, 3, 4, 5).reshape(layers, 2, num_pages * page_size, heads, dim)
    out = pages.new_empty((layers, 2, length, heads, dim))
    out.copy_(kv[:, :, :length])  # always a fresh tensor: never a view of the caller's pages
    return out

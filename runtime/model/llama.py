"""One Llama-family decoder that computes real K/V for the runtime's nodes, tiny or real.

`LlamaModel` runs any Llama-shaped checkpoint (Llama, Qwen2/2.5, SmolLM, Mistral): token
embedding, then per layer RMSNorm -> GQA attention with RoPE (optionally scaled) and optional
q/k/v biases -> residual, RMSNorm -> SwiGLU MLP -> residual; a final RMSNorm and a tied or untied
output head. The forward pass is written once (`_run`); what differs between callers is only
where the K/V of earlier positions lives:

- `forward` / `prefill` / `decode_step` / `generate`: a contiguous past, one sequence;
- `forward_paged` / `decode_batch` / `prefill_into`: the pages of a KV pool, many sequences at
  once. This is what the nodes serve from: one batched forward per decode step, the new tokens'
  K/V written straight into the pool's pages. `forward_paged` and `prefill_into` check every
  value they are given (`paged_inputs.check_paged`); `decode_batch`, run every step, trusts
  the values the decode node checked when it took them in, and checks only the pool and the
  batch's lengths.

`TinyModel` is the same model with seeded random weights (`TinyConfig`). End-to-end checks
compare assembled K/V with one monolithic pass over the whole sequence, so it runs in float64 by
default: summing in a different order (one pass versus prefix + increment, or a batch) moves
results by ~1e-15, far below the 1e-9 the checks allow, and never flips a greedy token.

K/V layout, shared with the paged pools: a sequence's K/V is one tensor of shape
`(layers, 2, length, kv_heads, head_dim)` (index 0 of the second axis is K, after RoPE, as cached;
1 is V); one page holds all layers' K and V for `page_size` tokens, shape
`(layers, 2, page_size, kv_heads, head_dim)`, and a pool is `(num_pages, *page_shape)`.

The parts live beside this module: the architecture (`llama_config`), the weights
(`llama_weights`), the block's arithmetic (`attention`), where K/V lives (`kv_places`), pages
(`kv_pages`) and the paged batch's checks (`paged_inputs`); every public name is importable from
here.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from hicache.runtime.model.attention import apply_rope, rms_norm, rope_inv_freq
from hicache.runtime.model.kv_pages import from_pages, to_pages
from hicache.runtime.model.kv_places import ContiguousKV, PagedKV
from hicache.runtime.model.llama_config import (
    DTYPES,
    KV_DTYPES,
    MODEL_DTYPES,
    ROPE_KINDS,
    LlamaConfig,
    RopeScaling,
    TinyConfig,
)
from hicache.runtime.model.llama_weights import LlamaLayer, LlamaWeights, build_layer, tiny_weights
from hicache.runtime.model.packed_matrix import PackedMatrix
from hicache.runtime.model.paged_inputs import check_batch_size, check_paged, check_pool

# The model's public names, wherever they are defined: importers name `llama` alone.
__all__ = [
    "DTYPES",
    "KV_DTYPES",
    "MODEL_DTYPES",
    "ROPE_KINDS",
    "LlamaConfig",
    "LlamaLayer",
    "LlamaModel",
    "LlamaWeights",
    "RopeScaling",
    "TinyConfig",
    "TinyModel",
    "build_layer",
    "check_paged",
    "from_pages",
    "greedy_token",
    "rope_inv_freq",
    "to_pages",
]


def greedy_token(logits: torch.Tensor) -> int:
    """The argmax of `logits`; among equal maxima the lowest index (torch.argmax returns the first)."""
    return int(torch.argmax(logits).item())


class _Block:
    """One layer as the forward uses it: its four matrices packed once for the CPU's matmul
    kernel (`PackedMatrix`), its norms and bias as they are."""

    __slots__ = ("attn_norm", "gate_up", "mlp_norm", "qkv", "qkv_bias", "w_down", "wo")

    def __init__(self, layer: LlamaLayer) -> None:
        self.attn_norm, self.mlp_norm, self.qkv_bias = layer.attn_norm, layer.mlp_norm, layer.qkv_bias
        self.qkv = PackedMatrix(layer.qkv)
        self.wo = PackedMatrix(layer.wo)
        self.gate_up = PackedMatrix(layer.gate_up)
        self.w_down = PackedMatrix(layer.w_down)

    def layer(self) -> LlamaLayer:
        return LlamaLayer(
            attn_norm=self.attn_norm,
            qkv=self.qkv.dense(),
            qkv_bias=self.qkv_bias,
            wo=self.wo.dense(),
            mlp_norm=self.mlp_norm,
            gate_up=self.gate_up.dense(),
            w_down=self.w_down.dense(),
        )


class LlamaModel:
    """A Llama-family decoder, no autograd; forward passes over contiguous or paged K/V.

    `eos_token_ids` are the tokens that end a generation (empty for random weights). `kv_dtype`
    is the dtype K/V is kept in (a name from `KV_DTYPES`; default: the model's own dtype): each
    layer's new K and V are rounded to it when stored, and attention reads them back from it, so
    a pool of that dtype holds exactly what every later position attended to. `device` is where
    the weights live and the forward runs (`runtime/model/device.py`); K/V pools handed to the
    paged calls must be there too. Token ids, positions and page tables come in as host values
    and go back as logits on the device: the callers sample there.
    """

    def __init__(
        self,
        config: LlamaConfig,
        weights: LlamaWeights,
        *,
        eos_token_ids: Iterable[int] = (),
        kv_dtype: str | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config: expected a LlamaConfig, got {type(config).__name__}")
        if len(weights.layers) != config.layers:
            raise ValueError(f"weights: expected {config.layers} layers, got {len(weights.layers)}")
        kv_name = config.dtype if kv_dtype is None else kv_dtype
        if kv_name not in KV_DTYPES:
            raise ValueError(f"kv_dtype: expected one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as a tensor's device reads
            self.device = torch.device("cuda", torch.cuda.current_device())
        weights = weights.to(self.device)
        self.kv_dtype_name: str = kv_name
        self.kv_dtype: torch.dtype = KV_DTYPES[kv_name]
        self.eos_token_ids: frozenset[int] = frozenset(int(t) for t in eos_token_ids)
        # The forward's own copy of the weights, matrices packed; `weights` gives them back.
        self._embed, self._final_norm = weights.embed, weights.final_norm
        self._blocks = tuple(_Block(layer) for layer in weights.layers)
        self._head = PackedMatrix(weights.head)
        self._tied = weights.head.data_ptr() == weights.embed.data_ptr()
        self._weights = None if self._head.packed else weights
        self._inv_freq = rope_inv_freq(config)  # (head_dim / 2,), float64
        # Tensor parallelism (`runtime/model/tp_model.py`): the sum over ranks of the row-split
        # o_proj and down projections' partial outputs; None on a whole model.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.full_config: LlamaConfig = config  # the whole model's, also on a rank's part

    @property
    def weights(self) -> LlamaWeights:
        """Every weight in the `LlamaWeights` layout. With packed matrices (float32 and bfloat16
        on a CPU with oneDNN) they are unpacked into new tensors on each call, bit for bit: for
        sharding and checks, not for the forward."""
        if self._weights is not None:
            return self._weights
        embed = self._embed
        head = embed.t() if self._tied else self._head.dense()
        layers = tuple(block.layer() for block in self._blocks)
        return LlamaWeights(embed=embed, layers=layers, final_norm=self._final_norm, head=head)

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
        kv: ContiguousKV | PagedKV,
        last: torch.Tensor,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits of rows `last` of the flat batch `tokens` (each at its position in `positions`).

        Every row's K/V goes to `kv.store`; every row attends through `kv.attend`. At the last
        layer only rows `last` go on (nothing after the last K/V needs the others). `on_layer(i)`
        is called once layer i's K/V is stored (prefill ships it from there, layer by layer).
        """
        cfg = self.config
        q_width, kv_width = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        n = tokens.shape[0]
        cos, sin = self._rope(positions)
        tokens, last = tokens.to(self.device, non_blocking=True), last.to(self.device, non_blocking=True)
        x = self._embed[tokens]  # (n, hidden)
        for index, layer in enumerate(self._blocks):
            h = rms_norm(x, layer.attn_norm, cfg.rms_eps)
            qkv = layer.qkv(h)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            q, k, v = qkv.split((q_width, kv_width, kv_width), dim=1)
            k = apply_rope(k.reshape(n, cfg.kv_heads, cfg.head_dim), cos, sin)
            kv.store(index, k, v.reshape(n, cfg.kv_heads, cfg.head_dim))
            if on_layer is not None:
                on_layer(index)
            rows = None
            if index == cfg.layers - 1 and last.shape[0] < n:
                rows = last
                x, q, cos, sin = x[last], q[last], cos[last], sin[last]
            q = apply_rope(q.reshape(-1, cfg.q_heads, cfg.head_dim), cos, sin)
            attn = layer.wo(kv.attend(index, q, rows))
            x = x + (attn if self.reduce is None else self.reduce(attn))
            h = rms_norm(x, layer.mlp_norm, cfg.rms_eps)
            gate, up = layer.gate_up(h).split(cfg.ffn, dim=1)
            mlp = layer.w_down(F.silu(gate) * up)
            x = x + (mlp if self.reduce is None else self.reduce(mlp))
        if last.shape[0] < x.shape[0]:
            x = x[last]
        logits = self._head(rms_norm(x, self._final_norm, cfg.rms_eps))
        # Sampling works in float32 at least: a bf16 logit has 8 bits of mantissa, too few to
        # tell near-equal tokens apart by anything but rounding.
        return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles are computed per position from exact integer positions, so a position gets the
        # same rotation whether it is reached in one pass, in pieces, or in any batch.
        # On the host, whatever the device: the same float64 arithmetic everywhere.
        angles = torch.outer(positions.cpu().to(torch.float64), self._inv_freq)
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # (n, 1, head_dim)
        dtype, dev = self.config.torch_dtype, self.device
        return torch.cos(angles).to(dev, dtype), torch.sin(angles).to(dev, dtype)

    # -- one sequence, contiguous K/V ------------------------------------------------------------

    def forward(
        self,
        tokens: torch.Tensor,
        past_kv: torch.Tensor | None = None,
        past_len: int | None = None,
        *,
        rows_from: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `n` new tokens at positions `past_len .. past_len+n-1`, and the last one's logits.

        The new tokens attend causally to `past_kv` (shape `(layers, 2, past_len, kv_heads,
        head_dim)`, or None for an empty past) and to themselves. `past_len` defaults to the length
        of `past_kv`; when given it must agree. Returns `kv_new` of shape `(layers, 2, n, kv_heads,
        head_dim)` (K after RoPE, as cached) and the logits of the last new token, shape `(vocab,)`;
        with `rows_from` (0 <= rows_from < n), those of new rows `rows_from ..` `(n - rows_from,
        vocab)` (a prompt's own log-probabilities: each row's logits score the token after it).
        """
        cfg = self.config
        tokens = self._check_tokens(tokens)
        past_len = self._check_past(past_kv, past_len)
        n = tokens.shape[0]
        if rows_from is not None and not 0 <= rows_from < n:
            raise ValueError(f"rows_from: expected 0 <= rows_from < {n} (the new tokens), got {rows_from}")
        kv_new = torch.empty(cfg.kv_shape(n), dtype=self.kv_dtype, device=self.device)
        positions = torch.arange(past_len, past_len + n)
        first = n - 1 if rows_from is None else rows_from
        logits = self._run(
            tokens, positions, ContiguousKV(past_kv, past_len, kv_new, first), torch.arange(first, n)
        )
        return kv_new, (logits[0] if rows_from is None else logits)

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
        wrong = past_kv.dtype != self.kv_dtype or past_kv.device != self.device
        if tuple(past_kv.shape) != cfg.kv_shape(length) or wrong:
            raise ValueError(
                f"past_kv: expected shape {cfg.kv_shape(-1)} with -1 the past length, dtype "
                f"{self.kv_dtype} on {self.device}, got shape {tuple(past_kv.shape)} dtype "
                f"{past_kv.dtype} on {past_kv.device}"
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
        Every argument is checked first (`check_paged`): a `ValueError` names the bad one.
        """
        rows = check_paged(self.config, pool, page_tables, starts, tokens, self.kv_dtype, self.device)
        flat = torch.tensor([t for row in rows.tokens for t in row], dtype=torch.int64)
        return self._paged(pool, rows.tables, rows.starts, [len(t) for t in rows.tokens], flat, on_layer)

    def decode_batch(
        self,
        pool: torch.Tensor,
        page_tables: Sequence[Sequence[int]],
        positions: Sequence[int],
        tokens: Sequence[int],
    ) -> torch.Tensor:
        """One decode step for B requests: `tokens[b]` at `positions[b]`, K/V written into
        `pool[page_tables[b][positions[b] // page_size], :, :, positions[b] % page_size]`;
        returns every request's next-token logits `(B, vocab)`.

        The decode node's per-step call, so it checks only what costs the same for any batch
        (the pool's layout, one page table, position and token per request) and trusts the
        values, which the node checked when it took them in: every token id is in the vocabulary
        (a prompt's when the client sent it, the first token when prefill's answer came, each
        later one drawn from the logits), every page is one the core granted or a scratch page
        of the node's own, one per request, and positions are the node's count of each request's
        K/V, covered by its page table. Values nobody vouched for go through `forward_paged`.
        """
        check_pool(self.config, pool, self.kv_dtype, self.device)
        if not isinstance(tokens, Sequence | torch.Tensor):
            raise TypeError(f"tokens: expected a sequence of ints, got {type(tokens).__name__}")
        check_batch_size(page_tables, positions, tokens)
        starts = [operator.index(p) for p in positions]
        flat = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        return self._paged(pool, page_tables, starts, [1] * len(starts), flat, None)

    def _paged(
        self,
        pool: torch.Tensor,
        page_tables: Sequence[Sequence[int]],
        starts: list[int],
        counts: list[int],
        flat: torch.Tensor,
        on_layer: Callable[[int], None] | None,
    ) -> torch.Tensor:
        kv = PagedKV(pool, page_tables, starts, counts)
        return self._run(flat, kv.positions, kv, kv.last_rows(), on_layer)

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


class TinyModel(LlamaModel):
    """Seeded random weights: the exact tests' model. Equal configs give bit-identical weights."""

    def __init__(
        self,
        config: TinyConfig | None = None,
        *,
        kv_dtype: str | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        cfg = config if config is not None else TinyConfig()
        super().__init__(cfg, tiny_weights(cfg), kv_dtype=kv_dtype, device=device)

"""A small deterministic decoder-only transformer that computes real K/V for the runtime's nodes.

The prefill node runs it over a prompt (or only the part the decode node does not hold) and ships
the K/V in pages; the decode node assembles a request's K/V from pages it restored and pages it
received, then decodes with the same model. End-to-end checks compare that assembled K/V with one
monolithic pass over the whole sequence, so the model runs in float64 by default: summing in a
different order (one pass versus prefix + increment) moves results by ~1e-15, far below the 1e-9
the checks allow, and never flips a greedy token.

Architecture: token embedding, then per layer RMSNorm -> GQA attention with RoPE -> residual,
RMSNorm -> SwiGLU MLP -> residual; a final RMSNorm and an untied output head. Weights are drawn
from one seeded `torch.Generator`, scaled by 1/sqrt(fan-in) so activations stay O(1).

K/V layout, shared with the paged pools: a sequence's K/V is one tensor of shape
`(layers, 2, length, kv_heads, head_dim)` (index 0 of the second axis is K, after RoPE, as cached;
1 is V); one page holds all layers' K and V for `page_size` tokens, shape
`(layers, 2, page_size, kv_heads, head_dim)`.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F

DTYPES: dict[str, torch.dtype] = {"float64": torch.float64, "float32": torch.float32}
_RMS_EPS = 1e-6


def _at_least_one(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TinyConfig.{attribute.name}: expected an integer >= 1, got {value!r}")


@attrs.frozen(slots=True)
class TinyConfig:
    """Shape and seed of a `TinyModel`; equal configs give bit-identical models."""

    layers: int = attrs.field(default=2, validator=_at_least_one)
    q_heads: int = attrs.field(default=4, validator=_at_least_one)
    kv_heads: int = attrs.field(default=2, validator=_at_least_one)
    head_dim: int = attrs.field(default=16, validator=_at_least_one)
    vocab: int = attrs.field(default=512, validator=_at_least_one)
    ffn: int = attrs.field(default=128, validator=_at_least_one)
    seed: int = 0
    dtype: str = "float64"
    rope_base: float = 10000.0

    def __attrs_post_init__(self) -> None:
        if self.q_heads % self.kv_heads != 0:
            raise ValueError(
                f"TinyConfig.q_heads: expected a multiple of kv_heads={self.kv_heads}, got {self.q_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"TinyConfig.head_dim: expected an even number (RoPE), got {self.head_dim}")
        if self.vocab < 2:
            raise ValueError(f"TinyConfig.vocab: expected at least 2 tokens, got {self.vocab}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"TinyConfig.seed: expected an integer in [0, 2**63), got {self.seed!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"TinyConfig.dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")
        base = self.rope_base
        if isinstance(base, bool) or not isinstance(base, int | float) or not 1.0 < base < math.inf:
            raise ValueError(f"TinyConfig.rope_base: expected a finite number > 1, got {base!r}")

    @property
    def d_model(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def kv_shape(self, length: int) -> tuple[int, int, int, int, int]:
        """Shape of the K/V of `length` tokens: `(layers, 2, length, kv_heads, head_dim)`."""
        return (self.layers, 2, length, self.kv_heads, self.head_dim)


@attrs.frozen(slots=True, eq=False)
class _Layer:
    attn_norm: torch.Tensor  # (d_model,)
    wq: torch.Tensor  # (d_model, q_heads * head_dim)
    wk: torch.Tensor  # (d_model, kv_heads * head_dim)
    wv: torch.Tensor  # (d_model, kv_heads * head_dim)
    wo: torch.Tensor  # (q_heads * head_dim, d_model)
    mlp_norm: torch.Tensor  # (d_model,)
    w_gate: torch.Tensor  # (d_model, ffn)
    w_up: torch.Tensor  # (d_model, ffn)
    w_down: torch.Tensor  # (ffn, d_model)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + _RMS_EPS) * weight


def greedy_token(logits: torch.Tensor) -> int:
    """The argmax of `logits`; among equal maxima the lowest index (torch.argmax returns the first)."""
    return int(torch.argmax(logits).item())


class TinyModel:
    """Seeded random weights, CPU only, no autograd; forward passes over a paged-style K/V cache."""

    def __init__(self, config: TinyConfig | None = None) -> None:
        self.config = config if config is not None else TinyConfig()
        cfg = self.config
        dtype = cfg.torch_dtype
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed)

        def draw(rows: int, cols: int) -> torch.Tensor:
            # Drawn in float64 whatever the model's dtype, so float32 models share the same weights.
            w = torch.randn((rows, cols), generator=gen, dtype=torch.float64) / math.sqrt(rows)
            return w.to(dtype)

        def norm_weight() -> torch.Tensor:
            # Near one, but not exactly, so the norm weights take part in every check.
            w = 1.0 + 0.1 * torch.randn((cfg.d_model,), generator=gen, dtype=torch.float64)
            return w.to(dtype)

        d, kv_width = cfg.d_model, cfg.kv_heads * cfg.head_dim
        self._embed = torch.randn((cfg.vocab, d), generator=gen, dtype=torch.float64).to(dtype)
        self._layers = tuple(
            _Layer(
                attn_norm=norm_weight(),
                wq=draw(d, d),
                wk=draw(d, kv_width),
                wv=draw(d, kv_width),
                wo=draw(d, d),
                mlp_norm=norm_weight(),
                w_gate=draw(d, cfg.ffn),
                w_up=draw(d, cfg.ffn),
                w_down=draw(cfg.ffn, d),
            )
            for _ in range(cfg.layers)
        )
        self._final_norm = norm_weight()
        self._head = draw(d, cfg.vocab)
        half = cfg.head_dim // 2
        exponents = torch.arange(half, dtype=torch.float64) * 2.0 / cfg.head_dim
        self._inv_freq = 1.0 / (float(cfg.rope_base) ** exponents)  # (head_dim / 2,), float64

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every weight by name (views, not copies): for comparing models and checksums."""
        out = {"embed": self._embed, "final_norm": self._final_norm, "head": self._head}
        for i, layer in enumerate(self._layers):
            for field in attrs.fields(_Layer):
                out[f"layers.{i}.{field.name}"] = getattr(layer, field.name)
        return out

    # -- the forward pass -------------------------------------------------------------------------

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
        cos, sin = self._rope(past_len, n)
        kv_new = torch.empty(cfg.kv_shape(n), dtype=cfg.torch_dtype)
        x = self._embed[tokens]  # (n, d_model)
        for index, layer in enumerate(self._layers):
            h = _rms_norm(x, layer.attn_norm)
            k = _apply_rope((h @ layer.wk).view(n, cfg.kv_heads, cfg.head_dim), cos, sin)
            v = (h @ layer.wv).view(n, cfg.kv_heads, cfg.head_dim)
            kv_new[index, 0] = k
            kv_new[index, 1] = v
            if index == cfg.layers - 1:
                # Nothing after the last layer's K/V needs any row but the last: only its logits
                # are returned. Its query still attends to every key.
                x, h, cos, sin = x[-1:], h[-1:], cos[-1:], sin[-1:]
                queries_from = past_len + n - 1
            else:
                queries_from = past_len
            q = _apply_rope((h @ layer.wq).view(-1, cfg.q_heads, cfg.head_dim), cos, sin)
            if past_kv is not None and past_len > 0:
                k = torch.cat((past_kv[index, 0], k), dim=0)
                v = torch.cat((past_kv[index, 1], v), dim=0)
            x = x + _attend(q, k, v, queries_from) @ layer.wo
            h = _rms_norm(x, layer.mlp_norm)
            x = x + (F.silu(h @ layer.w_gate) * (h @ layer.w_up)) @ layer.w_down
        logits = _rms_norm(x[-1], self._final_norm) @ self._head
        return kv_new, logits

    def _rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles are computed per position from exact integer positions, so a position gets the
        # same rotation whether it is reached in one pass or in pieces.
        positions = torch.arange(start, start + n, dtype=torch.float64)
        angles = torch.outer(positions, self._inv_freq)
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # (n, 1, head_dim)
        dtype = self.config.torch_dtype
        return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)

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

    # -- conveniences -----------------------------------------------------------------------------

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
        up to rounding.
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

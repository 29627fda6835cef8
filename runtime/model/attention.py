"""The arithmetic of one Llama block that is not a plain matmul: RMSNorm, RoPE (its scaled
frequencies and the rotation) and causal GQA attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hicache.runtime.model.llama_config import LlamaConfig


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype in (torch.float16, torch.bfloat16):
        # As Hugging Face does: normalise in float32, scale in the model's dtype.
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype) * weight
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (GPT-NeoX style) over `x` of shape `(n, heads, head_dim)`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


_HALF = (torch.bfloat16, torch.float16)


def attend_last(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ends: torch.Tensor | None) -> torch.Tensor:
    """Attention of one query per sequence (a decode step) over its keys `0 .. ends[b]-1`.

    `q` is `(B, q_heads, head_dim)`, `k`/`v` are `(B, L, kv_heads, head_dim)` (keys past a
    sequence's end are masked; `ends` None: all L are its keys); returns `(B, q_heads * head_dim)`.
    In float32/float64 this is torch's fused attention; in bfloat16/float16, whose fused CPU
    kernel is 4-5x slower than its float32 one at one query (measured on this project's machine:
    5 ms against 1 ms per layer at batch 8 and 600 keys), two batched matmuls with the softmax in
    float32, as SDPA's math path does.
    """
    b, heads, dim = q.shape
    kv_heads = k.shape[2]
    mask = None
    if ends is not None:
        keys = torch.arange(k.shape[1], device=k.device)
        mask = keys[None, None, None, :] < ends[:, None, None, None]  # (B, 1, 1, L)
    if q.dtype not in _HALF:
        out = F.scaled_dot_product_attention(
            q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        return out[:, :, 0].reshape(b, -1)
    # Query head h reads key head h // group: (B, kv_heads, group, dim) against (B, kv_heads, dim, L).
    qg = q.reshape(b, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * (1.0 / math.sqrt(dim))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).reshape(b, -1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, queries_from: int) -> torch.Tensor:
    """Causal GQA attention of queries at positions `queries_from ..` over keys at `0 ..`.

    `q` is `(m, q_heads, head_dim)`, `k`/`v` are `(s, kv_heads, head_dim)` with `s = queries_from + m`;
    returns `(m, q_heads * head_dim)`. Query head `h` reads key head `h // (q_heads / kv_heads)`.
    """
    m, s = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if m == s:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    elif m == 1:
        return attend_last(q, k[None], v[None], None)
    else:
        # Query i sits at position queries_from + i and sees keys 0 .. queries_from + i.
        rows = torch.arange(queries_from, queries_from + m, device=q.device)[:, None]
        mask = torch.arange(s, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(m, -1)

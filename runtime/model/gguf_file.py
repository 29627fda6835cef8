"""Reading a Llama-family GGUF file (llama.cpp's format) into our config, weights and tokenizer.

`gguf.GGUFReader` maps the file; `gguf.quants.dequantize` turns each tensor (Q4_1, Q8_0, F16, ...)
into float32; names map to our layout below. llama.cpp's converter permutes the rows of Q and K
of `llama`-architecture models so its interleaved RoPE matches Hugging Face's rotate-half RoPE;
we run rotate-half, so that permutation is undone here (transformers does the same). Qwen2 files
are written unpermuted (llama.cpp runs them with NeoX-style RoPE).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache.runtime.model.llama import LlamaConfig, LlamaWeights, RopeScaling, build_layer
from hicache.runtime.model.model_file import read_metadata

# The architectures we run, and whether llama.cpp permuted their Q/K rows.
ARCHITECTURES: dict[str, bool] = {"llama": True, "qwen2": False}


def file_digest(paths: list[Path]) -> str:
    """A short content digest of the weight files: what tells two nodes they hold the same model."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return "sha256:" + digest.hexdigest()[:32]


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, heads)` on the rows of a Q or K projection (or its bias)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def native_dtype(tensors: dict[str, Any]) -> str:
    """The dtype a GGUF file's matrices are stored in, as the model computes in by default
    (`--dtype auto`): float32 / float16 / bfloat16 as stored; a quantized file (Q4_1, Q8_0, ...)
    is dequantized to bfloat16, the dtype its checkpoint was trained and released in for the
    models this runs (SmolLM2, Llama 3, Qwen2.5), and half the bytes of float32."""
    import gguf

    kinds = {t.tensor_type for name, t in tensors.items() if name.endswith("attn_q.weight")}
    plain = {
        gguf.GGMLQuantizationType.F32: "float32",
        gguf.GGMLQuantizationType.F16: "float16",
        gguf.GGMLQuantizationType.BF16: "bfloat16",
    }
    names = {plain.get(k, "bfloat16") for k in kinds}
    return names.pop() if len(names) == 1 else "bfloat16"


def read_gguf(path: Path, *, dtype: str) -> tuple[LlamaConfig, LlamaWeights, dict[str, Any]]:
    """`(config, weights, metadata)` of the model in the GGUF file at `path`, in `dtype`
    ("auto": `native_dtype`)."""
    import gguf  # numpy only, but not needed by the tiny model's users
    from gguf.quants import dequantize

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as err:
        raise ValueError(f"{path}: not a readable GGUF file ({err})") from err
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; expected one of {sorted(ARCHITECTURES)} "
            "(Llama-family: RMSNorm, RoPE, GQA, SwiGLU)"
        )
    tensors = {t.name: t for t in reader.tensors}

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ValueError(f"{path}: metadata {full!r} is missing")
        return meta[full]

    q_heads = int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", q_heads))
    hidden = int(need("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count", 0)))
    head_dim = head_dim or hidden // q_heads
    vocab = int(meta.get(f"{arch}.vocab_size", len(meta.get("tokenizer.ggml.tokens", ()))))
    embed_shape = tuple(tensors["token_embd.weight"].data.shape) if "token_embd.weight" in tensors else ()
    if not embed_shape or embed_shape[0] != vocab:
        raise ValueError(f"{path}: token_embd.weight missing or not {vocab} rows (got {embed_shape})")
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"{path}: partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    tied = "output.weight" not in tensors
    if dtype == "auto":
        dtype = native_dtype(tensors)
    config = LlamaConfig(
        layers=int(need("block_count")),
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        hidden=hidden,
        vocab=vocab,
        ffn=int(need("feed_forward_length")),
        dtype=dtype,
        rope_base=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_scaling=_rope_scaling(path, arch, meta, tensors),
        tied_embeddings=tied,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        name=str(meta.get("general.name", path.stem)),
        weights=file_digest([path]),
    )
    torch_dtype = config.torch_dtype

    def load(name: str, *, heads: int = 0) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name!r} is missing")
        t = tensors[name]
        w = dequantize(t.data, t.tensor_type)
        if heads and ARCHITECTURES[arch]:
            w = _unpermute(w, heads)
        if not w.flags.writeable:  # an unquantized tensor is a read-only view of the mapped file
            w = w.copy()
        return torch.from_numpy(np.ascontiguousarray(w)).to(torch_dtype)

    def matrix(name: str, **kw: int) -> torch.Tensor:
        return load(name, **kw).t()  # stored (out, in); we multiply `x @ w`

    layers = []
    for i in range(config.layers):
        b = f"blk.{i}."
        biases = {}
        if config.qkv_bias:
            biases = {
                "bq": load(b + "attn_q.bias", heads=q_heads),
                "bk": load(b + "attn_k.bias", heads=kv_heads),
                "bv": load(b + "attn_v.bias"),
            }
        layers.append(
            build_layer(
                config,
                attn_norm=load(b + "attn_norm.weight"),
                wq=matrix(b + "attn_q.weight", heads=q_heads),
                wk=matrix(b + "attn_k.weight", heads=kv_heads),
                wv=matrix(b + "attn_v.weight"),
                wo=matrix(b + "attn_output.weight"),
                mlp_norm=load(b + "ffn_norm.weight"),
                w_gate=matrix(b + "ffn_gate.weight"),
                w_up=matrix(b + "ffn_up.weight"),
                w_down=matrix(b + "ffn_down.weight"),
                where=f"{path}: {b[:-1]}",
                **biases,
            )
        )
    embed = load("token_embd.weight")
    head = embed.t() if tied else matrix("output.weight")
    weights = LlamaWeights(
        embed=embed, layers=tuple(layers), final_norm=load("output_norm.weight"), head=head
    )
    return config, weights, meta


def _rope_scaling(path: Path, arch: str, meta: dict[str, Any], tensors: dict[str, Any]) -> RopeScaling | None:
    if (
        "rope_freqs.weight" in tensors
    ):  # Llama 3.1's scaling, as llama.cpp stores it: one divisor per frequency
        from gguf.quants import dequantize

        t = tensors["rope_freqs.weight"]
        factors = dequantize(t.data, t.tensor_type).astype(np.float64).ravel().tolist()
        return RopeScaling(kind="factors", factors=tuple(factors))
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    if kind in ("none", None) and factor in (None, 1.0):
        return None
    if kind in ("linear", "none", None) and factor is not None:
        return RopeScaling(kind="linear", factor=float(factor))
    raise ValueError(f"{path}: RoPE scaling {kind!r} is not supported; expected none, linear or llama3")

"""Reading a local Hugging Face checkpoint directory (`config.json` + `*.safetensors`).

Only what a Llama-family model needs: Llama, Mistral and Qwen2 configs, weights in safetensors
(bfloat16, float16 or float32; cast to the requested dtype), tied or untied head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hicache.runtime.model.gguf_file import file_digest
from hicache.runtime.model.llama import LlamaConfig, LlamaWeights, RopeScaling, build_layer

MODEL_TYPES = ("llama", "mistral", "qwen2")


def read_config(root: Path) -> dict[str, Any]:
    path = root / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{root}: expected config.json (a Hugging Face model directory) or a .gguf file, found neither"
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err


def eos_ids(root: Path, config: dict[str, Any]) -> set[int]:
    """End-of-sequence ids from config.json and generation_config.json (int or list in each)."""
    out: set[int] = set()
    sources = [config]
    gen = root / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text(encoding="utf-8")))
    for source in sources:
        value = source.get("eos_token_id")
        out.update([value] if isinstance(value, int) else (value or []))
    return out


def _rope(path: Path, cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta included); older configs `rope_theta` + `rope_scaling`.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_context=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(f"{path}: rope type {kind!r} is not supported; expected default, linear or llama3")


def native_dtype(cfg: dict[str, Any]) -> str:
    """The dtype config.json says the checkpoint is in (`torch_dtype`, or `dtype` in newer
    files): what the model computes in by default (`--dtype auto`); float32 when it says none."""
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return {"float": "float32", "half": "float16", "bf16": "bfloat16"}.get(str(name), str(name))


def read_hf_dir(root: Path, *, dtype: str) -> tuple[LlamaConfig, LlamaWeights, dict[str, Any]]:
    """`(config, weights, config.json)` of the checkpoint in `root`, in `dtype` ("auto":
    `native_dtype`)."""
    from safetensors import safe_open

    cfg = read_config(root)
    path = root / "config.json"
    kind = cfg.get("model_type")
    if kind not in MODEL_TYPES:
        raise ValueError(f"{path}: model_type {kind!r} is not supported; expected one of {MODEL_TYPES}")
    if cfg.get("mlp_bias") or (kind != "qwen2" and cfg.get("attention_bias")):
        raise ValueError(f"{path}: MLP or output-projection biases are not supported")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: expected *.safetensors weight files next to config.json")
    q_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, scaling = _rope(path, cfg)
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118 (safe_open is no dict)
    tied = bool(cfg.get("tie_word_embeddings", False)) or "lm_head.weight" not in where
    if dtype == "auto":
        dtype = native_dtype(cfg)
    config = LlamaConfig(
        layers=int(cfg["num_hidden_layers"]),
        q_heads=q_heads,
        kv_heads=int(cfg.get("num_key_value_heads") or q_heads),
        head_dim=int(cfg.get("head_dim") or hidden // q_heads),
        hidden=hidden,
        vocab=int(cfg["vocab_size"]),
        ffn=int(cfg["intermediate_size"]),
        dtype=dtype,
        rope_base=theta,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_scaling=scaling,
        tied_embeddings=tied,
        qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias")),
        name=str(cfg.get("_name_or_path") or root.name),
        weights=file_digest(files),
    )

    def load(name: str) -> torch.Tensor:
        if name not in where:
            raise ValueError(f"{root}: tensor {name!r} is missing from {[f.name for f in files]}")
        return where[name].get_tensor(name).to(config.torch_dtype)

    layers = []
    for i in range(config.layers):
        p = f"model.layers.{i}."
        biases = {}
        if config.qkv_bias:
            biases = {f"b{x}": load(f"{p}self_attn.{x}_proj.bias") for x in "qkv"}
        layers.append(
            build_layer(
                config,
                attn_norm=load(p + "input_layernorm.weight"),
                wq=load(p + "self_attn.q_proj.weight").t(),
                wk=load(p + "self_attn.k_proj.weight").t(),
                wv=load(p + "self_attn.v_proj.weight").t(),
                wo=load(p + "self_attn.o_proj.weight").t(),
                mlp_norm=load(p + "post_attention_layernorm.weight"),
                w_gate=load(p + "mlp.gate_proj.weight").t(),
                w_up=load(p + "mlp.up_proj.weight").t(),
                w_down=load(p + "mlp.down_proj.weight").t(),
                where=f"{root}: layer {i}",
                **biases,
            )
        )
    embed = load("model.embed_tokens.weight")
    head = embed.t() if tied else load("lm_head.weight").t()
    weights = LlamaWeights(embed=embed, layers=tuple(layers), final_norm=load("model.norm.weight"), head=head)
    return config, weights, cfg

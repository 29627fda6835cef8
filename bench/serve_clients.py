"""What the serving benchmarks share: a real client in a virtualenv of its own (nothing of this
project in it), and a `hicache serve` process that stops when the block ends."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@contextlib.contextmanager
def hicache_serve(args: list[str], log: Path) -> Iterator[dict[str, Any]]:
    """`hicache serve ARGS` with its stderr in `log`; yields its ready line (url, model, ...)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"hicache serve did not start: {log.read_text()[-2000:]}")
        yield json.loads(line)
    finally:
        proc.terminate()
        proc.wait(30)

"""`hicache serve` checks its flags and files before any node loads the model: a bad value is
one line naming the flag, and exit 2, without a node started (runtime/serve_checks.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import hicache

pytestmark = pytest.mark.process


def one_line(*args: str) -> tuple[int, list[str]]:
    done = hicache("serve", *args, timeout=60)
    assert done.stdout == ""  # no ready line: nothing started
    return done.returncode, done.stderr.strip().splitlines()


def test_an_unreadable_api_keys_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "keys.toml"
    code, lines = one_line("--api-keys", str(missing))
    assert code == 2
    assert lines == [f"hicache serve: --api-keys {missing}: cannot read it (No such file or directory)"]


def test_a_malformed_api_keys_file_names_the_file_and_the_problem(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nkey = "short"\n')
    code, lines = one_line("--api-keys", str(keys))
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"hicache serve: --api-keys {keys}") and "key" in lines[0]


def test_a_busy_port_is_one_line_and_exit_2() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, lines = one_line("--port", str(port))
    assert code == 2
    assert lines == [f"hicache serve: --port {port}: cannot listen on 127.0.0.1:{port} (in use)"]


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda d: d / "nope.gguf", "no such file or folder"),
        (
            lambda d: _write(d / "notes.txt", b"hello"),
            "not a GGUF file (expected a .gguf file or a Hugging Face folder)",
        ),
        (lambda d: _folder(d / "model"), "a folder without config.json (not a Hugging Face model)"),
    ],
    ids=["missing", "not-gguf", "folder-without-config"],
)
def test_a_bad_model_path_is_one_line_and_exit_2(tmp_path: Path, make: object, reason: str) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    code, lines = one_line("--model", str(path))
    assert code == 2
    assert lines == [f"hicache serve: --model {path}: {reason}"]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


def test_the_front_door_reads_the_model_without_loading_torch() -> None:
    """The front door needs the tokenizer and the context length, not the tensor library: torch
    would be about 100 MB of its RSS for nothing (the nodes compute)."""
    probe = (
        "import sys\n"
        "from hicache.runtime.serve import load_model_source\n"
        "source = load_model_source('default')\n"
        "print(source.context_length, source.name, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["8192", "SmolLM2-135M-Instruct", "False"]


def test_the_serve_command_itself_never_imports_torch() -> None:
    """The process that parses serve's flags and becomes the front door checks that torch is
    installed (its nodes compute with it) without importing it. Driven up to the last check
    before it would start the nodes, torch is still not loaded."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    probe = (
        "import sys\n"
        "from hicache.cli import main\n"
        f"code = main(['serve', '--port', '{port}', '--served-model-name', ' '])\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr
    assert "--served-model-name" in done.stderr

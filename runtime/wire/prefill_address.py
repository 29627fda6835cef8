"""Where a decode node finds its prefill node: a fixed HOST:PORT, or a file the prefill node
rewrites each time it starts listening.

A prefill node restarted on another port (or another machine) is found again only if the
decode node looks it up again: with an address file (`hicache node prefill --address-file F`,
`hicache node decode --prefill-file F`), every new control connection reads the file first, so
the next transfer after a restart reaches the new node. The file is replaced atomically (a
reader sees the old address or the new one, never half of one).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from pathlib import Path

import attrs

MAX_FILE_BYTES = 1024


def parse(text: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) with a port in 1..65535; ValueError otherwise."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, got {text.strip()[:80]!r}")
    return host, int(port)


def advertised(host: str) -> str:
    """The address peers should dial for a node listening on `host`: a wildcard address means
    every interface, which no peer can dial, so the machine's name stands in for it."""
    return socket.gethostname() if host in ("", "0.0.0.0", "::") else host


def write(path: Path, host: str, port: int) -> None:
    """Replace `path` with `host:port` atomically."""
    shown = f"[{host}]" if ":" in host else host
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_text(f"{shown}:{port}\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@attrs.frozen
class PrefillAddress:
    """A fixed address, or the file holding the current one."""

    fixed: tuple[str, int] | None = None
    file: Path | None = None

    def __attrs_post_init__(self) -> None:
        if (self.fixed is None) == (self.file is None):
            raise ValueError("PrefillAddress: give exactly one of an address and an address file")

    def resolve(self) -> tuple[str, int]:
        """The address to dial now; `OSError` (the file cannot be read) or `ValueError`."""
        if self.fixed is not None:
            return self.fixed
        assert self.file is not None
        with self.file.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            raise ValueError(f"{self.file}: over {MAX_FILE_BYTES} bytes, expected one HOST:PORT line")
        try:
            return parse(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"{self.file}: {exc}") from None

    def __str__(self) -> str:
        if self.fixed is not None:
            return f"{self.fixed[0]}:{self.fixed[1]}"
        return f"the address in {self.file}"

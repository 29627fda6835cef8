"""Start a prefill and a decode node (or `hicache serve`) as separate local processes, and stop
them cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio


class NodeFailed(RuntimeError):
    """A node process exited before it was ready; the message carries its stderr, `reason` its
    last line (a node that cannot start says why in one line), `log` the file that has it all."""

    def __init__(self, name: str, log: Path) -> None:
        text = log.read_text(errors="replace")
        # The last line that says something: not the frame of an exception group's traceback.
        said = [t for t in (line.strip(" |") for line in text.splitlines()) if t.strip("+-")]
        self.name, self.log = name, log
        self.reason = said[-1] if said else "it exited without a word"
        super().__init__(f"{name} node did not start: {text[-2000:]}")


@attrs.define(eq=False)
class NodeProcess:
    """A node started with `python -m hicache node ...` (or another command that prints one JSON
    readiness line, such as `hicache serve`); `info` is its readiness line."""

    proc: subprocess.Popen
    info: dict[str, Any]
    stderr_path: Path

    @property
    def port(self) -> int:
        return int(self.info["port"])

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited (negative: the signal that ended it), else None."""
        return self.proc.poll()

    def stderr(self) -> str:
        """What it wrote to stderr so far (all of it once it exited)."""
        return self.stderr_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then wait (SIGKILL past `timeout`); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def start_node(
    args: Sequence[str],
    log_dir: Path,
    name: str,
    timeout: float = 120.0,
    *,
    command: Sequence[str] = ("node",),
) -> NodeProcess:
    """Run `hicache node ARGS...` and wait for its readiness line on stdout; its stderr goes to
    `log_dir/NAME.stderr`. `command` names another subcommand that prints such a line
    (`("serve",)`: `hicache serve ARGS...`)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stderr_path = log_dir / f"{name}.stderr"
    cmd = [sys.executable, "-m", "hicache", *command, *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with stderr_path.open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env)

    def first_line() -> bytes:
        assert proc.stdout is not None
        return proc.stdout.readline()

    try:
        with trio.move_on_after(timeout):
            line = await trio.to_thread.run_sync(first_line, abandon_on_cancel=True)
            if line:
                return NodeProcess(proc, json.loads(line), stderr_path)
    except BaseException:  # cancelled (Ctrl-C) while it starts: no node outlives its starter
        proc.kill()
        proc.wait()
        raise
    proc.kill()
    proc.wait()
    raise NodeFailed(name, stderr_path)

"""Watching the node processes `hicache serve` started, and the nodes it was attached to.

A started node that exits is noticed within `POLL_S`: its exit status and the last lines of its
stderr are logged, the front door's health goes down at once (`/health` and `/health_generate`
answer 503 naming it), and the node is started again with the same arguments, as long as it
has not been restarted `max_restarts` times within `window_s` (by default 3 in 10 minutes). Past
that, or with `max_restarts=0`, `NodeDied` ends `serve`, which stops the other nodes and exits
non-zero (SGLang's behaviour when a scheduler process dies).

A restarted prefill node rewrites its address file, which every decode node re-reads when it
reconnects (`--prefill-file`), so a transfer's retries find it on its new port; a restarted
decode node gets a new port, which `on_restart` hands to the front door's backend.

Attached nodes (`--decode`, `--prefill`) are not ours to restart: they are checked every
`interval_s` (a decode node answers `stats`; a prefill node accepts a connection), and the
front door's health follows the answers.
"""

from __future__ import annotations

import collections
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio

from hicache.runtime.launch import NodeFailed, NodeProcess, start_node
from hicache.runtime.serving.health import Health

log = logging.getLogger("hicache.runtime.serve")

POLL_S = 0.1  # how often a started node's process is looked at
TAIL_LINES = 12  # lines of a dead node's stderr put in the log
CHECK_TIMEOUT_S = 5.0


class NodeDied(Exception):
    """A node exited and is not restarted; one line with its name, status and why not."""


def exit_status(code: int) -> str:
    """`1`, or `-9 (SIGKILL)` for a node a signal ended."""
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


def tail(text: str, lines: int = TAIL_LINES) -> str:
    kept = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n".join(f"    {line}" for line in kept) or "    (nothing)"


@attrs.define(eq=False)
class Supervised:
    """One node process started by `hicache serve`: how to start it again, and what to tell."""

    name: str
    args: tuple[str, ...]  # `hicache node ARGS...`
    process: NodeProcess
    on_restart: Callable[[NodeProcess], None] | None = None
    restarts: collections.deque[float] = attrs.field(factory=collections.deque)


class Supervisor:
    """Watches every node added to it; `run` returns only by raising `NodeDied`."""

    def __init__(
        self,
        logs: Path,
        health: Health,
        *,
        max_restarts: int = 3,
        window_s: float = 600.0,
        start: Callable[..., Awaitable[NodeProcess]] = start_node,
    ) -> None:
        self.logs = logs
        self.health = health
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._start = start
        self.nodes: list[Supervised] = []

    def add(
        self,
        name: str,
        args: list[str],
        process: NodeProcess,
        on_restart: Callable[[NodeProcess], None] | None = None,
    ) -> Supervised:
        node = Supervised(name, tuple(args), process, on_restart)
        self.nodes.append(node)
        return node

    def processes(self) -> list[NodeProcess]:
        """The nodes' current processes, in the order they were added."""
        return [n.process for n in self.nodes]

    def stop_all(self) -> None:
        """Stop every node, the last started first (decode nodes before their prefill nodes)."""
        for node in reversed(self.nodes):
            node.process.stop()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for node in self.nodes:
                nursery.start_soon(self._watch, node)

    async def _watch(self, node: Supervised) -> None:
        while True:
            while node.process.returncode is None:
                await trio.sleep(POLL_S)
            await self._restart(node)

    async def _restart(self, node: Supervised) -> None:
        proc = node.process
        status = exit_status(proc.returncode or 0)
        log.error(
            "the %s node (pid %d) exited with status %s; the last lines of its stderr (%s):\n%s",
            node.name,
            proc.pid,
            status,
            proc.stderr_path,
            tail(proc.stderr()),
        )
        self.health.down(f"the {node.name} node", f"exited with status {status}")
        now = trio.current_time()
        while node.restarts and node.restarts[0] < now - self.window_s:
            node.restarts.popleft()
        if len(node.restarts) >= self.max_restarts:
            why = (
                "--node-restarts 0: a node that exits ends serve"
                if not self.max_restarts
                else f"it was restarted {len(node.restarts)} times in the last {self.window_s:.0f} s"
            )
            raise NodeDied(f"the {node.name} node exited with status {status}; not restarted: {why}")
        node.restarts.append(now)
        attempt = len(node.restarts)
        log.warning(
            "restarting the %s node (restart %d of at most %d)", node.name, attempt, self.max_restarts
        )
        try:
            node.process = await self._start(list(node.args), self.logs, f"{node.name}.restart{attempt}")
        except NodeFailed as exc:
            raise NodeDied(
                f"the {node.name} node exited with status {status}, and did not start again: {exc.reason} "
                f"(log: {exc.log})"
            ) from None
        if node.on_restart is not None:
            node.on_restart(node.process)
        log.warning("the %s node is back (pid %d, port %d)", node.name, node.process.pid, node.process.port)
        self.health.up(f"the {node.name} node")


async def check_attached(
    name: str,
    health: Health,
    probe: Callable[[], Awaitable[object]],
    interval_s: float,
) -> None:
    """Probe a node `hicache serve` did not start, every `interval_s`, forever; its health
    follows the answers (a probe that raises or takes over `CHECK_TIMEOUT_S` is a miss)."""
    part = f"the {name}"  # "the decode node at H:P"
    while True:
        try:
            with trio.fail_after(CHECK_TIMEOUT_S):
                await probe()
        except (OSError, EOFError, trio.TooSlowError, trio.BrokenResourceError) as exc:
            health.down(part, f"does not answer ({type(exc).__name__}: {exc or 'no answer'})")
        except Exception as exc:  # a protocol error: it answers, but not as a node should
            health.down(part, f"answers wrongly ({type(exc).__name__}: {exc})")
        else:
            health.up(part)
        await trio.sleep(interval_s)


async def tcp_probe(host: str, port: int) -> None:
    """A node accepts connections (a prefill node's control port, whose hello needs the secret)."""
    stream = await trio.open_tcp_stream(host, port)
    await stream.aclose()

"""Helpers shared by the tests: node processes, ports, the `hicache` command in a child Python,
and the scenario steps that drive a decode-node core inside `kvworld`'s ground-truth `World`.

Node processes. Every test that starts a node (or `hicache serve`) does it through
`runtime.launch.start_node`, the launcher `hicache run --runtime` and `hicache serve` use
themselves: it waits for the one JSON readiness line on stdout, keeps stderr in a log file, and
a node that cannot start fails with `NodeFailed`, whose message carries that log. Async tests
call `start_prefill` / `start_decode` (or `start_node` with arguments of their own); sync tests
hold one in a `with running(...)` block, stopped with SIGTERM when the block ends.

Importing this module is cheap (no torch, no model): the quick tier's files import it too.
"""

from __future__ import annotations

import atexit
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import trio
from kvworld import World

from hicache.core import commands as cmd
from hicache.core.states import State
from hicache.core.tree import TREE
from hicache.runtime.launch import NodeFailed, NodeProcess, start_node

__all__ = ["NodeFailed", "NodeProcess", "start_node"]

# ============================================================================ processes

READY_S = 120.0  # a guard for a node's readiness line, never a speed assertion


def free_port() -> int:
    """A port nothing listens on (the system just handed it out and took it back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hicache(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m hicache ARGS...` run to its end in a child Python, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "hicache", *args], capture_output=True, text=True, timeout=timeout
    )


def prefill_args(page: int, *extra: str, engine: str = "tcp") -> list[str]:
    """`hicache node` arguments for a prefill node on `engine` with pages of `page` tokens."""
    return ["prefill", "--engine", engine, "--page-size", str(page), *extra]


def decode_args(prefill: NodeProcess, page: int, *extra: str, engine: str = "tcp") -> list[str]:
    """`hicache node` arguments for a decode node fed by `prefill` (on loopback)."""
    at = ["--prefill", f"127.0.0.1:{prefill.port}"]
    return ["decode", "--engine", engine, *at, "--page-size", str(page), *extra]


async def start_prefill(
    logs: Path, page: int, *extra: str, engine: str = "tcp", name: str = "prefill"
) -> NodeProcess:
    """A prefill node process (`prefill_args`), once it said it is ready."""
    return await start_node(prefill_args(page, *extra, engine=engine), logs, name)


async def start_decode(
    prefill: NodeProcess, logs: Path, page: int, *extra: str, engine: str = "tcp", name: str = "decode"
) -> NodeProcess:
    """A decode node process (`decode_args`) fed by `prefill`, once it said it is ready."""
    return await start_node(decode_args(prefill, page, *extra, engine=engine), logs, name)


def _scratch() -> Path:
    """A fresh folder for logs, removed when this Python exits (so a test can still read a
    stopped node's stderr)."""
    folder = Path(tempfile.mkdtemp(prefix="hicache-test-logs-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@contextmanager
def running(
    *args: str,
    logs: Path | None = None,
    name: str | None = None,
    command: Sequence[str] = ("node",),
    timeout: float = READY_S,
    stop_s: float = 30.0,
) -> Iterator[NodeProcess]:
    """`hicache node ARGS...` (or `hicache serve ARGS...` with `command=("serve",)`) for a sync
    test, through `start_node`: ready when the block starts, stopped with SIGTERM (SIGKILL past
    `stop_s`) when it ends. Its stderr goes to `logs/NAME.stderr` (without `logs`, a folder
    removed when the test run ends) and stays readable after the block: `NodeProcess.stderr()`."""
    name = name or (args[0] if tuple(command) == ("node",) and args else command[0])
    folder = _scratch() if logs is None else logs
    proc = trio.run(partial(start_node, args, folder, name, timeout, command=command))
    try:
        yield proc
    finally:
        proc.stop(stop_s)


# ============================================================================ kvworld scenarios
# Steps of a scenario that drives one decode-node core inside the ground-truth `World`
# (`tests/kvworld.py`): what it commanded, and the completions a well-behaved driver feeds back.


def cmds(w: World, kind: type, since: int = 0) -> list[Any]:
    """The commands of `kind` the core gave since `w.log[since]`."""
    return [c for c in w.log[since:] if isinstance(c, kind)]


def only(w: World, kind: type, since: int = 0) -> Any:
    """The one command of `kind` given since `w.log[since]`; fails unless there is exactly one."""
    found = cmds(w, kind, since)
    assert len(found) == 1, found
    return found[0]


def transfers_of(w: World, rid: str, since: int = 0) -> list[cmd.RequestKV]:
    return [c for c in cmds(w, cmd.RequestKV, since) if c.req == rid]


def put_in_l3(w: World, toks: list[int]) -> list[int]:
    """Make shared storage hold every full page of `toks` (as another decode node would have)."""
    keys = w.keys_of(toks)
    for k in keys:
        w.l3[k] = k
    return keys


def complete_transfers(w: World, rid: str) -> None:
    for tid in sorted(t for t, c in w.transfers.items() if c.req == rid):
        w.kv_arrive(tid)


def complete_loads(w: World) -> None:
    for op in sorted(w.loads):
        w.load_done(op)


def run_to_decode(w: World, rid: str, limit: int = 20) -> None:
    """Complete whatever is outstanding (queries, prefetches, loads, transfers) until `rid`
    reaches the decode batch; the world checks its KV when it does."""
    r = w.core.requests[rid]
    for _ in range(limit):
        if r.state is State.RUNNING:
            return
        for op in sorted(w.queries):
            w.answer_query(op)
        for op in sorted(w.prefetches):
            w.prefetch_done(op)
        complete_loads(w)
        for tid in sorted(w.transfers):
            w.kv_arrive(tid)
        w.tick()
    assert r.state is State.RUNNING, f"{rid} never reached the decode batch: {r.state}"


def finish_and_back_up(w: World, rid: str) -> None:
    """Finish a running request and complete the backups (and L3 stores) its pages cause."""
    w.finish(rid)
    for _ in range(4):
        for op in sorted(w.backups):
            w.backup_done(op)
        for op in sorted(w.stores):
            w.store_done(op)
    w.tick()


def assert_clean(w: World) -> None:
    """Nothing is held for a request that ended: no receipts, no references, no slot owned by
    a request or an operation, and every invariant of the node holds."""
    core = w.core
    core.check()
    assert core.tree.live_locks == []
    assert core.tree.live_pins == []
    for node in core.tree.nodes():
        assert node.lock_ref == 0 and node.host_ref == 0, node
    for pool in (core.device_pool, core.host_pool):
        for s in range(pool.capacity):
            assert pool.owner_of(s) in (None, TREE), (pool.name, s, pool.owner_of(s))
    assert core.reserved == 0


def admit_with_l3(w: World, rid: str, toks: list[int], cap: int | None = None) -> cmd.Prefetch:
    """Arrive, admit, answer the L3 query (optionally capped) and return the prefetch started."""
    start = len(w.log)
    w.arrive(rid, toks)
    w.tick()
    q = only(w, cmd.QueryStorage, start)
    mark = len(w.log)
    w.answer_query(q.op, None if cap is None else {rid: cap})
    w.tick()
    return only(w, cmd.Prefetch, mark)

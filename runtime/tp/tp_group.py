"""The process group of a tensor-parallel decode node, and the watchdog around its collectives.

Rank 0 is the process the operator started (`hicache node decode --tp-size N`): it opens a TCP
store on its `--host` and starts ranks 1..N-1 as ordinary `hicache node decode` processes with
the same flags plus `--tp-rank R --tp-store HOST:PORT`. Plain subprocesses rather than
`torch.multiprocessing`: each rank starts exactly as a single-rank node does (its own model,
pools, transfer engine, trio loop; no fork of a process that may hold a CUDA context), its
stderr is rank 0's, and rank 0 owns their lifetime (it stops them when it stops). Once every
rank has reached its prefill node, they form a `torch.distributed` group over the store: gloo
on CPU, NCCL for the model's all-reduces on CUDA with a gloo group beside it for the objects.

No collective may wait forever. Each runs in a worker thread under gloo's own timeout and a
trio deadline past it; before each one a rank writes where it is (round, phase) to the store.
When a collective fails, the rank works out who is to blame — a rank process that exited, a
rank that is not where this one is, rank 0's store gone — and the node ends on every surviving
rank with one line naming the rank and the collective (`TPFailure`) and exit status 3.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import trio

log = logging.getLogger("hicache.runtime.decode")
EXIT_STATUS = 3  # a TP group that lost a rank
START_TIMEOUT_S = 300.0  # every rank loads its model and reaches prefill within this
# c10d logs a lost peer with a C++ backtrace; the rank's own one line says it better.
BEAT_S = 0.2
QUIET_TORCH = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}


class TPFailure(Exception):
    """The TP group cannot go on; the message is one line naming the rank and the collective."""


def _status(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"status {code}"


class TPGroup:
    """One rank's view of the group: its collectives, each watched, and (on rank 0) the others."""

    def __init__(
        self,
        rank: int,
        size: int,
        store: dist.TCPStore,
        timeout: float,
        *,
        device: str = "cpu",
        children: Sequence[subprocess.Popen] = (),
    ) -> None:
        self.rank, self.size, self.store, self.timeout = rank, size, store, timeout
        self.device = device
        self.children = list(children)
        self.parent = os.getppid()
        self.round = 0
        self._phase = 0
        self._cpu: Any = None  # the gloo group for objects and agreements
        self._model: Any = None  # the group of the model's all-reduces
        self.collectives = 0

    # ------------------------------------------------------------------ start

    @classmethod
    def lead(cls, size: int, host: str, timeout: float, argv: Sequence[str], device: str) -> TPGroup:
        """Rank 0: open the store and start ranks 1..size-1 with `argv` (this node's flags)."""
        store = dist.TCPStore(
            host, 0, size, True, datetime.timedelta(seconds=START_TIMEOUT_S), wait_for_workers=False
        )
        where = f"{host}:{store.port}"
        children = []
        for r in range(1, size):
            cmd = [sys.executable, "-m", "hicache", *argv, "--tp-rank", str(r), "--tp-store", where]
            children.append(
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=QUIET_TORCH)
            )
        return cls(0, size, store, timeout, device=device, children=children)

    @classmethod
    def join(cls, rank: int, size: int, where: tuple[str, int], timeout: float, device: str) -> TPGroup:
        """Ranks 1..size-1: reach rank 0's store."""
        store = dist.TCPStore(
            where[0], where[1], size, False, datetime.timedelta(seconds=min(START_TIMEOUT_S, 30.0))
        )
        return cls(rank, size, store, timeout, device=device)

    async def ready(self) -> None:
        """Wait until every rank is up (rank 0 notices a rank that exits meanwhile), then form
        the process group; its collectives time out after `timeout`."""
        self.store.set(f"up/{self.rank}", "1")
        keys = [f"up/{r}" for r in range(self.size)]
        deadline = trio.current_time() + START_TIMEOUT_S
        while not self.store.check(keys):
            for r, child in enumerate(self.children, start=1):
                if child.poll() is not None:
                    raise TPFailure(
                        f"rank {r} exited ({_status(child.returncode)}) while starting; its reason is above"
                    )
            if trio.current_time() > deadline:
                missing = [r for r in range(self.size) if not self.store.check([f"up/{r}"])]
                raise TPFailure(f"rank {missing[0]} did not start within {START_TIMEOUT_S:g} s")
            await trio.sleep(0.05)
        await trio.to_thread.run_sync(self._init_group)

    def _init_group(self) -> None:
        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg", self.store),
            rank=self.rank,
            world_size=self.size,
            timeout=datetime.timedelta(seconds=self.timeout),
        )
        self._model = dist.group.WORLD
        self._cpu = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        self.store.set_timeout(datetime.timedelta(seconds=min(self.timeout, 2.0)))
        threading.Thread(target=self._beat, name=f"tp-heartbeat-{self.rank}", daemon=True).start()

    def _beat(self) -> None:
        """Count up `beat/<rank>` in the store while this process runs: a rank that is alive but
        stuck (stopped, hung) is told apart from one merely slow to join by a count that stalls."""
        while True:
            try:
                self.store.add(f"beat/{self.rank}", 1)
            except (RuntimeError, OSError):
                return  # rank 0's store is gone: the next collective says so
            time.sleep(BEAT_S)

    def _beats(self) -> dict[int, int]:
        return {r: self.store.add(f"beat/{r}", 0) for r in range(self.size) if r != self.rank}

    # ------------------------------------------------------------------ collectives

    def _enter(self, kind: str) -> None:
        self._phase += 1
        self.store.set(f"at/{self.rank}", f"{self.round} {self._phase} {kind}")

    def next_round(self) -> None:
        self.round += 1
        self._phase = 0

    async def _watched(self, kind: str, fn: Callable[[], Any]) -> Any:
        """Run collective `fn` in a worker thread; a failure or a wait past the timeout becomes
        a `TPFailure` naming the rank to blame."""

        def run() -> Any:
            self._enter(kind)
            return fn()

        with trio.move_on_after(self.timeout + 2.0):
            try:
                result = await trio.to_thread.run_sync(run, abandon_on_cancel=True)
            except (RuntimeError, ValueError, OSError, pickle.PickleError) as exc:
                raise TPFailure(self.blame(kind, exc)) from None
            self.collectives += 1
            return result
        raise TPFailure(self.blame(kind, None))

    async def exchange(self, payload: Any) -> list[Any]:
        """Every rank's `payload`, in rank order (one all_gather_object)."""
        out: list[Any] = [None] * self.size

        def gather() -> list[Any]:
            dist.all_gather_object(out, payload, group=self._cpu)
            return out

        return await self._watched("exchange", gather)

    async def agree_min(self, kind: str, keys_digest: int, values: Sequence[int]) -> list[int]:
        """The minimum over ranks of each value (one all_reduce); the ranks must have entered
        with the same keys, which the digest and its negation (reduced alongside) show."""
        t = torch.tensor([*values, keys_digest, -keys_digest], dtype=torch.int64)

        def reduce() -> torch.Tensor:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._cpu)
            return t

        got = (await self._watched(f"agree({kind})", reduce)).tolist()
        if got[-2] != keys_digest or got[-1] != -keys_digest:
            raise TPFailure(f"the ranks entered agree({kind}) over different keys; they are out of step")
        return got[:-2]

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The model's reduce (called on the decode step's worker thread)."""
        dist.all_reduce(t, group=self._model)
        return t

    async def decode_step(self, fn: Callable[[], Any]) -> Any:
        return await self._watched("decode step", fn)

    # ------------------------------------------------------------------ blame and exit

    def blame(self, kind: str, exc: BaseException | None) -> str:
        """One line: which rank left collective `kind`, and how this rank knows."""
        # A peer's connection drops a moment before its process is seen to end: look a while.
        end = time.monotonic() + 1.0
        try:
            beats = self._beats() if self.rank == 0 or not self.store.check(["stop"]) else {}
        except (RuntimeError, ValueError, OSError):
            beats = {}
        while True:
            for r, child in enumerate(self.children, start=1):
                if child.poll() is not None:
                    return f"rank {r} exited ({_status(child.returncode)}) during {kind}"
            if self.rank != 0 and os.getppid() != self.parent:
                return f"rank 0 is gone (its process ended) during {kind}"
            if time.monotonic() >= end:
                break
            time.sleep(0.02)
        try:
            if self.rank != 0 and self.store.check(["stop"]):
                return ""  # rank 0 is stopping the node: not a failure
            where = {}
            for r in range(self.size):
                if r != self.rank:
                    rnd, phase, what = self.store.get(f"at/{r}").decode().split(" ", 2)
                    where[r] = (int(rnd), int(phase), what)
        except (RuntimeError, ValueError, OSError):
            return f"rank 0 is gone (its store does not answer) during {kind}"
        wait = f"{self.timeout:g} s"
        try:
            stalled = [r for r, n in self._beats().items() if beats.get(r) == n]
        except (RuntimeError, ValueError, OSError):
            stalled = []
        if stalled:
            r = stalled[0]
            return f"rank {r} did not join {kind} of round {self.round} within {wait} (it stopped answering)"
        mine = (self.round, self._phase)
        behind = [r for r, (rnd, phase, _) in where.items() if (rnd, phase) < mine]
        if behind:
            r = behind[0]
            return (
                f"rank {r} did not join {kind} of round {self.round} within {wait} "
                f"(it is at {where[r][2]} of round {where[r][0]})"
            )
        said = str(exc).splitlines()[0][:160] if exc is not None and str(exc) else "no answer"
        return f"a rank left {kind} of round {self.round} ({said})"

    def stop_children(self, grace: float = 5.0) -> None:
        """Rank 0: tell the other ranks the node is stopping, SIGTERM them, and reap them."""
        if not self.children:
            return
        with contextlib.suppress(RuntimeError, OSError):
            self.store.set("stop", "1")
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace
        for child in self.children:
            try:
                child.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

    def fail(self, reason: str) -> None:
        """End this rank now: the line on stderr, the other ranks stopped (rank 0), exit 3.
        `os._exit`: a collective's worker thread may still be blocked in gloo."""
        if not reason:  # rank 0 stopped the node while this rank waited on it
            os._exit(0)
        line = f"hicache node decode: rank {self.rank}: {reason}"
        log.error("%s", line)
        print(line, file=sys.stderr, flush=True)
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        end = time.monotonic() + 2.0
        for child in self.children:
            try:
                child.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
        sys.stdout.flush()
        os._exit(EXIT_STATUS)

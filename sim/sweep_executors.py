"""Where a sweep's runs execute: one run simulated and saved, and the executors that run many
(a local process pool or a Ray cluster). A run's results depend only on its scenario and seed."""

import json
import multiprocessing
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import attrs

from hicache.scenarios.scenario import parse_scenario
from hicache.sim.runner import run_baselines
from hicache.sim.sweep_plan import FORMAT, SweepError, SweepRun

EXECUTORS = ("local", "ray")
RAY_HINT = "pip install 'hicache[ray]'"
RAY_CONNECT_TIMEOUT_S = 10.0


# --- one run --------------------------------------------------------------------------------


def execute_run(run: SweepRun) -> dict[str, Any]:
    """Simulate one run (every baseline of its scenario); the document its file holds."""
    scenario = parse_scenario(run.scenario, run.source)
    start = time.perf_counter()
    results = run_baselines(scenario)
    wall = time.perf_counter() - start
    return {
        "format": FORMAT,
        "id": run.id,
        "seed": run.seed,
        "overrides": dict(run.overrides),
        "scenario": run.scenario,
        "baselines": {k: {"summary": r.summary, "channels": r.channels} for k, r in results.items()},
        "wall_s": wall,
    }


def run_path(out: Path, rid: str) -> Path:
    return out / "runs" / f"{rid}.json"


def write_json(path: Path, doc: Any) -> None:
    """Write to a temporary name, then rename: readers see the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_run(out: Path, run: SweepRun) -> dict[str, Any] | None:
    """The saved result of `run`, or None when there is none or it is not whole (every baseline
    of its scenario with a summary)."""
    baselines = run.scenario["run"]["baselines"]
    try:
        doc = json.loads(run_path(out, run.id).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("id") != run.id or doc.get("format") != FORMAT:
        return None
    saved = doc.get("baselines")
    if not isinstance(saved, dict) or any(
        not isinstance(saved.get(b), dict) or "summary" not in saved[b] for b in baselines
    ):
        return None
    return doc


# --- executors ------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class Finished:
    """What an executor reports for one run: its document, or the error that ended it."""

    id: str
    doc: dict[str, Any] | None = attrs.field(repr=False)
    error: str | None = None


Executor = Callable[[Sequence[SweepRun]], Iterator[Finished]]


def _attempt(run: SweepRun) -> Finished:
    try:
        return Finished(run.id, execute_run(run))
    except Exception as exc:  # a failing run stops no other run
        return Finished(run.id, None, repr(exc))


def _pool_context() -> multiprocessing.context.BaseContext:
    if sys.platform != "win32" and "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        # The server imports the simulator once; each worker forks from that clean interpreter
        # (which has run no numba kernel and started no thread) instead of importing it again.
        ctx.set_forkserver_preload([__name__])
        return ctx
    return multiprocessing.get_context("spawn")


def local_executor(workers: int | None = None) -> Executor:
    """Runs in a process pool of `workers` (default: every CPU); one worker runs in this process."""
    count = workers if workers is not None else (os.cpu_count() or 1)
    if count < 1:
        raise SweepError(f"--workers: expected an integer >= 1, got {count}")

    def execute(runs: Sequence[SweepRun]) -> Iterator[Finished]:
        n = min(count, len(runs))
        if n <= 1:
            for run in runs:
                yield _attempt(run)
            return
        with ProcessPoolExecutor(max_workers=n, mp_context=_pool_context()) as pool:
            pending = {pool.submit(execute_run, r): r.id for r in runs}
            try:
                while pending:
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in sorted(done, key=pending.__getitem__):
                        rid = pending.pop(fut)
                        error = fut.exception()
                        yield Finished(rid, None, repr(error)) if error else Finished(rid, fut.result())
            finally:
                for fut in pending:
                    fut.cancel()

    return execute


def ray_executor(address: str | None = None, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> Executor:
    """One Ray task per run, on the cluster at `address` (else `RAY_ADDRESS`, else a local
    instance). Every node needs hicache installed, and a trace workload's file at its path.
    The address is checked here, before anything runs: `ray.init` retries an unreachable head
    for minutes."""
    try:
        import ray  # optional: imported only when asked for
    except ImportError:
        raise SweepError(f"--executor ray: Ray is not installed; {RAY_HINT}") from None
    address = address or os.environ.get("RAY_ADDRESS") or None
    check_ray_address(address, timeout_s)

    def execute(runs: Sequence[SweepRun]) -> Iterator[Finished]:
        started = not ray.is_initialized()
        if started:
            ray.init(address=address)
        task = ray.remote(execute_run)
        pending = {task.remote(r): r.id for r in runs}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    rid = pending.pop(ref)
                    try:
                        yield Finished(rid, ray.get(ref))
                    except Exception as exc:
                        yield Finished(rid, None, repr(exc))
        finally:
            for ref in pending:
                ray.cancel(ref)
            if started:
                ray.shutdown()

    return execute


def ray_endpoint(address: str) -> tuple[str, int] | None:
    """The host and port that `address` (`HOST:PORT` or `ray://HOST:PORT`) names; None for
    the addresses Ray resolves itself (`auto`, `local`)."""
    text = address.strip()
    if text in ("auto", "local"):
        return None
    rest = text.split("://", 1)[1] if "://" in text else text
    host, sep, port = rest.rstrip("/").rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SweepError(f"--ray-address: {address!r}: expected HOST:PORT, ray://HOST:PORT or auto")
    return host, int(port)


def check_ray_address(address: str | None, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Fail within `timeout_s` when nothing accepts connections at `address` (None: Ray starts
    a local instance, nothing to reach)."""
    if address is None:
        return
    endpoint = ray_endpoint(address)
    if endpoint is None:
        return
    try:
        socket.create_connection(endpoint, timeout=timeout_s).close()
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise SweepError(
            f"--ray-address: cannot reach the Ray cluster at {address} within {timeout_s:g} s "
            f"({reason}); is its head node running (ray start --head) and the port open?"
        ) from None


def make_executor(name: str, workers: int | None = None, ray_address: str | None = None) -> Executor:
    if name == "local":
        return local_executor(workers)
    if name == "ray":
        return ray_executor(ray_address)
    raise SweepError(f"--executor: unknown executor {name!r}; expected one of: {', '.join(EXECUTORS)}")

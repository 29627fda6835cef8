"""The supervisor of `hicache serve` (runtime/supervisor.py) on real OS processes that stand in
for nodes (a child Python that prints a readiness line and sleeps, so no model loads): a killed
one is noticed, logged with its exit status and the last lines of its stderr, health goes down
at once and comes back after the restart, and the restart budget ends it with `NodeDied`.
Attached nodes are probed over real sockets. The same on `hicache serve` itself, with the real
model: tests/test_serve_supervision.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

from hicache.runtime.launch import NodeProcess
from hicache.runtime.serving.health import Health
from hicache.runtime.supervisor import NodeDied, Supervisor, check_attached, exit_status, tcp_probe

pytestmark = pytest.mark.process

GUARD_S = 30  # a guard against hangs, never a speed assertion
STAND_IN = (
    "import sys, time; print('%s', file=sys.stderr, flush=True); "
    "print('{\"port\": %d}', flush=True); time.sleep(600)"
)


def stand_in(logs: Path, name: str, port: int) -> NodeProcess:
    """A process that says it is ready on `port`, writes a line to stderr and sleeps."""
    logs.mkdir(parents=True, exist_ok=True)
    err = logs / f"{name}.stderr"
    with err.open("wb") as f:
        code = STAND_IN % (f"{name} was here", port)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=f)
    assert proc.stdout is not None
    return NodeProcess(proc, json.loads(proc.stdout.readline()), err)


async def wait_for(condition: object) -> None:
    with trio.fail_after(GUARD_S):
        while not condition():  # type: ignore[operator]
            await trio.sleep(0.02)


async def test_a_killed_node_is_logged_marked_down_and_restarted_until_its_budget_is_spent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    health = Health()
    started: list[NodeProcess] = []
    moved: list[int] = []

    async def start(args: Sequence[str], logs: Path, name: str) -> NodeProcess:
        await trio.sleep(0.3)  # a node takes a while to start (its model loads)
        proc = stand_in(logs, name, 5000 + len(started))
        started.append(proc)
        return proc

    supervisor = Supervisor(tmp_path, health, max_restarts=1, window_s=600, start=start)
    first = stand_in(tmp_path, "decode", 4000)
    supervisor.add("decode", ["decode", "--port", "0"], first, on_restart=lambda p: moved.append(p.port))
    caplog.set_level(logging.INFO, "hicache")
    try:
        with pytest.RaisesGroup(
            pytest.RaisesExc(NodeDied, match="restarted 1 times"), flatten_subgroups=True
        ):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(supervisor.run)
                os.kill(first.pid, signal.SIGKILL)
                await wait_for(lambda: not health.ok)
                assert health.problem() == "the decode node: exited with status -9 (SIGKILL)"
                await wait_for(lambda: started and health.ok)
                assert moved == [5000]  # the front door was told where the new one listens
                assert supervisor.processes() == started
                logged = caplog.text
                assert f"the decode node (pid {first.pid}) exited with status -9 (SIGKILL)" in logged
                assert "decode was here" in logged  # the last lines of its stderr
                started[0].proc.terminate()  # a second death within the window: past the budget
                await wait_for(lambda: not health.ok)
    finally:
        supervisor.stop_all()
    assert all(p.returncode is not None for p in [first, *started])


async def test_with_no_restarts_the_first_death_ends_it(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, Health(), max_restarts=0)
    node = stand_in(tmp_path, "prefill", 4001)
    supervisor.add("prefill", ["prefill"], node)
    why = r"the prefill node exited with status -15 \(SIGTERM\); not restarted: --node-restarts 0"
    try:
        with pytest.RaisesGroup(pytest.RaisesExc(NodeDied, match=why), flatten_subgroups=True):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(supervisor.run)
                node.proc.terminate()
                with trio.fail_after(GUARD_S):
                    await trio.sleep_forever()
    finally:
        supervisor.stop_all()


def test_exit_statuses_name_their_signal() -> None:
    assert exit_status(-9) == "-9 (SIGKILL)"
    assert exit_status(1) == "1"
    assert exit_status(-200) == "-200"


async def test_an_attached_node_that_stops_answering_is_down_until_it_answers_again() -> None:
    health = Health()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def probe() -> None:
        await tcp_probe("127.0.0.1", port)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(check_attached, "prefill node at here", health, probe, 0.05)
        await trio.sleep(0.2)  # a few probes answered
        assert health.ok
        for listener in listeners:
            await listener.aclose()
        await wait_for(lambda: not health.ok)
        assert "the prefill node at here: does not answer" in (health.problem() or "")
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        await wait_for(lambda: health.ok)
        nursery.cancel_scope.cancel()
    for listener in listeners:
        await listener.aclose()

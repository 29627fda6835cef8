"""`hicache serve` watching the nodes it started, on real processes and the default model: a
decode node and a prefill node killed with SIGKILL are noticed at once (/health goes 503, the
log names the exit status), restarted, and served from again; requests in flight while the
prefill node restarts on another port are not lost (its decode node finds it through the
address file). With `--node-restarts 0` the first death ends serve with exit 1 and takes the
other node down (SGLang's behaviour)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
from helpers import NodeProcess, running

pytestmark = [pytest.mark.process, pytest.mark.real_model]

READY_S = 600  # loading the default model on a loaded machine: a guard, never a speed assertion
GUARD_S = 120  # noticing, restarting (a model load) and answering: a guard against hangs


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code
    except httpx.TransportError:
        return 0


def wait_for(condition: Callable[[], bool], guard: float = GUARD_S) -> None:
    deadline = time.monotonic() + guard
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def ask(url: str, question: str) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=GUARD_S)
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
    )


def test_killed_nodes_are_noticed_restarted_and_requests_in_flight_survive_prefill(tmp_path: Path) -> None:
    with running(
        "--log-dir", str(tmp_path / "nodes"), command=("serve",), logs=tmp_path, timeout=READY_S
    ) as serve:
        url, pids = serve.info["url"], serve.info["pids"]
        assert health(url) == 200
        assert ask(url, "Name a colour.").choices[0].message.content

        os.kill(pids["decode"], signal.SIGKILL)
        wait_for(lambda: health(url) == 503, guard=10)
        said = httpx.get(f"{url}/health", timeout=10).json()["error"]["message"]
        assert "the decode node: exited with status -9 (SIGKILL)" in said
        line = f"the decode node (pid {pids['decode']}) exited with status -9 (SIGKILL)"
        wait_for(lambda: line in serve.stderr(), guard=10)
        wait_for(lambda: health(url) == 200)
        assert ask(url, "Name a fruit.").choices[0].message.content  # the new decode node answers

        # Six requests in flight, then the prefill node dies; it restarts on another port.
        answers: list[object] = []

        def one(i: int) -> None:
            try:
                answers.append(ask(url, f"Tell me a short fact about the number {i}. " * 20))
            except Exception as exc:  # noqa: BLE001 - the test reports every failure below
                answers.append(exc)

        clients = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for c in clients:
            c.start()
        time.sleep(0.2)
        os.kill(pids["prefill"], signal.SIGKILL)
        wait_for(lambda: health(url) == 503, guard=10)
        for c in clients:
            c.join(GUARD_S)
        failed = [a for a in answers if isinstance(a, Exception)]
        assert len(answers) == 6 and not failed, failed
        assert f"the prefill node (pid {pids['prefill']}) exited with status -9 (SIGKILL)" in serve.stderr()
        wait_for(lambda: health(url) == 200)
        assert ask(url, "Name a river.").choices[0].message.content


def test_without_restarts_a_dead_node_ends_serve_and_its_other_node(tmp_path: Path) -> None:
    with running(
        "--log-dir",
        str(tmp_path / "nodes"),
        "--node-restarts",
        "0",
        command=("serve",),
        logs=tmp_path,
        timeout=READY_S,
    ) as serve:
        pids = serve.info["pids"]
        os.kill(pids["decode"], signal.SIGKILL)
        code = _exit_code(serve)
        last = serve.stderr().strip().splitlines()[-1]
        assert code == 1
        assert last == (
            "hicache serve: the decode node exited with status -9 (SIGKILL); not restarted: "
            "--node-restarts 0: a node that exits ends serve"
        )
        wait_for(lambda: not alive(pids["prefill"]), guard=30)


def _exit_code(serve: NodeProcess) -> int:
    return serve.proc.wait(GUARD_S)

"""Real processes that die and come back: requests span a prefill restart, at a new address too,
and a client whose decode node dies is told so.

Before: after a prefill SIGKILL the three transfer attempts ran back to back, so every request
of the restart window failed; a prefill restarted on another port was never found; a decode
SIGKILL reached its client as a bare `EOFError`.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import trio

from hicache.runtime.launch import NodeProcess, start_node
from hicache.runtime.wire.client import DecodeClient, NodeGone

pytestmark = pytest.mark.process

PAGE = 16
LIMIT_S = 120  # a guard against hangs, never a speed assertion


def prompt(seed: int, n: int = 70) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


async def start_pair(tmp_path: Path, *decode_flags: str) -> tuple[NodeProcess, NodeProcess, Path]:
    logs, address = tmp_path / "logs", tmp_path / "prefill.address"
    prefill = await start_prefill(logs, address, "prefill")
    try:
        args = ["decode", "--engine", "tcp", "--page-size", str(PAGE), "--prefill-file", str(address)]
        decode = await start_node([*args, "--no-storage", *decode_flags], logs, "decode")
    except BaseException:
        prefill.kill()
        raise
    return prefill, decode, address


async def start_prefill(logs: Path, address: Path, name: str) -> NodeProcess:
    args = ["prefill", "--engine", "tcp", "--page-size", str(PAGE), "--address-file", str(address)]
    return await start_node(args, logs, name)


async def test_a_request_sent_while_prefill_restarts_elsewhere_is_served(tmp_path: Path) -> None:
    """Prefill is killed; a request arrives while none runs; a new prefill starts on another
    port a second later. The decode node's retries back off across the gap, re-read the
    address file, and the request finishes."""
    prefill, decode, address = await start_pair(tmp_path)
    restarted: NodeProcess | None = None
    try:
        client = await DecodeClient.connect("127.0.0.1", decode.port)
        with trio.fail_after(LIMIT_S):
            first, _ = await client.generate("before", prompt(1), 2)
        assert first["outcome"] == "finished", first
        old = address.read_text()
        prefill.kill()
        replies: dict[str, dict] = {}

        async def ask() -> None:
            replies["during"], _ = await client.generate("during", prompt(2), 2)

        with trio.fail_after(LIMIT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                await trio.sleep(1.0)  # the first attempts fail: nothing listens
                restarted = await start_prefill(tmp_path / "logs", address, "prefill-2")
        assert address.read_text() != old  # another port: only the file could tell
        assert replies["during"]["outcome"] == "finished", replies["during"]
        stats = await client.stats()
        assert stats["transfer_retries"] >= 1  # it did fail first, and was retried
        await client.aclose()
    finally:
        decode.kill()
        prefill.kill()
        if restarted is not None:
            restarted.kill()


async def test_without_backoff_the_restart_window_fails_the_request(tmp_path: Path) -> None:
    """The same gap with retries sent at once: the request fails, with the reason. (What the
    backoff above buys.)"""
    prefill, decode, _ = await start_pair(tmp_path, "--transfer-backoff", "0")
    try:
        client = await DecodeClient.connect("127.0.0.1", decode.port)
        prefill.kill()
        with trio.fail_after(LIMIT_S):
            reply, _ = await client.generate("alone", prompt(3), 2)
        assert reply["outcome"] == "failed"
        assert "prefill transfer failed after 7 attempts" in reply["reason"], reply["reason"]
        await client.aclose()
    finally:
        decode.kill()
        prefill.kill()


async def test_a_client_whose_decode_node_dies_is_told_which_request_has_no_answer(tmp_path: Path) -> None:
    prefill, decode, _ = await start_pair(tmp_path)
    try:
        client = await DecodeClient.connect("127.0.0.1", decode.port)
        os.kill(prefill.proc.pid, signal.SIGSTOP)  # the request waits on prefill...
        with trio.fail_after(LIMIT_S):
            async with trio.open_nursery() as nursery:

                async def kill_decode() -> None:
                    await trio.sleep(0.5)
                    decode.kill()  # ...when its decode node dies

                nursery.start_soon(kill_decode)
                with pytest.raises(NodeGone) as gone:
                    await client.generate("stranded", prompt(4), 2)
        text = str(gone.value)
        assert f"decode node at 127.0.0.1:{decode.port}" in text
        assert "without answering request 'stranded'" in text and "outcome is unknown" in text
        with pytest.raises(NodeGone, match="is gone: it closed the connection and refuses new ones"):
            await client.generate("next", prompt(5), 2)
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
        decode.kill()
        prefill.kill()

"""Crash consistency of L3: a writer killed with SIGKILL at any moment leaves whole pages or none.

A page file is written under a temporary name and renamed into place, so a killed writer can
leave a temporary file but never a partial page under a page's name; the next store to open the
directory (a restarted decode node) removes the temporaries whose writer is gone (the name
carries the writer's host and pid; a live writer's are kept, `tests/test_storage_os_errors.py`).
Checked twice:

- a process writing pages through `FileStore` without pause (`tests/crash_writer.py`, whose
  page contents follow from their keys) is killed at several random moments; after each, a new
  `FileStore` on the directory removes every temporary file, and every key reads either as a
  miss or as exactly the bytes written for it — every page file present reads whole;
- a `hicache node decode` process serving multi-turn conversations (so that it keeps storing
  finished pages to L3) is killed at a random moment, restarted on the same directory, and the
  conversations are continued: every page it serves, restored from L3 or not, is bit-identical to
  bytes computed for it (`KVLedger`), and its tokens equal greedy generation.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import trio
from crash_writer import BATCH, LAYOUT, key_of, page_of
from helpers import NodeProcess, start_node, start_prefill
from helpers import decode_args as node_decode_args

from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.storage.file_store import KEY_FILE, SUFFIX, FileStore
from hicache.runtime.verify import KVLedger
from hicache.runtime.wire import protocol
from hicache.runtime.wire.client import DecodeClient

WRITER = Path(__file__).with_name("crash_writer.py")
ROUNDS = 6
SPACING = 1_000_000  # page indices of one round's writer start this far after the last round's


def temporaries(root: Path) -> list[Path]:
    """Every file but the pages and the store's key file (`FileStore` writes the latter once)."""
    return sorted(
        p for p in root.rglob("*") if p.is_file() and not p.name.endswith(SUFFIX) and p.name != KEY_FILE
    )


def index_of(key: int) -> int:
    """The writer's page index of `key` (`key_of` is a bijection of the 64-bit integers)."""
    return (key - key_of(0)) * pow(key_of(1) - key_of(0), -1, 1 << 64) % (1 << 64)


async def check_round(store: FileStore, root: Path, first: int) -> int:
    """The pages of the writer that started at index `first`: their files are those of a prefix
    of its pages (it writes in order), each reads exactly as written, and the pages after them
    read as misses. Returns how many there are."""
    indices = sorted(
        i
        for p in root.rglob(f"*{SUFFIX}")
        if first <= (i := index_of(int(p.name[:16], 16))) < first + SPACING
    )
    assert indices == list(range(first, first + len(indices))), "the pages on disk are not a prefix"
    n = len(indices)
    pool = KVPool(LAYOUT, 32)
    rows = pool.bytes_view().numpy()
    for start in range(first, first + n, 32):
        keys = [key_of(i) for i in range(start, min(start + 32, first + n))]
        pool.bytes_view().fill_(0)
        assert await store.get(keys, pool, range(len(keys))) == len(keys)
        for j, key in enumerate(keys):
            assert np.array_equal(rows[j], page_of(key)), f"page {start + j} differs from what was written"
    for i in range(first + n, first + n + BATCH):  # the batch the kill interrupted, and the next
        assert await store.get([key_of(i)], pool, [0]) == 0, f"page {i} reads, but it has no file"
    return len(indices)


@pytest.mark.process
async def test_a_writer_killed_at_random_moments_leaves_whole_pages_or_none(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    rng = random.Random(20240611)
    leftovers: list[int] = []
    pages: list[int] = []
    launcher = subprocess.Popen(
        [sys.executable, str(WRITER), str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert launcher.stdin is not None and launcher.stdout is not None and launcher.stderr is not None

    async def answer() -> list[str]:
        with trio.fail_after(120):
            line = await trio.to_thread.run_sync(launcher.stdout.readline)  # type: ignore[union-attr]
        assert line, launcher.stderr.read().decode(errors="replace")[-2000:]  # type: ignore[union-attr]
        return line.decode().split()

    try:
        for round_ in range(ROUNDS):
            launcher.stdin.write(f"go {round_ * SPACING}\n".encode())
            launcher.stdin.flush()
            word, pid = await answer()
            assert word == "ready"
            await trio.sleep(rng.uniform(0.0, 0.2))
            os.kill(int(pid), signal.SIGKILL)
            assert await answer() == ["ended", pid, str(signal.SIGKILL)]  # killed, not finished
            left = temporaries(root)
            leftovers.append(len(left))
            store = FileStore(root, LAYOUT)  # what a restarted decode node does first
            assert store.leftovers_removed == len(left)
            assert temporaries(root) == []
            # This writer's pages read whole or not at all.
            pages.append(await check_round(store, root, round_ * SPACING))
            assert pages[-1] >= BATCH  # its first batch completed before it said "ready"
            await store.aclose()
    finally:
        launcher.stdin.close()
        launcher.kill()
        launcher.wait()
        shutil.rmtree(root, ignore_errors=True)
    assert sum(leftovers) > 0, "no kill landed inside a write: the test proved nothing"
    print(f"\n{ROUNDS} kills: temporary files removed {leftovers}, pages written {pages}")


# ============================================================================ a decode node

PAGE = 16
MAX_NEW = 8
FIRST_PROMPT = 35  # with MAX_NEW and NEW_TOKENS, no turn ends on a page boundary (see below)
NEW_TOKENS = 32
CONVERSATIONS = 3


def decode_args(prefill: NodeProcess, storage: Path) -> list[str]:
    args = ["--l1-pages", "256", "--l2-pages", "512", "--storage-dir", str(storage)]
    return node_decode_args(
        prefill, PAGE, *args, "--prefetch-threshold-tokens", str(PAGE), "--decode-reserve-tokens", "16"
    )


class Conversation:
    """A conversation whose turns are sent one after the other. Its first token is its own, so
    no page is shared with another conversation."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.rng = np.random.default_rng(index)
        self.prompt = [500 + index] + self.rng.integers(0, 500, FIRST_PROMPT - 1).tolist()
        self.replied: list[tuple[list[int], dict]] = []  # (prompt, reply) of every answered turn

    def next_prompt(self, rng: np.random.Generator) -> list[int]:
        prompt, reply = self.replied[-1]
        return prompt + reply["tokens"] + rng.integers(0, 500, NEW_TOKENS).tolist()


@pytest.mark.process
async def test_a_decode_node_killed_while_storing_restarts_and_serves_exact_kv(tmp_path: Path) -> None:
    """Every turn's prompt length is 3 or 11 mod 16 and outputs are 8 tokens, so the KV pages of a
    turn that was in flight at the kill (whose reply never came, so the ledger does not know
    them) never share a key with the turns replayed afterwards: those take their new tokens from
    another generator. Everything they restore was first computed for a turn that was answered."""
    logs, storage = tmp_path / "logs", tmp_path / "l3"
    model = TinyModel(TinyConfig())
    ledger = KVLedger(model, PAGE)
    rng = random.Random(7)
    kill_after = rng.randint(6, 9)  # replies before the kill
    prefill = await start_prefill(logs, PAGE)
    decode: NodeProcess | None = None
    try:
        decode = await start_node(decode_args(prefill, storage), logs, "decode")
        conversations = [Conversation(i) for i in range(CONVERSATIONS)]
        replies = 0
        enough = trio.Event()

        async def talk(conv: Conversation, port: int) -> None:
            nonlocal replies
            client = await DecodeClient.connect("127.0.0.1", port)
            prompt = conv.prompt
            try:
                for turn in range(100):
                    reply, kv = await client.generate(f"c{conv.index}t{turn}", prompt, MAX_NEW, verify=True)
                    assert ledger.check(prompt, MAX_NEW, reply, kv) == [], reply
                    conv.replied.append((prompt, reply))
                    replies += 1
                    if replies >= kill_after:
                        enough.set()
                    prompt = conv.next_prompt(conv.rng)
            except (protocol.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, EOFError):
                return  # the node was killed under this request
            finally:
                await client.aclose()

        async with trio.open_nursery() as nursery:
            for conv in conversations:
                nursery.start_soon(talk, conv, decode.port)
            with trio.fail_after(300):
                await enough.wait()
            await trio.sleep(rng.uniform(0.0, 0.05))  # stores of the turns just answered are in flight
            decode.kill()  # SIGKILL
        assert decode.proc.returncode == -9
        assert all(c.replied for c in conversations)
        left = temporaries(storage)

        decode = await start_node(decode_args(prefill, storage), logs, "decode-restarted")
        assert decode.info["leftovers_removed"] == len(left)
        assert temporaries(storage) == []
        client = await DecodeClient.connect("127.0.0.1", decode.port)
        after = np.random.default_rng(1000)  # new tokens unlike any sent before the kill
        restored = 0
        for conv in conversations:
            last_prompt, _ = conv.replied[-1]
            for rid, prompt in (
                (f"again{conv.index}", last_prompt),
                (f"next{conv.index}", conv.next_prompt(after)),
            ):
                with trio.fail_after(120):
                    reply, kv = await client.generate(rid, prompt, MAX_NEW, verify=True)
                assert ledger.check(prompt, MAX_NEW, reply, kv) == [], reply
                restored += reply["account"]["l3"]
        await client.aclose()
        assert restored > 0, "nothing was restored from the L3 the killed node left"
        print(
            f"\nkilled after {kill_after} replies; {len(left)} temporaries removed; {restored} tokens from L3"
        )
    finally:
        if decode is not None:
            decode.kill()
        prefill.kill()


@pytest.mark.parametrize("turns", [0, 1, 5])
def test_no_turn_of_a_conversation_ends_on_a_page_boundary(turns: int) -> None:
    """The premise of the replay above: a turn's prompt plus its output never fills its last
    page, so the next turn's new tokens always share a page with the previous turn's output."""
    length = FIRST_PROMPT + turns * (MAX_NEW + NEW_TOKENS)
    assert (length + MAX_NEW) % PAGE != 0

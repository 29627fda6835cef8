"""Multi-turn chat traffic played on a real `hicache serve` and recorded with `--record-trace`:
what the digital twin is checked against (`bench/twin_check.py`, and the twin's real-node test in
`tests/test_twin.py`).

    with hicache_serve(["--page-size", "16"], log) as ready:   # its ready line: url, model, ...
        play(ready["url"], conversations=3, turns=4, max_new=8)
    record(path, l1_pages=12, ratio=1.0, conversations=3, turns=4, max_new=8)
    drop_warmup(path)

The traffic: `conversations` chats of `turns` turns (a system prompt, short questions, answers of
`max_new` tokens, greedy), sent one request at a time round-robin over the chats, each turn
extending its chat's history (so a turn finds its chat's earlier pages on the node unless L1 and
L2 lost them). `record` serves it with page size 16, blocks of 16 tokens in the recording and no
storage (so L2 capacity decides hits). A client of the `hicache` command, over HTTP: it imports
nothing of the runtime.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SYSTEM = "You are a travel guide. Answer in two short sentences."
QUESTIONS = [
    "Tell me about {city}.",
    "What is the weather like there in spring?",
    "Which museum should I not miss?",
    "How do I get there from the airport?",
    "Where should I stay for a quiet night?",
    "What is a good day trip from there?",
    "What should I eat there?",
    "Is it expensive?",
]
CITIES = ["Paris", "Rome", "Madrid", "Vienna", "Prague", "Lisbon", "Berlin", "Oslo", "Athens", "Dublin"]
PAGE = 16


@contextlib.contextmanager
def hicache_serve(args: list[str], log: Path) -> Iterator[dict[str, Any]]:
    """`hicache serve ARGS` with its stderr in `log`; yields its ready line (url, model, ...)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"hicache serve did not start: {log.read_text()[-2000:]}")
        yield json.loads(line)
    finally:
        proc.terminate()
        proc.wait(30)


def generate(url: str, text: str, session: str, max_new: int) -> str:
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0},
        "session_params": {"id": session},
    }
    req = urllib.request.Request(
        f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())["text"]


def play(url: str, conversations: int, turns: int, max_new: int) -> None:
    """The client traffic: the same texts every time (greedy answers), one request at a time."""
    histories = [f"<|im_start|>system\n{SYSTEM}<|im_end|>\n" for _ in range(conversations)]
    for k in range(turns):
        for c in range(conversations):
            question = QUESTIONS[k % len(QUESTIONS)].format(city=CITIES[c % len(CITIES)])
            histories[c] += f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
            histories[c] += generate(url, histories[c], f"chat{c}", max_new) + "<|im_end|>\n"


def record(path: Path, *, l1_pages: int, ratio: float, conversations: int, turns: int, max_new: int) -> float:
    """Serve the traffic on a real node, recording it into `path`; returns the wall seconds."""
    args = [
        "--page-size",
        str(PAGE),
        "--l1-pages",
        str(l1_pages),
        "--hicache-ratio",
        str(ratio),
        "--decode-reserve-tokens",
        str(PAGE),
        "--hicache-storage-backend",
        "none",
        "--record-trace",
        str(path),
        "--record-block-size",
        str(PAGE),
    ]
    start = time.perf_counter()
    with hicache_serve(args, path.with_suffix(".log")) as ready:
        generate(ready["url"], "warm up", "warmup", 1)  # the first request pays the model's warm-up
        play(ready["url"], conversations, turns, max_new)
    return time.perf_counter() - start


def drop_warmup(path: Path) -> None:
    """The warm-up request is not part of the traffic: remove its line (session 0, the first)."""
    lines = path.read_text().splitlines()
    kept = [lines[0]] + [ln for ln in lines[1:] if json.loads(ln).get("session_id") != 0]
    path.write_text("\n".join(kept) + "\n")

"""`hicache serve` with two prefill and two decode nodes behind one front door: each
conversation's next turn is routed by the cache-aware router to the decode node holding its
history (reported by the nodes themselves), both prefill nodes serve, and the cache flags the
operator gave reach every decode node."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx2 as httpx
import pytest
from helpers import running

pytestmark = [pytest.mark.process, pytest.mark.real_model]

PAGE = 16
SYSTEM = "You are a terse assistant. Answer in at most ten words."


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("serve-cluster")
    args = ["--prefill-nodes", "2", "--decode-nodes", "2", "--router", "cache_aware"]
    args += ["--page-size", str(PAGE), "--l1-pages", "96", "--hicache-ratio", "1.5"]
    args += ["--prefetch-threshold-tokens", str(PAGE), "--num-reserved-decode-tokens", str(2 * PAGE)]
    args += ["--log-dir", str(tmp / "logs")]
    with running(*args, command=("serve",), logs=tmp, timeout=600) as proc:
        yield proc.info


def generate(url: str, text: str) -> dict[str, Any]:
    body = {"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    got = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert got.status_code == 200, got.text
    return got.json()


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_the_ready_line_names_every_node(front: dict[str, Any]) -> None:
    assert len(front["decode"].split(",")) == 2
    assert len(front["prefill"].split(",")) == 2
    assert front["router"] == "cache_aware"


def test_each_conversation_returns_to_the_node_holding_its_history(front: dict[str, Any]) -> None:
    """Three conversations at once, two turns each: the first turns spread over both decode
    nodes by load (neither holds anything yet), and each second turn goes where its first
    turn's pages are, as that node itself reports (`peek`), so it finds them in L1 or L2.
    Decode node i uses prefill node i mod 2, so both prefill nodes serve too."""
    url = front["url"]
    names = ("alpha", "beta", "gamma")
    histories = {name: f"<|im_start|>system\n{SYSTEM} ({name})<|im_end|>\n" for name in names}
    seconds: list[dict[str, Any]] = []
    for turn, question in enumerate(("Name a colour.", "Name another one.")):
        for name in names:
            histories[name] += f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        with ThreadPoolExecutor(len(names)) as pool:
            replies = dict(zip(names, pool.map(lambda n: generate(url, histories[n]), names), strict=True))
        for name in names:
            histories[name] += replies[name]["text"] + "<|im_end|>\n"
            if turn == 1:
                seconds.append(replies[name]["meta_info"])
    for meta in seconds:
        held = meta["cached_tokens_details"]["l1"] + meta["cached_tokens_details"]["l2"]
        assert held >= 2 * PAGE, meta
    m = metrics(url)
    routed = [m[f"hicache_backend_node{i}_routed_total"] for i in range(2)]
    assert sum(routed) == 6 and min(routed) > 0, m

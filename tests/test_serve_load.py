"""A bounded load on `hicache serve` (`bench/serve_load.py`): 16 concurrent streaming clients of
the `openai` package play multi-turn chats for 40 seconds on the default model. Every request must
be answered (no error, no 503: the front door's queue holds what the decode node cannot run yet),
and the memory of serve and its nodes must not grow after the warm-up beyond `RSS_GROWTH_MB`.

The bound is generous on purpose: allocator pools and the prefill cache still fill during the
run (about 60 MB a minute here); keeping each request's KV (13 MB for a 300-token prompt of this
model) would exceed it within twenty requests, fewer than the 25 seconds after the warm-up serve.
Timings are printed, never asserted (BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.real_model]

LOAD = Path(__file__).resolve().parent.parent / "bench" / "serve_load.py"
CLIENTS = 16
SECONDS = 40  # 15 of warm-up (bench/serve_load.py's default), then 25 measured
RSS_GROWTH_MB = 256.0


def test_sixteen_streaming_clients_get_every_answer_and_memory_stays_flat(
    tmp_path: Path,
) -> None:
    out = tmp_path / "load.json"
    args = [
        sys.executable,
        str(LOAD),
        "--clients",
        str(CLIENTS),
        "--seconds",
        str(SECONDS),
        "--out",
        str(out),
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=SECONDS + 900, check=False)
    assert out.exists(), done.stderr[-3000:]
    report = json.loads(out.read_text())
    print(f"\n{json.dumps({k: report[k] for k in ('requests', 'errors', 'ttft_p50_s', 'ttft_p99_s')})}")

    assert report["errors"] == 0, report["error_samples"]
    assert report["requests"] >= CLIENTS, f"the load hardly ran: {report['requests']} requests"
    growth = report["rss_end_total_mb"] - report["rss_after_warmup_total_mb"]
    assert growth <= RSS_GROWTH_MB, (report["rss_after_warmup_mb"], report["rss_end_mb"])

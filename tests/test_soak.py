"""A one-minute soak of a prefill and a decode node (`bench/soak.py --seconds 60`): steady
multi-turn traffic with faults injected at 1% (when the decode node takes `--faults`). Every
request must end and be served exact KV, the decode node must shut down cleanly, and after the
warm-up its open file descriptors must stay flat and its memory must not grow beyond noise.
The bounds are generous on purpose: a leak of one descriptor, or of a few kilobytes, per request
exceeds them within the minute; ordinary allocator noise does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

SOAK = Path(__file__).resolve().parent.parent / "bench" / "soak.py"
SECONDS = 60
WARMUP = 20
FD_SPREAD = 10  # descriptors: files the store has open mid-operation, transfer connections
# A minute is mostly warm-up (tiers, caches and allocator pools still filling: 15-25 MB/min here
# at ~20 requests/s), so this bound only catches a gross leak: keeping each request's KV
# (hundreds of KB) would grow RSS by well over 100 MB/min. The slope proper is measured by the
# ten-minute run of bench/soak.py (docs/reliability.md).
RSS_SLOPE_MB_PER_MIN = 60.0


def test_a_minute_of_traffic_with_faults_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    args = [sys.executable, str(SOAK), "--seconds", str(SECONDS), "--warmup", str(WARMUP)]
    args += ["--kv-every", "4", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=SECONDS + 180, check=False)
    assert out.exists(), done.stderr[-3000:]
    report = json.loads(out.read_text())
    summary = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    print(f"\n{summary}")

    assert report["sent"] >= 50, f"the soak hardly ran: {report['sent']} requests"
    assert report["unanswered"] == [] and report["ended"] == report["sent"], report["unanswered"]
    # A cache fault never fails a request; only a prefill transfer that fails all its retries may.
    assert set(report["outcomes"]) <= {"finished", "failed"}, report["outcomes"]
    for reason in report["unsuccessful_reasons"]:
        assert "prefill transfer failed" in reason, reason
    assert report["problem_count"] == 0, report["problems"]
    assert report["verified"] > 0
    if report["faults"]:
        assert report.get("faults_injected"), "faults were asked for but none was injected"
    assert report["decode_exit_code"] == 0
    if report.get("core_check") is not None:  # the node's own audit, once it is at rest
        assert report["core_check"] == "ok"
        assert not any(report["held_at_rest"].values()), report["held_at_rest"]
    fds = report["fds"]
    assert fds["max_after_warmup"] - fds["min_after_warmup"] <= FD_SPREAD, fds
    assert report["rss_slope_mb_per_min"] < RSS_SLOPE_MB_PER_MIN, report["rss_mb"]
    assert done.returncode == 0, done.stderr[-3000:]

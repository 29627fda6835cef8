"""bench/gpu_serve_check.py runs whole on the CPU, so that on a GPU machine only its CUDA lines are
new: every section present and passing, each tier's turn restored from that tier, figures positive."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.real_model]

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("copy", "greedy", "conversation", "decode", "ttft")


def test_gpu_serve_check_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_serve_check.py"), "--device", "cpu", "--quick"]
    cmd += ["--out", str(out), "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    sections = results["sections"]
    assert {name: sections[name]["status"] for name in SECTIONS} == dict.fromkeys(SECTIONS, "ok"), json.dumps(
        {n: sections[n].get("error") or sections[n].get("reason") for n in SECTIONS}
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert results["device"]["device"] == "cpu"
    assert results["failed"] == [] and results["skipped"] == []

    greedy = sections["greedy"]
    assert greedy["tokens"] == 24 and len(greedy["server_ids"]) == 24
    assert 0 <= greedy["agree"] <= greedy["equal_positions"] <= 24
    assert greedy["agree"] >= 8  # the answer itself; bf16 ties may part later
    assert "first_divergence" in greedy

    turns = {t["expect"]: t for t in sections["conversation"]["turns"]}
    assert turns["l1"]["l1"] > 0
    assert turns["l2"]["l2"] > 0 and turns["l2"]["l1"] == 0
    assert turns["l3"]["l3"] > 0 and turns["l3"]["l1"] == turns["l3"]["l2"] == 0

    copy = sections["copy"]
    assert copy["device"] == "cpu" and copy["reference"]["gbps"] > 0
    assert {r["page"] for r in copy["load_back"]} == {"1 MiB", "8 MiB"}
    assert all(r["best_gbps"] > 0 and r["bit_exact"] for r in copy["load_back"])

    decode = sections["decode"]
    for key in ("server_b1", "server_b32", "transformers_b1", "transformers_b32"):
        assert decode[key]["tok_s"] > 0, key

    ttft = sections["ttft"]
    for key in ("on", "off"):
        assert ttft[key]["cold_ttft_s"] > 0 and ttft[key]["follow_up_ttft_s"] > 0, key
    assert ttft["on"]["follow_up_cached"][0]["cached"] > 0
    assert ttft["off"]["follow_up_cached"][0]["cached"] == 0

"""The twin against reality: record multi-turn client traffic on `hicache serve`, replay the
recording with `hicache sim twin` (how well it predicts what the node did), ask the twin a
what-if (L2 doubled), then send the same client traffic to a real node with L2 doubled and see
whether the twin predicted the direction and size of the change.

    .venv/bin/python bench/twin_check.py [--conversations 6] [--turns 6] [--l1-pages 24] [--ratio 1]

The traffic: `--conversations` chats of `--turns` turns (a system prompt, short questions,
answers of `--max-new` tokens, greedy), sent one request at a time round-robin over the chats,
each turn extending its chat's history (so a turn finds its chat's earlier pages on the node
unless L1 and L2 lost them). Page size 16, blocks of 16 tokens in the recording, no storage
(so L2 capacity decides hits). Prints a table; `--out DIR` keeps the recordings and the twin's
outputs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_clients import hicache_serve  # noqa: E402

from hicache.sim import twin  # noqa: E402

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


def check(out: Path, a: argparse.Namespace) -> dict[str, Any]:
    base, doubled = out / "recorded.jsonl", out / "recorded_l2x2.jsonl"
    for p in (base, doubled):
        p.unlink(missing_ok=True)
    kw = {"l1_pages": a.l1_pages, "conversations": a.conversations, "turns": a.turns, "max_new": a.max_new}
    wall = record(base, ratio=a.ratio, **kw)
    wall2 = record(doubled, ratio=2 * a.ratio, **kw)
    for p in (base, doubled):
        drop_warmup(p)
    what = [f"cache.hicache_ratio={2 * a.ratio}"]
    raw = twin.twin(base, what, calibrate=False)
    cal = twin.twin(base, what)
    open_loop = twin.twin(base, what, common=["workload.arrivals=open"])
    real2 = twin.overall(twin.read_recording(doubled), None)
    twin.write_outputs(out / "twin", cal)
    return {
        "wall_s": [wall, wall2],
        "uncalibrated": raw,
        "calibrated": cal,
        "open_loop": open_loop,
        "measured_l2x2": real2,
    }


def agree(real: float, twin_change: float, error: float) -> str:
    """Whether the twin predicted the real change: the two differ by no more than the error the
    twin reports for a single prediction (1 pp for hit rates; for times, its mean per-request
    TTFT error), so a change inside that band, either way, is one the twin cannot tell from none."""
    return "yes" if abs(real - twin_change) <= error else "no"


def table(res: dict[str, Any]) -> str:
    cal: twin.TwinResult = res["calibrated"]
    raw: twin.TwinResult = res["uncalibrated"]
    real2 = res["measured_l2x2"]
    lines = [twin.report(cal), "", "before calibration (the node's own settings):", twin.report(raw), ""]
    lines += ["open loop (turns arrive when recorded):", twin.report(res["open_loop"]), ""]
    head = f"{'metric':<14}{'measured':>10}{'L2x2 real':>11}{'change':>9}{'twin change':>13}{'agree':>7}"
    lines.append(head)
    for key in ("hit_rate", "ttft_mean_s", "ttft_p90_s"):
        m, r2 = cal.measured[key], real2[key]
        p, w = cal.predicted[key], (cal.what_if or {})[key]
        if key == "hit_rate":
            real_change, twin_change, error = 100 * (r2 - m), 100 * (w - p), 1.0
            shown = f"{real_change:+8.1f}pp{twin_change:+11.1f}pp"
        else:
            real_change, twin_change = (r2 - m) / m, (w - p) / p
            error = cal.errors.get("ttft_per_request") or 0.0
            shown = f"{real_change:+9.1%}{twin_change:+13.1%}"
        lines.append(f"{key:<14}{m:>10.4f}{r2:>11.4f}{shown}{agree(real_change, twin_change, error):>7}")
    lines.append(
        "(agree: the twin's change is within its reported error of the real one: 1 pp for the hit "
        f"rate, its mean per-request TTFT error ({cal.errors.get('ttft_per_request') or 0:.1%}) for times)"
    )
    lines.append(f"(wall: {res['wall_s'][0]:.0f} s and {res['wall_s'][1]:.0f} s of serving)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--l1-pages", type=int, default=24)
    ap.add_argument("--ratio", type=float, default=1.5, help="L2 as a multiple of L1; the what-if doubles it")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="twin-check-"))
    out.mkdir(parents=True, exist_ok=True)
    print(table(check(out, a)))
    print(f"(files in {out})")


if __name__ == "__main__":
    main()

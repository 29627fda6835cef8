"""The twin against reality: record multi-turn client traffic on `hicache serve`, replay the
recording with `hicache sim twin` (how well it predicts what the node did), ask the twin a
what-if (L2 doubled), then send the same client traffic to a real node with L2 doubled and see
whether the twin predicted the direction and size of the change.

    .venv/bin/python bench/twin_check.py [--conversations 6] [--turns 6] [--l1-pages 24] [--ratio 1.5]
        [--rounds 2] [--out DIR]

The real runs alternate, A B B A ... (`--rounds` pairs; A: as recorded, B: L2 doubled), so that
neither setting always runs second, and each setting's figures are the means of its runs; with
two or more rounds the spread between repeats of one setting is measured and counted in the
error (a change smaller than the run-to-run spread cannot be called). The twin predicts from
each A recording.

The traffic: `--conversations` chats of `--turns` turns (a system prompt, short questions,
answers of `--max-new` tokens, greedy), sent one request at a time round-robin over the chats,
each turn extending its chat's history (so a turn finds its chat's earlier pages on the node
unless L1 and L2 lost them). Page size 16, blocks of 16 tokens in the recording, no storage
(so L2 capacity decides hits); it lives in `hicache.runtime.serving.chat_traffic`, which the
twin's real-node test plays too. Prints a table; `--out DIR` keeps the recordings and the twin's
outputs.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from hicache.runtime.serving.chat_traffic import drop_warmup, record
from hicache.sim import twin

A, B = "A", "B"  # the node as recorded, and with L2 doubled (the what-if)


def order(rounds: int) -> list[str]:
    """The real runs, alternating: A B, then B A, ... (`rounds` pairs), so that neither setting
    always runs second on a machine whose speed drifts (a warmer process, a busier minute)."""
    return [x for i in range(rounds) for x in ((A, B) if i % 2 == 0 else (B, A))]


def check(out: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Serve the traffic on real nodes in `order(a.rounds)`, then ask the twin, from each A
    recording, what L2 doubled does; returns the twins and the measured figures."""
    kw = {"l1_pages": a.l1_pages, "conversations": a.conversations, "turns": a.turns, "max_new": a.max_new}
    runs: dict[str, list[Path]] = {A: [], B: []}
    wall: list[tuple[str, float]] = []
    for which in order(a.rounds):
        path = out / f"recorded_{which.lower()}{len(runs[which]) + 1}.jsonl"
        path.unlink(missing_ok=True)
        ratio = a.ratio if which == A else 2 * a.ratio
        wall.append((path.stem, record(path, ratio=ratio, **kw)))
        drop_warmup(path)
        runs[which].append(path)
    what = [f"cache.hicache_ratio={2 * a.ratio}"]
    first = runs[A][0]
    cals = [twin.twin(p, what) for p in runs[A]]
    twin.write_outputs(out / "twin", cals[0])
    return {
        "wall_s": wall,
        "uncalibrated": twin.twin(first, what, calibrate=False),
        "calibrated": cals,
        "open_loop": twin.twin(first, what, common=["workload.arrivals=open"]),
        "measured": {w: [twin.overall(twin.read_recording(p), None) for p in ps] for w, ps in runs.items()},
    }


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def spread(xs: list[float]) -> float:
    """Run-to-run spread of one setting's repeats: (max - min) / mean (0 with one run)."""
    return (max(xs) - min(xs)) / mean(xs) if len(xs) > 1 and mean(xs) else 0.0


def agree(real: float, twin_change: float, error: float) -> str:
    """Whether the twin predicted the real change: the two differ by no more than `error` (1 pp
    for hit rates; for times, the twin's mean per-request TTFT error plus the run-to-run spread
    of the real runs), so a change inside that band, either way, is one that cannot be told
    from none."""
    return "yes" if abs(real - twin_change) <= error else "no"


def table(res: dict[str, Any]) -> str:
    cals: list[twin.TwinResult] = res["calibrated"]
    cal, raw = cals[0], res["uncalibrated"]
    real = res["measured"]
    lines = [twin.report(cal), "", "before calibration (the node's own settings):", twin.report(raw), ""]
    lines += ["open loop (turns arrive when recorded):", twin.report(res["open_loop"]), ""]
    twin_error = mean([c.errors.get("ttft_per_request") or 0.0 for c in cals])
    n_a, n_b = len(real[A]), len(real[B])
    repeated = min(n_a, n_b) > 1  # else the spread is not measured: "-"
    head = (
        f"{'metric':<14}{'A real':>10}{'B real':>10}{'change':>9}{'spread':>8}"
        f"{'twin change':>13}{'error':>8}{'agree':>7}{'called':>8}"
    )
    lines.append(head)
    for key in ("hit_rate", "ttft_mean_s", "ttft_p90_s"):
        ma, mb = [m[key] for m in real[A]], [m[key] for m in real[B]]
        twin_changes = []
        for c in cals:
            p, w = c.predicted[key], (c.what_if or {})[key]
            twin_changes.append(100 * (w - p) if key == "hit_rate" else (w - p) / p)
        twin_change = mean(twin_changes)
        if key == "hit_rate":
            real_change = 100 * (mean(mb) - mean(ma))
            sp = 100 * max(max(ma) - min(ma), max(mb) - min(mb))
            error = 1.0 + sp
            sp_shown = f"{sp:.1f}pp" if repeated else "-"
            shown = f"{real_change:+7.1f}pp{sp_shown:>8}{twin_change:+11.1f}pp{error:>6.1f}pp"
        else:
            real_change = (mean(mb) - mean(ma)) / mean(ma)
            sp = max(spread(ma), spread(mb))
            error = twin_error + sp
            sp_shown = f"{sp:.1%}" if repeated else "-"
            shown = f"{real_change:+9.1%}{sp_shown:>8}{twin_change:+13.1%}{error:>8.1%}"
        called = ("yes" if abs(real_change) > sp else "no") if repeated else "-"
        lines.append(
            f"{key:<14}{mean(ma):>10.4f}{mean(mb):>10.4f}{shown}{agree(real_change, twin_change, error):>7}"
            f"{called:>8}"
        )
    lines += [
        f"(A: the node as recorded, {n_a} run(s); B: L2 doubled, {n_b} run(s); figures are the means "
        "of each setting's runs; spread: (max - min) / mean between repeats of one setting, the larger "
        "of A's and B's)",
        f"(twin change: the mean over the twins of the {n_a} A recording(s): "
        + ", ".join(f"{(c.what_if or {})['ttft_mean_s'] / c.predicted['ttft_mean_s'] - 1:+.1%}" for c in cals)
        + " TTFT mean)",
        f"(error: 1 pp for the hit rate, the twin's mean per-request TTFT error ({twin_error:.1%}) for "
        "times, each plus the spread; agree: the twin's change within that error of the real one; "
        "called: the real change exceeds the spread, so its direction is measured at all; - : one run "
        "per setting, spread not measured)",
        "(order and wall: " + ", ".join(f"{name} {s:.0f} s" for name, s in res["wall_s"]) + ")",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--l1-pages", type=int, default=24)
    ap.add_argument("--ratio", type=float, default=1.5, help="L2 as a multiple of L1; the what-if doubles it")
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="pairs of real runs, alternating A B, B A, ... (A: as recorded, B: L2 doubled); from 2 "
        "(the default) the run-to-run spread is measured too",
    )
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds: expected an integer >= 1, got {a.rounds}")
    out = a.out or Path(tempfile.mkdtemp(prefix="twin-check-"))
    out.mkdir(parents=True, exist_ok=True)
    print(table(check(out, a)))
    print(f"(files in {out})")


if __name__ == "__main__":
    main()

"""PNG plots of a run's baselines: TTFT CDF, cached tokens by tier, bytes over the P->D link.

Lines differ in marker and dash as well as colour (`line_style`, shared with the sweep report),
and a baseline keeps its style in every plot and run, so overlapping lines stay apart and a grey-scale
print still tells them apart; stacked tiers differ in hatching. A plot with nothing to show
becomes a note in place of empty axes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from hicache.scenarios.scenario import BASELINES  # noqa: E402

# Marker and dash per line, cycled with coprime lengths so the first 20 lines all differ.
MARKERS = ("o", "s", "^", "D", "v")
DASHES = ("-", "--", ":", "-.")
HATCHES = ("", "//", "..", "xx", "\\\\", "++")
TIERS = ("l1", "l2", "l3")


def line_style(i: int) -> dict[str, Any]:
    """Line i's colour, marker and dash: no two of the first 20 lines look alike."""
    return {"color": f"C{i % 10}", "marker": MARKERS[i % len(MARKERS)], "linestyle": DASHES[i % len(DASHES)]}


def baseline_styles(labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Each baseline's `line_style`: a known baseline keeps its place in `BASELINES` whichever
    others run beside it, so it looks the same in every run's plots; other labels take the
    places left, in order."""
    taken = {BASELINES.index(k) for k in labels if k in BASELINES}
    free = (i for i in range(len(BASELINES) + len(labels)) if i not in taken)
    return {k: line_style(BASELINES.index(k) if k in BASELINES else next(free)) for k in labels}


def ttft_figure(runs: Mapping[str, Sequence[float] | np.ndarray], title: str) -> Any:
    """The CDF of each baseline's TTFTs (of its finished requests), or a note (str) when no
    baseline has one. Each is drawn in its `baseline_styles`, with about a dozen markers."""
    if not any(len(v) for v in runs.values()):
        return "No request completed in any baseline: no TTFT to plot."
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    styles = baseline_styles(list(runs))
    for label, ttfts in runs.items():
        v = np.sort(np.asarray(ttfts, dtype=np.float64))
        if v.size:
            every = max(1, v.size // 12)
            y = np.arange(1, v.size + 1) / v.size
            ax.step(v, y, where="post", label=label, markevery=every, markersize=5, **styles[label])
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def ttft_cdf(path: Path, runs: Mapping[str, Sequence[float] | np.ndarray], title: str) -> None:
    """`ttft_figure` as a PNG (a note drawn as text when there is nothing to plot)."""
    _save(path, ttft_figure(runs, title), title)


def cached_by_tier(path: Path, summaries: Mapping[str, dict], title: str) -> None:
    labels = list(summaries)
    shares = {
        tier: np.array(
            [summaries[k]["cached_tokens"][tier] / max(summaries[k]["prompt_tokens"], 1) for k in labels]
        )
        for tier in TIERS
    }
    if not any(s.any() for s in shares.values()):
        _save(path, "No prompt tokens were restored on the decode node from any tier.", title)
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    bottom = np.zeros(len(labels))
    for hatch, tier in zip(HATCHES, TIERS, strict=False):
        ax.bar(labels, shares[tier] * 100, bottom=bottom, label=tier.upper(), hatch=hatch, edgecolor="white")
        bottom += shares[tier] * 100
    ax.set_ylabel("prompt tokens restored on the decode node (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    _save(path, fig, title)


def pd_bytes(path: Path, summaries: Mapping[str, dict], title: str) -> None:
    labels = list(summaries)
    gb = [summaries[k]["pd_transfer_bytes"] / 1e9 for k in labels]
    if not any(gb):
        _save(path, "No KV was sent from prefill to decode in any baseline.", title)
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    ax.bar(labels, gb, color="tab:purple")
    ax.set_ylabel("KV sent prefill -> decode (GB)")
    ax.set_title(title)
    fig.tight_layout()
    _save(path, fig, title)


def _save(path: Path, fig: Any, title: str) -> None:
    """Write a figure, or a note (str) as a small image of its text."""
    if isinstance(fig, str):
        note = fig
        fig = plt.figure(figsize=(6.4, 1.6), dpi=110)
        fig.text(0.5, 0.62, title, ha="center", va="center", fontsize=11, weight="bold")
        fig.text(0.5, 0.35, note, ha="center", va="center", fontsize=10, color="#57606a")
    fig.savefig(path)
    plt.close(fig)

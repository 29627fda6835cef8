"""PNG plots of a run's baselines: TTFT CDF, cached tokens by tier, bytes over the P->D link."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from hicache.results import RequestRecord  # noqa: E402


def ttft_cdf(path: Path, runs: Mapping[str, Sequence[RequestRecord]], title: str) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for label, records in runs.items():
        v = np.sort([r.ttft_s for r in records if r.outcome == "finished" and not math.isnan(r.ttft_s)])
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def cached_by_tier(path: Path, summaries: Mapping[str, dict], title: str) -> None:
    labels = list(summaries)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    bottom = np.zeros(len(labels))
    for tier in ("l1", "l2", "l3"):
        share = np.array(
            [summaries[k]["cached_tokens"][tier] / max(summaries[k]["prompt_tokens"], 1) for k in labels]
        )
        ax.bar(labels, share * 100, bottom=bottom, label=tier.upper())
        bottom += share * 100
    ax.set_ylabel("prompt tokens restored on the decode node (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def pd_bytes(path: Path, summaries: Mapping[str, dict], title: str) -> None:
    labels = list(summaries)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    ax.bar(labels, [summaries[k]["pd_transfer_bytes"] / 1e9 for k in labels], color="tab:purple")
    ax.set_ylabel("KV sent prefill -> decode (GB)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

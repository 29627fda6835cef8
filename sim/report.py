"""An HTML report of a sweep folder: the results table and plots against the swept parameters.

`report.html` is self-contained: inline CSS, no scripts, and its plots embedded as PNG data:
URIs, so the one file can be mailed or moved alone (its only link is to `sweep.csv` beside it).
Figures are means over seeds with the spread across seeds drawn (a min-max band on lines, error
bars on bars); lines differ in marker and dash as well as colour, so overlapping ones stay
apart and the page survives grey-scale printing. A plot with nothing to show becomes a note.
A swept parameter's TTFT plot draws one line per baseline and combination of the other
parameters when there are few, else one line per baseline averaged over them.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from hicache.sim.plots import HATCHES, TIERS  # noqa: E402
from hicache.sim.plots import line_style as _style  # noqa: E402
from hicache.sim.sweep import SweepData, cell, read_sweep  # noqa: E402

MAX_LINES = 8  # per TTFT panel before the other parameters are averaged
Combo = tuple[Any, ...]

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto;
       max-width: 1200px; padding: 0 1em; color: #1b1f24; background: #fff; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 2em; }
dl { display: grid; grid-template-columns: max-content auto; gap: 0.2em 1em; }
dt { font-weight: 600; } dd { margin: 0; font-family: ui-monospace, monospace; }
table { border-collapse: collapse; font-size: 12px; margin: 0.5em 0; }
th, td { border: 1px solid #d0d7de; padding: 3px 7px; text-align: right; white-space: nowrap; }
th { background: #f3f5f7; position: sticky; top: 0; }
td.text, th.text { text-align: left; }
tbody tr:nth-child(even) { background: #fafbfc; }
img { max-width: 100%; border: 1px solid #eaeef2; margin: 0.5em 0; }
.note { color: #57606a; }
"""


# --- aggregation ----------------------------------------------------------------------------


def _mean(values: Iterable[float | None]) -> float:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.mean(kept)) if kept else math.nan


def _get(summary: Mapping[str, Any], key: str) -> float | None:
    value: Any = summary
    for part in key.split("."):
        value = value[part]
    return value


def _derived(summary: Mapping[str, Any]) -> dict[str, float | None]:
    """The figures the report shows, from one baseline's summary."""
    prompt = max(summary["prompt_tokens"], 1)
    out: dict[str, float | None] = {
        k: _get(summary, k) for k in ("ttft_s.mean", "ttft_s.p90", "ttft_s.p99", "tpot_s.mean")
    }
    out.update({f"share.{t}": summary["cached_tokens"][t] / prompt for t in TIERS})
    out["hit_rate"] = summary["hit_rate"]
    out["pd_gb"] = summary["pd_transfer_bytes"] / 1e9
    out["fallback_tokens"] = summary["fallback_tokens"]
    out["failed"] = summary["failed"]
    out["completed"] = summary["completed"]
    return out


def _frozen(value: Any) -> Any:
    """A swept value as a dict key: arrays (JSON lists) become tuples."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in value.items())
    return value


class _Table:
    """Per (combination, baseline): the derived figures of every seed, and their means."""

    def __init__(self, data: SweepData) -> None:
        self.fields = data.fields
        self.baselines = list(data.baselines)
        grid = [[_frozen(v) for v in g["values"]] for g in data.manifest["grid"]]
        self.combos: list[Combo] = list(itertools.product(*grid))
        self.cells: dict[tuple[Combo, str], list[dict[str, float | None]]] = {}
        for doc in data.runs:
            combo = tuple(_frozen(doc["overrides"][f]) for f in self.fields)
            for baseline, saved in doc["baselines"].items():
                if baseline not in self.baselines:
                    self.baselines.append(baseline)
                self.cells.setdefault((combo, baseline), []).append(_derived(saved["summary"]))

    def mean(self, combos: Iterable[Combo], baseline: str, key: str) -> float:
        return _mean(self.values(combos, baseline, key))

    def values(self, combos: Iterable[Combo], baseline: str, key: str) -> list[float]:
        """Every seed's (and combination's) figure, NaN and missing ones left out."""
        found = (d[key] for c in combos for d in self.cells.get((c, baseline), []))
        return [float(v) for v in found if v is not None and not math.isnan(v)]

    def spread(self, combos: Iterable[Combo], baseline: str, key: str) -> tuple[float, float, int]:
        """The min and max over seeds (NaN when there is no figure), and how many there are."""
        vals = self.values(combos, baseline, key)
        return (min(vals), max(vals), len(vals)) if vals else (math.nan, math.nan, 0)

    def seeds(self, combo: Combo, baseline: str) -> int:
        return len(self.cells.get((combo, baseline), []))

    def label(self, combo: Combo) -> str:
        if not combo:
            return "(scenario)"
        return ", ".join(f"{name}={_show(v)}" for name, v in zip(_short(self.fields), combo, strict=True))


def _show(value: Any) -> str:
    """A swept value for people: floats compactly (4e+10, not 40000000000.0)."""
    return format(value, "g") if isinstance(value, float) else cell(value)


def _short(fields: Sequence[str]) -> list[str]:
    """Field names without their section where that stays unambiguous."""
    last = [f.rsplit(".", 1)[-1] for f in fields]
    return [s if last.count(s) == 1 else f for s, f in zip(last, fields, strict=True)]


def _numeric(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


# --- plots ----------------------------------------------------------------------------------
# Each plot function returns a figure, or a note (str) when there is nothing to draw.


def _png(fig: Any) -> str:
    """The figure as a data: URI (and closed)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")  # keeps legends placed outside the axes
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _empty(values: Iterable[float]) -> bool:
    """True when no value is a number other than 0: the plot would be blank axes."""
    return all(math.isnan(v) or v == 0 for v in values)


def _errors(means: Sequence[float], spreads: Sequence[tuple[float, float, int]]) -> np.ndarray | None:
    """Asymmetric error bars from each mean to the min and max over seeds; None when no bar has
    more than one seed."""
    if all(n <= 1 for _, _, n in spreads):
        return None
    lo = [m - s[0] if s[2] > 1 else 0.0 for m, s in zip(means, spreads, strict=True)]
    hi = [s[1] - m if s[2] > 1 else 0.0 for m, s in zip(means, spreads, strict=True)]
    return np.nan_to_num(np.array([lo, hi]))


def _ttft_against(table: _Table, index: int, title: str) -> Any:
    field = table.fields[index]
    values = [c[index] for c in table.combos]
    xs = list(dict.fromkeys(values))
    others = list(dict.fromkeys(c[:index] + c[index + 1 :] for c in table.combos))
    per_combo = len(others) * len(table.baselines) <= MAX_LINES
    numeric = _numeric(xs)
    order = sorted(xs) if numeric else xs
    positions = order if numeric else list(range(len(order)))
    other_fields = table.fields[:index] + table.fields[index + 1 :]
    lines: list[tuple[str, str, list[float], list[tuple[float, float, int]]]] = []
    for baseline in table.baselines:
        for other in others if per_combo else [None]:
            if other is None:
                label = baseline
            else:
                label = baseline + "".join(
                    f", {n}={_show(v)}" for n, v in zip(_short(other_fields), other, strict=True)
                )
            for key in ("ttft_s.mean", "ttft_s.p99"):
                means, spreads = [], []
                for x in order:
                    combos = [
                        c
                        for c in table.combos
                        if c[index] == x and (other is None or c[:index] + c[index + 1 :] == other)
                    ]
                    means.append(table.mean(combos, baseline, key))
                    spreads.append(table.spread(combos, baseline, key))
                lines.append((label, key, means, spreads))
    if all(math.isnan(v) for *_, means, _ in lines for v in means):
        return f"No request completed in any run: no TTFT to plot against {field}."
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    for ax, key in zip(axes, ("ttft_s.mean", "ttft_s.p99"), strict=True):
        for i, (label, _, means, spreads) in enumerate(line for line in lines if line[1] == key):
            style = _style(i)
            ax.plot(positions, means, label=label, markersize=5, **style)
            if any(n > 1 for *_, n in spreads):
                lo = [s[0] for s in spreads]
                hi = [s[1] for s in spreads]
                ax.fill_between(positions, lo, hi, color=style["color"], alpha=0.15, linewidth=0)
    for ax, what in zip(axes, ("mean", "p99"), strict=True):
        ax.set_xlabel(field)
        ax.set_ylabel(f"TTFT {what} (s)")
        ax.set_title(f"{title}: TTFT {what}")
        ax.grid(True, alpha=0.3)
        if not numeric:
            ax.set_xticks(positions, [_show(x) for x in order])
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    return fig


def _ttft_by_baseline(table: _Table, title: str) -> Any:
    keys = ("ttft_s.mean", "ttft_s.p99")
    bars = {key: [table.mean(table.combos, b, key) for b in table.baselines] for key in keys}
    if all(math.isnan(v) for ys in bars.values() for v in ys):
        return "No request completed in any run: no TTFT to plot."
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    x = np.arange(len(table.baselines))
    for i, (key, ys) in enumerate(bars.items()):
        spreads = [table.spread(table.combos, b, key) for b in table.baselines]
        ax.bar(
            x + (i - 0.5) * 0.4,
            np.nan_to_num(ys),
            width=0.4,
            label=key.split(".")[1],
            yerr=_errors(ys, spreads),
            capsize=3,
            hatch=("", "//")[i],
        )
    ax.set_xticks(x, table.baselines)
    ax.set_ylabel("TTFT (s)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def _height(rows: int) -> float:
    return min(40.0, max(3.2, 0.32 * rows + 1.6))


def _yticks(ax: Any, table: _Table) -> None:
    ax.set_yticks(np.arange(len(table.combos)), [table.label(c) for c in table.combos], fontsize=8)
    ax.invert_yaxis()  # the first combination on top, as in the table


def _tiers(table: _Table, title: str) -> Any:
    """Horizontal stacked bars, one panel per baseline: long combination labels stay legible."""
    shares = {
        (b, t): [100 * table.mean([c], b, f"share.{t}") for c in table.combos]
        for b in table.baselines
        for t in TIERS
    }
    if _empty(v for ys in shares.values() for v in ys):
        return "No prompt tokens were restored on the decode node from any tier, in any run."
    n = len(table.baselines)
    fig, axes = plt.subplots(
        1, n, figsize=(2.2 + 2.8 * n, _height(len(table.combos))), dpi=100, sharey=True, squeeze=False
    )
    y = np.arange(len(table.combos))
    for ax, baseline in zip(axes[0], table.baselines, strict=True):
        left = np.zeros(len(table.combos))
        for hatch, tier in zip(("", "//", ".."), TIERS, strict=True):
            share = np.nan_to_num(shares[baseline, tier])
            ax.barh(y, share, left=left, label=tier.upper(), hatch=hatch, edgecolor="white")
            left += share
        ax.set_title(baseline, fontsize=10)
        ax.set_xlim(0, 100)
        ax.set_xlabel("% of prompt tokens")
        ax.grid(True, axis="x", alpha=0.3)
    _yticks(axes[0][0], table)
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle(f"{title}: prompt tokens restored on the decode node, by tier")
    return fig


def _grouped(table: _Table, key: str, xlabel: str, title: str, what: str) -> Any:
    """Horizontal bars grouped by combination, one bar per baseline; `what` names the figure in
    the note shown when every run has none of it."""
    means = {b: [table.mean([c], b, key) for c in table.combos] for b in table.baselines}
    if _empty(v for ys in means.values() for v in ys):
        return f"Every run has 0 {what}: nothing to plot."
    rows = len(table.combos) * max(1, len(table.baselines)) / 2.5
    fig, ax = plt.subplots(figsize=(8.0, _height(int(rows) + 1)), dpi=100)
    y = np.arange(len(table.combos))
    height = 0.8 / max(len(table.baselines), 1)
    for i, baseline in enumerate(table.baselines):
        spreads = [table.spread([c], baseline, key) for c in table.combos]
        ax.barh(
            y + (i - (len(table.baselines) - 1) / 2) * height,
            np.nan_to_num(means[baseline]),
            height=height,
            label=baseline,
            xerr=_errors(means[baseline], spreads),
            capsize=2,
            hatch=HATCHES[i % len(HATCHES)],
            edgecolor="white",
        )
    _yticks(ax, table)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    ax.grid(True, axis="x", alpha=0.3)
    return fig


# --- the page -------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    if value is None or math.isnan(value):
        return "-"
    return format(value * scale, spec)


def _table_html(table: _Table) -> str:
    heads = [
        *(f'<th class="text">{html.escape(f)}</th>' for f in table.fields),
        '<th class="text">baseline</th>',
        *(
            f"<th>{h}</th>"
            for h in (
                "seeds",
                "done",
                "failed",
                "TTFT mean s",
                "p90",
                "p99",
                "TPOT ms",
                "hit",
                "L1",
                "L2",
                "L3",
                "P-&gt;D GB",
                "fallback tokens",
            )
        ),
    ]
    rows = []
    for combo in table.combos:
        for baseline in table.baselines:
            n = table.seeds(combo, baseline)
            if not n:
                continue

            def m(key: str, combo: Combo = combo, baseline: str = baseline) -> float:
                return table.mean([combo], baseline, key)

            cells = [
                *(f'<td class="text">{html.escape(_show(v))}</td>' for v in combo),
                f'<td class="text">{html.escape(baseline)}</td>',
                f"<td>{n}</td>",
                f"<td>{_fmt(m('completed'), '.1f' if n > 1 else '.0f')}</td>",
                f"<td>{_fmt(m('failed'), '.1f' if n > 1 else '.0f')}</td>",
                f"<td>{_fmt(m('ttft_s.mean'), '.4f')}</td>",
                f"<td>{_fmt(m('ttft_s.p90'), '.4f')}</td>",
                f"<td>{_fmt(m('ttft_s.p99'), '.4f')}</td>",
                f"<td>{_fmt(m('tpot_s.mean'), '.2f', 1e3)}</td>",
                f"<td>{_fmt(m('hit_rate'), '.1%')}</td>",
                *(f"<td>{_fmt(m(f'share.{t}'), '.1%')}</td>" for t in TIERS),
                f"<td>{_fmt(m('pd_gb'), '.3f')}</td>",
                f"<td>{_fmt(m('fallback_tokens'), '.0f')}</td>",
            ]
            rows.append("<tr>" + "".join(cells) + "</tr>")
    return (
        "<table>\n<thead><tr>"
        + "".join(heads)
        + "</tr></thead>\n<tbody>\n"
        + "\n".join(rows)
        + "\n</tbody>\n</table>"
    )


def _figure(drawn: Any, alt: str) -> str:
    """A figure as an embedded image, or the note that replaces an empty one."""
    if isinstance(drawn, str):
        return f'<p class="note empty">{html.escape(drawn)}</p>'
    return f'<p><img src="{_png(drawn)}" alt="{html.escape(alt)}"></p>'


def write_report(folder: Path) -> Path:
    """Write `folder/report.html` for the sweep in `folder`, its plots embedded; returns the
    file's path."""
    data = read_sweep(folder)
    table = _Table(data)
    manifest = data.manifest
    name = str(manifest["base"].get("name", "sweep"))
    old_images = folder / "report"  # where reports before embedding kept their PNGs
    if old_images.is_dir():
        for old in old_images.glob("*.png"):
            old.unlink()
        if not any(old_images.iterdir()):
            old_images.rmdir()
    sections: dict[str, list[str]] = {}

    def plot(section: str, alt: str, draw: Any) -> None:
        sections.setdefault(section, []).append(_figure(draw(), alt))

    if data.runs:
        if table.fields:
            for i, field in enumerate(table.fields):
                plot(
                    "Time to first token",
                    f"TTFT mean and p99 against {field}",
                    lambda i=i: _ttft_against(table, i, name),
                )
        else:
            plot("Time to first token", "TTFT by baseline", lambda: _ttft_by_baseline(table, name))
        plot(
            "Prompt tokens restored, by tier",
            "prompt tokens restored on the decode node by tier",
            lambda: _tiers(table, name),
        )
        plot(
            "Bytes over the P->D link",
            "KV bytes sent from prefill to decode",
            lambda: _grouped(
                table, "pd_gb", "KV sent prefill -> decode (GB)", name, "bytes over the P->D link"
            ),
        )
        plot(
            "Fallback tokens",
            "tokens re-requested from prefill after a restore fell short",
            lambda: _grouped(
                table, "fallback_tokens", "fallback tokens (re-sent by prefill)", name, "fallback tokens"
            ),
        )
    grid = "; ".join(f"{g['field']} = {', '.join(_show(v) for v in g['values'])}" for g in manifest["grid"])
    facts = [
        ("scenario", manifest["scenario_path"]),
        ("--set", " ".join(manifest["sets"]) or "(none)"),
        ("grid", grid or "(none)"),
        ("seeds", ", ".join(str(s) for s in manifest["seeds"])),
        ("baselines", ", ".join(data.baselines)),
        ("runs", f"{len(data.runs)} of {len(manifest['runs'])} present"),
    ]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f"<title>Sweep: {html.escape(name)}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        f"<h1>Sweep: {html.escape(name)}</h1>",
        "<dl>" + "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in facts) + "</dl>",
        "<h2>Results</h2>",
        '<p class="note">Means over seeds; in the plots, bands (lines) and error bars (bars) span '
        "the min to the max over seeds where a point has several. TTFT and TPOT over completed "
        "requests; hit and L1/L2/L3 "
        "are shares of prompt tokens restored on the decode node. Every metric of every run and "
        'baseline: <a href="sweep.csv">sweep.csv</a>.</p>',
        _table_html(table) if data.runs else '<p class="note">No finished runs yet.</p>',
    ]
    for title, items in sections.items():
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.extend(items)
    parts += ["</body>", "</html>", ""]
    path = folder / "report.html"
    tmp = folder / "report.html.tmp"
    tmp.write_text("\n".join(parts), encoding="utf-8")
    os.replace(tmp, path)
    return path

"""The sweep report: one self-contained HTML page whose every image is an embedded PNG, a table
row per configuration and baseline, lines told apart by more than colour, the spread across seeds
drawn, notes instead of empty plots, and (where a browser is installed) a page that renders."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlparse

import matplotlib.image
import numpy as np
import pytest
from matplotlib.container import ErrorbarContainer

from hicache.cli import main
from hicache.scenarios.scenario import BASELINES
from hicache.sim import plots, report
from hicache.sim.sweep import local_executor, plan_sweep, read_sweep, run_sweep

SCENARIO = """
name = "report-test"

[workload]
kind = "multiturn"
conversations = 5
turns = 3
system_prompt = 256
user_tokens = [200, 800]
output_tokens = [32, 128]
rate = 2.0
think_time = 3.0

[cache]
l1_tokens = 8000
hicache_ratio = 1.0

[run]
baselines = ["l1", "l1_l2_l3"]
"""
PNG = b"\x89PNG\r\n\x1a\n"


class Page(HTMLParser):
    """Every tag, every referenced resource, and the table's body rows."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.images: list[str] = []
        self.alts: list[str] = []
        self.links: list[str] = []
        self.rows = 0
        self._in_body = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        a = dict(attrs)
        if tag == "img":
            self.images.append(a["src"] or "")
            self.alts.append(a.get("alt") or "")
        if tag in ("a", "link") and a.get("href"):
            self.links.append(a["href"] or "")
        if tag in ("script", "iframe", "object", "embed") or (tag == "link" and a.get("href")):
            self.links.append(f"<{tag}>")
        if tag == "tbody":
            self._in_body = True
        if tag == "tr" and self._in_body:
            self.rows += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "tbody":
            self._in_body = False


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2 x 2 sweep, one seed, run in this process."""
    root = tmp_path_factory.mktemp("report")
    scenario = root / "report-test.toml"
    scenario.write_text(SCENARIO, encoding="utf-8")
    plan = plan_sweep(
        scenario, ["cache.prefetch_policy=best_effort,wait_complete", "cache.hicache_ratio=1,2"]
    )
    out = root / "sweep"
    run_sweep(plan, out, executor=local_executor(1))
    assert main(["sim", "report", str(out)]) == 0
    return out


def _parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    return page


@pytest.mark.slow
def test_report_is_self_contained_and_its_images_are_pngs(sweep: Path) -> None:
    page = _parse(sweep / "report.html")
    assert {"html", "head", "style", "body", "table", "img"} <= set(page.tags)
    assert not [link for link in page.links if link.startswith("<")]  # no scripts, frames, stylesheets
    for ref in page.links:
        parsed = urlparse(ref)
        assert not parsed.scheme and not parsed.netloc and not ref.startswith("/"), ref
    # Every image is inside the page: it needs no file beside it.
    assert not (sweep / "report").exists()
    assert len(page.images) == 4  # and a note for the fallback tokens, of which there are none
    assert "Every run has 0 fallback tokens" in (sweep / "report.html").read_text(encoding="utf-8")
    for src in page.images:
        assert src.startswith("data:image/png;base64,"), src[:40]
        png = base64.b64decode(src.split(",", 1)[1])
        assert png[:8] == PNG
        pixels = matplotlib.image.imread(io.BytesIO(png))
        assert pixels.std() > 0.01  # something was drawn
    assert all((sweep / link).exists() for link in page.links)  # sweep.csv
    assert page.rows == 4 * 2  # combinations x baselines
    text = (sweep / "report.html").read_text(encoding="utf-8")
    for needle in ("cache.prefetch_policy", "cache.hicache_ratio", "wait_complete", "l1_l2_l3", "4 of 4"):
        assert needle in text


def test_report_of_a_partial_sweep_says_so(sweep: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    shutil.copytree(sweep, partial)
    for path in sorted((partial / "runs").glob("*.json"))[:3]:
        path.unlink()
    assert main(["sim", "report", str(partial)]) == 0
    page = _parse(partial / "report.html")
    assert page.rows == 1 * 2
    assert "1 of 4" in (partial / "report.html").read_text(encoding="utf-8")
    assert all(src.startswith("data:image/png;base64,") for src in page.images)


def test_report_without_a_grid_compares_baselines(tmp_path: Path) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO.replace("conversations = 5", "conversations = 3"), encoding="utf-8")
    out = tmp_path / "repeats"
    run_sweep(plan_sweep(scenario, [], repeat=2), out, executor=local_executor(1))
    assert main(["sim", "report", str(out)]) == 0
    page = _parse(out / "report.html")
    assert page.alts[:3] == [
        "TTFT by baseline",
        "prompt tokens restored on the decode node by tier",
        "KV bytes sent from prefill to decode",
    ]
    assert page.rows == 2  # one configuration, two baselines, averaged over two seeds


def test_report_of_array_values(tmp_path: Path) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO.replace("conversations = 5", "conversations = 3"), encoding="utf-8")
    out = tmp_path / "arrays"
    plan = plan_sweep(scenario, ["workload.user_tokens=[100, 200],[300, 600]"])
    run_sweep(plan, out, executor=local_executor(1))
    assert main(["sim", "report", str(out)]) == 0
    page = _parse(out / "report.html")
    assert "TTFT mean and p99 against workload.user_tokens" in page.alts
    assert page.rows == 2 * 2
    assert "[300, 600]" in (out / "report.html").read_text(encoding="utf-8")


def test_report_of_a_folder_that_is_no_sweep_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", "report", str(tmp_path)]) == 2
    assert "sweep.json" in capsys.readouterr().err
    assert not (tmp_path / "report.html").exists()


def _browser() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_browser() is None, reason="no chromium or chromium-browser on PATH to render the page")
def test_report_renders_in_a_headless_browser(sweep: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            str(_browser()),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1280,2400",
            f"--screenshot={shot}",
            (sweep / "report.html").resolve().as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    pixels = matplotlib.image.imread(shot)[..., :3]
    colours = np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 16  # text, table and plots, not a blank page
    assert (pixels < 0.5).mean() > 0.001  # some dark ink on the white page


def _seeded_table(tmp_path: Path, grids: list[str]) -> report._Table:
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO.replace("conversations = 5", "conversations = 3"), encoding="utf-8")
    out = tmp_path / "seeds"
    run_sweep(plan_sweep(scenario, grids, repeat=2), out, executor=local_executor(1))
    return report._Table(read_sweep(out))


def test_lines_differ_in_marker_and_dash_and_seeds_show_their_spread(tmp_path: Path) -> None:
    table = _seeded_table(tmp_path, ["cache.hicache_ratio=1,2", "cache.promise=eager,adaptive"])
    fig = report._ttft_against(table, 0, "t")
    for ax in fig.axes[:2]:
        lines = ax.get_lines()
        assert len(lines) == 4  # 2 baselines x 2 promise values
        # Two lines of equal values would hide one another if they differed by colour alone.
        assert len({(ln.get_marker(), ln.get_linestyle()) for ln in lines}) == len(lines)
        assert len(ax.collections) == len(lines)  # a min-max band over the two seeds per line
        for ln, band in zip(lines, ax.collections, strict=True):
            lo, hi = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
            assert lo <= min(ln.get_ydata()) and max(ln.get_ydata()) <= hi
    matplotlib.pyplot.close(fig)
    assert len({(s["marker"], s["linestyle"]) for s in map(report._style, range(20))}) == 20
    fig = report._grouped(table, "pd_gb", "GB", "t", "bytes")
    assert any(isinstance(c, ErrorbarContainer) for c in fig.axes[0].containers)
    matplotlib.pyplot.close(fig)


def test_one_seed_draws_no_spread(sweep: Path) -> None:
    table = report._Table(read_sweep(sweep))
    fig = report._ttft_against(table, 0, "t")
    assert all(not ax.collections for ax in fig.axes)
    matplotlib.pyplot.close(fig)


def test_an_empty_plot_becomes_a_note(sweep: Path, tmp_path: Path) -> None:
    """Runs in which no request completed and nothing was restored, sent or re-sent."""
    empty = tmp_path / "empty"
    shutil.copytree(sweep, empty)
    for path in (empty / "runs").glob("*.json"):
        doc = json.loads(path.read_text(encoding="utf-8"))
        for saved in doc["baselines"].values():
            summary = saved["summary"]
            summary["completed"] = 0
            summary["ttft_s"] = dict.fromkeys(summary["ttft_s"])
            summary["tpot_s"] = dict.fromkeys(summary["tpot_s"])
            summary["cached_tokens"] = {"l1": 0, "l2": 0, "l3": 0}
            summary["pd_transfer_bytes"] = 0.0
            summary["fallback_tokens"] = 0
        path.write_text(json.dumps(doc), encoding="utf-8")
    assert main(["sim", "report", str(empty)]) == 0
    page = _parse(empty / "report.html")
    assert page.images == []
    text = (empty / "report.html").read_text(encoding="utf-8")
    assert text.count('class="note empty"') == 5
    for needle in (
        "No request completed",
        "no TTFT to plot against cache.hicache_ratio",
        "0 fallback tokens",
    ):
        assert needle in text


def test_a_runs_ttft_lines_differ_in_marker_and_dash_per_baseline(tmp_path: Path) -> None:
    """The per-run TTFT CDF (`hicache sim run`): no two baselines share both marker and dash,
    and a baseline keeps its look whichever others run beside it."""
    rng = np.random.default_rng(0)
    every = {b: rng.lognormal(0, 1, 50) for b in (*BASELINES, "custom_a", "custom_b")}
    fig = plots.ttft_figure(every, "t")
    lines = fig.axes[0].get_lines()
    assert len(lines) == len(every)
    assert len({(ln.get_marker(), ln.get_linestyle()) for ln in lines}) == len(lines)
    look = {ln.get_label(): (ln.get_marker(), ln.get_linestyle(), ln.get_color()) for ln in lines}
    matplotlib.pyplot.close(fig)
    some = plots.ttft_figure({"l1_l2_l3": every["l1_l2_l3"], "l1": every["l1"]}, "t")
    for ln in some.axes[0].get_lines():
        assert (ln.get_marker(), ln.get_linestyle(), ln.get_color()) == look[ln.get_label()]
    matplotlib.pyplot.close(some)


def test_an_empty_per_run_plot_becomes_a_note(tmp_path: Path) -> None:
    assert "No request completed" in plots.ttft_figure({"l1": [], "l1_l2": np.empty(0)}, "t")
    summary = {"cached_tokens": {"l1": 0, "l2": 0, "l3": 0}, "prompt_tokens": 0, "pd_transfer_bytes": 0.0}
    for draw in (plots.cached_by_tier, plots.pd_bytes):
        path = tmp_path / f"{draw.__name__}.png"
        draw(path, {"l1": summary}, "t")
        assert matplotlib.image.imread(path).shape[0] < 200  # a one-line note, not empty axes
    plots.ttft_cdf(tmp_path / "ttft.png", {"l1": []}, "t")
    assert matplotlib.image.imread(tmp_path / "ttft.png").shape[0] < 200

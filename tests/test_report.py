"""The sweep report: one self-contained HTML page whose every image is a PNG beside it, a table
row per configuration and baseline, and (where a browser is installed) a page that renders."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlparse

import matplotlib.image
import numpy as np
import pytest

from hicache.cli import main
from hicache.sim.sweep import local_executor, plan_sweep, run_sweep

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
        self.links: list[str] = []
        self.rows = 0
        self._in_body = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        a = dict(attrs)
        if tag == "img":
            self.images.append(a["src"] or "")
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


def test_report_is_self_contained_and_its_images_are_pngs(sweep: Path) -> None:
    page = _parse(sweep / "report.html")
    assert {"html", "head", "style", "body", "table", "img"} <= set(page.tags)
    assert not [link for link in page.links if link.startswith("<")]  # no scripts, frames, stylesheets
    for ref in page.images + page.links:
        parsed = urlparse(ref)
        assert not parsed.scheme and not parsed.netloc and not ref.startswith("/"), ref
    assert sorted(page.images) == sorted(f"report/{p.name}" for p in (sweep / "report").iterdir())
    assert {Path(src).name for src in page.images} == {
        "ttft_cache.prefetch_policy.png",
        "ttft_cache.hicache_ratio.png",
        "hit_by_tier.png",
        "pd_transfer.png",
        "fallback_tokens.png",
    }
    for src in page.images:
        path = sweep / src
        assert path.read_bytes()[:8] == PNG, src
        pixels = matplotlib.image.imread(path)
        assert pixels.std() > 0.01, src  # something was drawn
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
    assert all((partial / src).read_bytes()[:8] == PNG for src in page.images)


def test_report_without_a_grid_compares_baselines(tmp_path: Path) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO.replace("conversations = 5", "conversations = 3"), encoding="utf-8")
    out = tmp_path / "repeats"
    run_sweep(plan_sweep(scenario, [], repeat=2), out, executor=local_executor(1))
    assert main(["sim", "report", str(out)]) == 0
    page = _parse(out / "report.html")
    assert {Path(src).name for src in page.images} == {
        "ttft.png",
        "hit_by_tier.png",
        "pd_transfer.png",
        "fallback_tokens.png",
    }
    assert page.rows == 2  # one configuration, two baselines, averaged over two seeds


def test_report_of_array_values(tmp_path: Path) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO.replace("conversations = 5", "conversations = 3"), encoding="utf-8")
    out = tmp_path / "arrays"
    plan = plan_sweep(scenario, ["workload.user_tokens=[100, 200],[300, 600]"])
    run_sweep(plan, out, executor=local_executor(1))
    assert main(["sim", "report", str(out)]) == 0
    page = _parse(out / "report.html")
    assert "ttft_workload.user_tokens.png" in {Path(src).name for src in page.images}
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

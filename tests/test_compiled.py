"""The compiled core and simulator loop (`hicache compile`): used only for the sources it was
built from, and indistinguishable from plain Python in what a replay decides.

The build itself is made by `./dev.sh` before the tests; without one these tests skip (every
other test then runs on plain Python)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hicache import compiled

ROOT = Path(__file__).resolve().parent.parent

needs_build = pytest.mark.skipif(
    compiled.current_build() is None or bool(os.environ.get("HICACHE_PURE")),
    reason="no compiled build of these sources (run `hicache compile`)",
)

PROBE = (
    "import json, hicache.core.tree, hicache.core.decode_node, hicache.sim.engine; "
    "from hicache import compiled as c; "
    "print(json.dumps([c.compiled(hicache.core.tree), c.compiled(hicache.core.decode_node), "
    "c.compiled(hicache.sim.engine)]))"
)


def _probe(**env: str) -> list[bool]:
    run = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={k: v for k, v in {**os.environ, **env}.items() if v},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(run.stdout)


@pytest.mark.process
@needs_build
def test_the_build_of_these_sources_is_used_and_HICACHE_PURE_turns_it_off() -> None:
    assert _probe() == [True, True, True]
    assert _probe(HICACHE_PURE="1") == [False, False, False]


@pytest.mark.process
@needs_build
def test_a_build_of_other_sources_is_never_used(tmp_path: Path) -> None:
    build = compiled.current_build()
    assert build is not None
    # The same files under another fingerprint: what a build of older sources looks like.
    shutil.copytree(build, tmp_path / ("0" * 24))
    assert _probe(HICACHE_COMPILED_DIR=str(tmp_path)) == [False, False, False]
    # Under the fingerprint of the sources on disk, the very same files are used.
    shutil.copytree(build, tmp_path / build.name)
    assert _probe(HICACHE_COMPILED_DIR=str(tmp_path)) == [True, True, True]


@pytest.mark.process
@needs_build
def test_a_build_missing_a_module_is_not_used(tmp_path: Path) -> None:
    build = compiled.current_build()
    assert build is not None
    copy = tmp_path / build.name
    shutil.copytree(build, copy)
    manifest = json.loads((copy / compiled.MANIFEST).read_text())
    (copy / manifest["files"]["hicache.core.pool"]).unlink()
    assert _probe(HICACHE_COMPILED_DIR=str(tmp_path)) == [False, False, False]


def test_the_fingerprint_covers_every_compiled_source_and_the_core() -> None:
    sources = compiled.sources()
    for module in compiled.MODULES:
        assert compiled.source_of(module) in sources
    core = ROOT / "hicache" / "core"
    assert set(core.glob("*.py")) <= set(sources)
    assert compiled.digest(sources) == compiled.fingerprint()


def test_the_fingerprint_changes_with_any_byte_of_a_source(tmp_path: Path) -> None:
    files = []
    for name in ("a.py", "b.py"):
        f = tmp_path / name
        f.write_text("x = 1\n")
        files.append(f)
    before = compiled.digest(files)
    files[1].write_text("x = 2\n")
    assert compiled.digest(files) != before
    files[1].write_text("x = 1\n")
    assert compiled.digest(files) == before


def _sim(out: Path, **env: str) -> tuple[dict, list[dict]]:
    scenario = ROOT / "scenarios" / "multiturn.toml"
    args = ["--set", "workload.conversations=24", "--set", "run.baselines=['l1', 'l1_l2_l3']"]
    subprocess.run(
        [sys.executable, "-m", "hicache", "sim", "run", str(scenario), "--out", str(out), "--quiet", *args],
        env={k: v for k, v in {**os.environ, **env}.items() if v},
        capture_output=True,
        check=True,
    )
    summary = json.loads((out / "summary.json").read_text())
    with open(out / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return summary, rows


@pytest.mark.slow
@needs_build
def test_a_replay_decides_the_same_compiled_and_in_plain_python(tmp_path: Path) -> None:
    fast, fast_rows = _sim(tmp_path / "compiled")
    pure, pure_rows = _sim(tmp_path / "pure", HICACHE_PURE="1")
    assert fast_rows == pure_rows  # every request's tiers, bytes and times
    assert fast_rows

    def decisions(summary: dict) -> dict:
        return {b: {k: v for k, v in s.items() if k != "wall_s"} for b, s in summary["runs"].items()}

    assert decisions(fast) == decisions(pure)


# The core's property and refusal suites, run again on plain Python (in this process they run on
# the build): a refusal, a decision or an invariant that differs between the two fails here.
PLAIN_SUITES = (
    "tests/test_refusals.py",
    "tests/test_partial_failures.py",
    "tests/test_decode_stateful.py",
    "tests/test_tree_stateful.py",
)


@pytest.mark.process
@needs_build
def test_the_core_property_and_refusal_suites_pass_on_plain_python_too() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PLAIN_SUITES],
        cwd=ROOT,
        # The suites run at the CI profile's 100 examples on the build; here, with 20 (the dev
        # profile), they show that the plain sources hold the same invariants.
        env={**os.environ, "HICACHE_PURE": "1", "HICACHE_HYPOTHESIS_PROFILE": "dev"},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert " passed" in run.stdout.splitlines()[-1]

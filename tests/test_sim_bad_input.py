"""Bad input to `hicache sim run` ends in a message naming the field, not in a traceback, a
MemoryError or a segfault: values that cannot fit the machine are refused from an estimate made
before anything is allocated; a run in which a baseline completes nothing exits non-zero with
the reason; a results folder that cannot be written is refused."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.core.pool import SlotPool
from hicache.scenarios import fit as workload_fit
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import ScenarioError, load_scenario, parse_scenario
from hicache.sim import fit as cluster_fit
from hicache.sim.runner import OutputError, check_out, run_baselines, write_outputs
from hicache.sim.setup import setups

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "scenarios" / "demo.toml"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("cache.l1_tokens=1000000000000", "cache.l1_tokens"),
        ("cache.l2_tokens=1000000000000000", "cache.l2_tokens"),
        ("cache.hicache_ratio=1e9", "cache.hicache_ratio"),
        ("cluster.decode_nodes=1000000000", "cluster.decode_nodes"),
        ("cluster.prefill_nodes=1000000000", "cluster.prefill_nodes"),
        ("hardware.gpus_per_node=1000000000", "hardware.gpus_per_node"),
    ],
)
def test_a_cluster_too_big_for_the_machine_names_its_field(override: str, field: str) -> None:
    scenario = load_scenario(DEMO, [override])
    with pytest.raises(ScenarioError) as info:
        setups(scenario)
    assert info.value.field == field
    assert "of memory, more than the" in info.value.detail


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("workload.system_prompt=1000000000000", "workload.system_prompt"),
        ("workload.system_prompt=1000000000", "workload.system_prompt"),  # fits one request
        ("workload.conversations=1000000000000", "workload.conversations"),
        ("workload.turns=10000000", "workload.turns"),
        ("workload.user_tokens=[1000000000000, 1000000000000]", "workload.user_tokens"),
        ("workload.output_tokens=[1000000000000, 1000000000000]", "workload.output_tokens"),
    ],
)
def test_a_workload_too_big_for_the_machine_names_its_field(override: str, field: str) -> None:
    with pytest.raises(ScenarioError) as info:
        build_workload(load_scenario(DEMO, [override]))
    assert info.value.field == field


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        ("agentic", "tool_output_tokens", [10**10, 10**10]),
        ("agentic", "sessions", 10**12),
        ("shared_prefix", "question_tokens", [10**12, 10**12]),
        ("shared_prefix", "groups", 10**12),
    ],
)
def test_other_generators_are_estimated_too(kind: str, field: str, value: object) -> None:
    doc = {"workload": {"kind": kind, field: value}}
    with pytest.raises(ScenarioError) as info:
        build_workload(parse_scenario(doc, "big.toml"))
    assert info.value.field == f"workload.{field}"


def test_the_estimates_are_lower_bounds_of_what_is_allocated() -> None:
    """Measured here, so that a change of the pools (or of the generators) that makes an
    estimate exceed what is really used, and so refuse runs that fit, fails this test."""
    n = 200_000
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    pool = SlotPool("L1", n)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert pool.capacity == n
    assert cluster_fit.POOL_BYTES_PER_PAGE * n <= used <= 2.5 * cluster_fit.POOL_BYTES_PER_PAGE * n
    scenario = load_scenario(DEMO, ["workload.conversations=20"])
    params = scenario.workload.generator_params()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    items = build_workload(scenario)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert items
    assert workload_fit.generated_bytes("multiturn", params) <= used


def test_a_machine_too_small_for_ordinary_values_blames_the_biggest_reduction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(workload_fit, "memory_budget", lambda: 10_000)
    with pytest.raises(ScenarioError) as info:
        build_workload(load_scenario(DEMO))
    assert info.value.field == "workload.conversations"  # the demo's own values, all ordinary
    with pytest.raises(ScenarioError) as info:
        setups(load_scenario(DEMO))
    assert info.value.field.startswith(("cache.", "cluster."))


@pytest.mark.slow
def test_a_huge_name_is_refused_before_it_titles_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "big.toml"
    path.write_text(f'name = "{"x" * 100_000_000}"\n', encoding="utf-8")
    out = tmp_path / "out"
    assert main(["sim", "run", str(path), "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "name: expected at most 256 characters, got a string of 100,000,000" in err
    assert len(err) < 500 and not out.exists()


@pytest.mark.parametrize(
    ("override", "field"),
    [("model.name", "model.name"), ("hardware.gpu", "hardware.gpu"), ("workload.kind", "workload.kind")],
)
def test_long_strings_never_flood_a_message(override: str, field: str) -> None:
    with pytest.raises(ScenarioError) as info:
        load_scenario(DEMO, [f'{override}="{"y" * 100_000}"'])
    assert info.value.field == field and len(str(info.value)) < 500


def test_a_cluster_that_fits_is_not_refused() -> None:
    big = load_scenario(DEMO, ["cache.l1_tokens=10000000", "cluster.decode_nodes=4"])
    assert set(setups(big)) == set(big.run.baselines)


# --- runs that complete nothing ----------------------------------------------------------------


def test_a_baseline_that_completes_nothing_exits_non_zero_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    sets = ["--set", "cache.l1_tokens=640", "--set", "workload.conversations=3"]
    assert main(["sim", "run", str(DEMO), "--quiet", "--out", str(out), *sets]) == 2
    err = capsys.readouterr().err
    assert "baseline no_decode_cache completed none of its 15 requests" in err
    assert "failed: needs" in err and "L1 pages, L1 holds 10" in err
    assert str(out) in err and (out / "requests.csv").exists()  # written for a look


def test_a_run_that_completes_something_in_every_baseline_is_fine(tmp_path: Path) -> None:
    scenario = load_scenario(DEMO, ["workload.conversations=2", 'run.baselines=["l1"]'])
    results = run_baselines(scenario)
    assert write_outputs(tmp_path, scenario, results)


def test_until_before_every_arrival_is_refused() -> None:
    with pytest.raises(ScenarioError) as info:
        build_workload(load_scenario(DEMO, ["run.until=0.001"]))
    assert info.value.field == "run.until" and "nothing to replay" in info.value.detail


# --- the results folder ----------------------------------------------------------------------


def test_out_must_be_a_folder_that_can_be_written(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(OutputError, match="exists and is not a folder"):
        check_out(a_file)
    with pytest.raises(OutputError, match="cannot write there"):
        check_out(a_file / "below")
    with pytest.raises(OutputError, match="cannot write there"):
        check_out(tmp_path / ("n" * 300))  # a name longer than a file system takes
    assert check_out(tmp_path / "new" / "deep") == tmp_path / "new" / "deep"
    assert (tmp_path / "new" / "deep").is_dir() and not list((tmp_path / "new" / "deep").iterdir())


def test_a_bad_out_is_a_message_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    sets = ["--set", "workload.conversations=2"]
    assert main(["sim", "run", str(DEMO), "--quiet", "--out", str(a_file / "below"), *sets]) == 2
    assert "cannot write there" in capsys.readouterr().err

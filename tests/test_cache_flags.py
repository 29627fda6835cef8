"""One config path: a scenario's settings, the node's flags (ours and SGLang's) and `hicache serve`
all reach the same decode-core configuration, and nothing a scenario states is dropped."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import attrs
import hypothesis.strategies as st
import pytest
from builders import examples
from helpers import hicache
from hypothesis import given, settings

from hicache.cli import build_parser
from hicache.core.config import PREFETCH_POLICIES, PROMISE_POLICIES, RETRACT_POLICIES
from hicache.core.eviction import EVICTION_POLICIES
from hicache.runtime import cache_flags
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.nodes import layout_for
from hicache.runtime.runner import node_args
from hicache.scenarios.scenario import CacheSpec, load_scenario

DECODE = ["node", "decode", "--engine", "tcp", "--prefill", "127.0.0.1:1"]
SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "runtime_multiturn.toml"


def parse(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args([*DECODE, *flags])


def test_every_cache_setting_of_a_scenario_has_a_flag() -> None:
    assert cache_flags.cache_spec_fields_without_flag() == []


cache_specs = st.builds(
    CacheSpec,
    page_size=st.sampled_from([1, 4, 16, 64]),
    hicache_ratio=st.floats(0, 4, allow_nan=False).map(lambda x: round(x, 3)),
    eviction=st.sampled_from(sorted(EVICTION_POLICIES)),
    write_policy=st.sampled_from(list(cache_flags.WRITE_POLICIES)),
    promise=st.sampled_from(PROMISE_POLICIES),
    prefetch_policy=st.sampled_from(PREFETCH_POLICIES),
    prefetch_threshold_tokens=st.integers(0, 10_000),
    prefetch_timeout_base=st.floats(0, 10, allow_nan=False),
    prefetch_timeout_per_ki_token=st.floats(0, 1, allow_nan=False),
    prefetch_timeout_max=st.floats(0, 100, allow_nan=False),
    load_batches_in_flight=st.integers(1, 8),
    decode_reserve_tokens=st.integers(0, 4096),
    transfer_retries=st.integers(0, 9),
    transfer_backoff_s=st.floats(0, 3, allow_nan=False),
    transfer_backoff_max_s=st.floats(0, 30, allow_nan=False),
    retract_policy=st.sampled_from(RETRACT_POLICIES),
)


@settings(max_examples=examples(25), deadline=None)
@given(
    cache=cache_specs,
    l3=st.floats(1e6, 1e12, allow_nan=False),
    l3_latency=st.floats(0, 0.1, allow_nan=False),
    network=st.one_of(st.none(), st.floats(1e6, 1e12, allow_nan=False)),
    max_running=st.integers(1, 512),
    tick=st.floats(1e-4, 0.1, allow_nan=False),
)
def test_a_scenario_reaches_the_decode_node_whole(
    cache: CacheSpec, l3: float, l3_latency: float, network: float | None, max_running: int, tick: float
) -> None:
    """What `hicache run --runtime` starts a decode node with, parsed as that node parses it,
    is the core configuration the scenario states: every policy, timeout, retry and estimate."""
    base = load_scenario(SCENARIO)
    scenario = attrs.evolve(
        base,
        cache=cache,
        storage=attrs.evolve(base.storage, bandwidth=l3, latency=l3_latency),
        hardware=attrs.evolve(base.hardware, network_bandwidth=network),
        cluster=attrs.evolve(base.cluster, max_running=max_running, tick_interval=tick),
    )
    argv = node_args(scenario, "tcp", Path("/tmp/l3"), 1)
    args = build_parser().parse_args(["node", *argv])
    got = cache_flags.decode_config(args)
    l1 = 65_536 // cache.page_size
    groups = base.cluster.transfer_groups or cache_flags.MAX_LAYER_GROUPS
    estimates: dict[str, float] = {"l3_bandwidth": l3, "l3_latency": l3_latency}
    estimates["transfer_groups"] = groups if base.cluster.layerwise_transfer else 0
    if network is not None:
        estimates["network_bandwidth"] = network
    want = cache.decode_config(l1, cache.l2_pages_for(l1), max_running=max_running, **estimates)
    assert got == want
    assert args.tick_interval == tick
    assert args.storage_dir == Path("/tmp/l3")


def test_a_bounded_l3_reaches_the_node_in_the_runtime_models_bytes() -> None:
    base = load_scenario(SCENARIO)
    bounded = attrs.evolve(base, storage=attrs.evolve(base.storage, capacity_tokens=1000))
    args = build_parser().parse_args(["node", *node_args(bounded, "tcp", Path("/tmp/l3"), 1)])
    token_bytes = layout_for(TinyModel(TinyConfig()).config, base.cache.page_size).token_bytes
    assert args.storage_capacity == 1000 * token_bytes
    unbounded = build_parser().parse_args(["node", *node_args(base, "tcp", Path("/tmp/l3"), 1)])
    assert base.storage.capacity_tokens == 0 and unbounded.storage_capacity == 0


def test_a_per_transfer_rate_is_the_network_estimate() -> None:
    base = load_scenario(SCENARIO)
    hardware = attrs.evolve(base.hardware, network_bandwidth=50e9, transfer_rate=1e9)
    capped = attrs.evolve(base, hardware=hardware)
    args = build_parser().parse_args(["node", *node_args(capped, "tcp", Path("/tmp/l3"), 1)])
    assert cache_flags.decode_config(args).network_bandwidth == 1e9


def test_sglangs_flag_names_set_the_same_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache_flags.SGLANG_FILE_DIR_ENV, str(tmp_path))
    args = parse(
        "--page-size", "64", "--l1-pages", "100", "--hicache-ratio", "1.2",
        "--hicache-write-policy", "write_back", "--hicache-storage-prefetch-policy", "wait_complete",
        "--radix-eviction-policy", "lfu", "--num-reserved-decode-tokens", "128",
        "--max-running-requests", "7", "--hicache-storage-backend", "file",
    )  # fmt: skip
    cfg = cache_flags.decode_config(args)
    assert (cfg.page_size, cfg.l1_pages, cfg.l2_pages) == (64, 100, 120)
    assert (cfg.write_policy.value, cfg.prefetch_policy.value, cfg.eviction) == (
        "write_back",
        "wait_complete",
        "lfu",
    )
    assert (cfg.decode_reserve_tokens, cfg.max_running, cfg.storage) == (128, 7, True)
    assert cache_flags.storage_kind(args) == ("file", tmp_path)


def test_the_storage_flags_choose_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cache_flags.SGLANG_FILE_DIR_ENV, raising=False)
    # No L3 unless one is named (as SGLang): a memory one would only copy L2, and grow.
    assert cache_flags.storage_kind(parse()) == ("none", None)
    assert cache_flags.decode_config(parse()).storage is False
    assert cache_flags.storage_kind(parse("--hicache-storage-backend", "memory")) == ("memory", None)
    assert cache_flags.storage_kind(parse("--storage-dir", str(tmp_path))) == ("file", tmp_path)
    assert cache_flags.storage_kind(parse("--hicache-storage-backend", "file")) == (
        "file",
        cache_flags.SGLANG_FILE_DIR_DEFAULT,
    )
    nixl = parse("--hicache-storage-backend", "nixl", "--storage-dir", str(tmp_path))
    assert cache_flags.storage_kind(nixl) == ("nixl", tmp_path)
    for off in (["--no-storage"], ["--hicache-storage-backend", "none"], ["--no-decode-cache"]):
        args = parse(*off)
        assert cache_flags.storage_kind(args) == ("none", None)
        assert cache_flags.decode_config(args).storage is False
    with pytest.raises(
        cache_flags.SettingsError, match="--hicache-storage-backend file: contradicts --no-storage"
    ):
        cache_flags.storage_kind(parse("--no-storage", "--hicache-storage-backend", "file"))
    with pytest.raises(cache_flags.SettingsError, match="--storage-dir: not used by"):
        cache_flags.storage_kind(parse("--hicache-storage-backend", "memory", "--storage-dir", str(tmp_path)))


def test_l2_comes_from_pages_then_size_then_ratio() -> None:
    assert cache_flags.decode_config(parse("--l1-pages", "10")).l2_pages == 20  # the default ratio 2
    assert cache_flags.decode_config(parse("--l1-pages", "10", "--hicache-ratio", "0.5")).l2_pages == 5
    sized = parse("--l1-pages", "10", "--hicache-size", "0.001")
    assert cache_flags.decode_config(sized, page_bytes=4096).l2_pages == 244  # 1e6 // 4096
    assert cache_flags.l2_gigabytes(sized) == 0.001  # the node sizes it once the model is known
    explicit = parse("--l1-pages", "10", "--hicache-size", "0.001", "--l2-pages", "3")
    assert cache_flags.decode_config(explicit, page_bytes=4096).l2_pages == 3
    assert cache_flags.l2_gigabytes(explicit) == 0.0
    assert cache_flags.decode_config(parse("--no-decode-cache")).l2_pages == 0


def test_sglangs_extra_config_sets_the_prefetch_settings_unless_a_flag_does(tmp_path: Path) -> None:
    extra = {"prefetch_threshold": 64, "prefetch_timeout_max": 9.5, "master_server_address": "x:1"}
    cfg = cache_flags.decode_config(parse("--hicache-storage-backend-extra-config", json.dumps(extra)))
    assert (cfg.prefetch_threshold_tokens, cfg.prefetch_timeout_max) == (64, 9.5)
    path = tmp_path / "extra.json"
    path.write_text(json.dumps(extra))
    args = parse("--hicache-storage-backend-extra-config", f"@{path}", "--prefetch-threshold-tokens", "8")
    assert cache_flags.decode_config(args).prefetch_threshold_tokens == 8
    bad = parse("--hicache-storage-backend-extra-config", '{"prefetch_threshold": -1}')
    with pytest.raises(
        cache_flags.SettingsError, match="extra-config prefetch_threshold: expected an integer >= 0"
    ):
        cache_flags.decode_config(bad)


@pytest.mark.process
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--radix-eviction-policy", "lru2"], "invalid choice: 'lru2'"),
        (["--hicache-ratio", "-1"], "expected a finite number >= 0"),
        (["--hicache-storage-backend-extra-config", "[1]"], "expected a JSON object, got list"),
        (["--hicache-storage-backend", "mooncake"], "invalid choice: 'mooncake'"),
        (["--no-storage", "--hicache-storage-backend", "file"], "contradicts --no-storage"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_flag(flags: list[str], expected: str) -> None:
    done = hicache(*DECODE, *flags, timeout=120)
    assert done.returncode == 2
    assert expected in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_serve_passes_its_cache_flags_on_to_the_decode_node() -> None:
    serve = build_parser().parse_args(
        ["serve", "--l1-pages", "77", "--hicache-write-policy", "write_back", "--hicache-ratio", "3"]
        + ["--transfer-retries", "1", "--no-storage", "--l3-bandwidth", "1e9"]
    )
    passed = cache_flags.forwarded(serve)
    node = parse(*passed)
    assert (
        cache_flags.decode_config(node)
        == cache_flags.decode_config(serve)
        != cache_flags.decode_config(parse())
    )
    assert cache_flags.forwarded(build_parser().parse_args(["serve"])) == []


@pytest.mark.process
def test_serve_refuses_a_tp_size_for_a_node_it_does_not_start() -> None:
    done = hicache("serve", "--decode", "127.0.0.1:1", "--tp-size", "2", timeout=120)
    assert done.returncode == 2
    assert "--tp-size: sets the decode node started here" in done.stderr


@pytest.mark.process
def test_serve_refuses_cache_flags_for_a_node_it_does_not_start() -> None:
    done = hicache("serve", "--decode", "127.0.0.1:1", "--l1-pages", "5", timeout=120)
    assert done.returncode == 2
    assert "--l1-pages: sets the decode node started here" in done.stderr


@pytest.mark.process
def test_help_states_choices_and_defaults() -> None:
    done = hicache("node", "decode", "--help", timeout=120)
    out = " ".join(done.stdout.split())
    assert "--hicache-write-policy {write_through,write_through_selective,write_back}" in out
    assert "--radix-eviction-policy {lru,mru,lfu,fifo,priority}" in out
    assert "(default: timeout)" in out and "(default: --hicache-ratio x --l1-pages)" in out


def test_serve_passes_its_prefill_scheduler_flags_on_to_the_prefill_nodes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from hicache.commands.runtime_commands import run_serve
    from hicache.runtime import serve

    seen: list[serve.ServeOptions] = []
    monkeypatch.setattr(serve, "main", lambda opts: seen.append(opts) or 0)
    args = build_parser().parse_args(
        ["serve", "--chunked-prefill-size", "256", "--max-prefill-tokens", "2048"]
    )
    assert run_serve(args) == 0
    node = build_parser().parse_args(["node", *serve.prefill_args(seen[0], tmp_path / "a")])
    assert (node.chunked_prefill_size, node.max_prefill_tokens) == (256, 2048)
    plain = build_parser().parse_args(["node", *serve.prefill_args(serve.ServeOptions(), tmp_path / "a")])
    default = build_parser().parse_args(["node", "prefill"])
    assert (plain.chunked_prefill_size, plain.max_prefill_tokens) == (
        default.chunked_prefill_size,
        default.max_prefill_tokens,
    )


@pytest.mark.process
def test_serve_refuses_prefill_scheduler_flags_for_nodes_it_does_not_start() -> None:
    done = hicache("serve", "--prefill", "127.0.0.1:1", "--chunked-prefill-size", "64", timeout=120)
    assert done.returncode == 2
    assert "--chunked-prefill-size: sets the prefill nodes started here" in done.stderr

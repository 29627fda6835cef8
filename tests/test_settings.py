"""Every decode-node setting is described once, in the core (`DecodeConfig`'s field metadata and
`hicache.core.config.L2_SIZE`), and the three places users state it agree: a node's flag (ours,
an alias or SGLang's), a scenario's key and the core's default; and L2 is sized by one rule,
`l2_pages`, which gives what each of the five places that sized it before computed."""

from __future__ import annotations

import argparse
import ast
import math
from pathlib import Path
from typing import Any

import attrs
import hypothesis.strategies as st
import pytest
from builders import examples
from hypothesis import example, given, settings

from hicache.cli import build_parser
from hicache.core.config import (
    HICACHE_RATIO,
    L2_SIZE,
    DecodeConfig,
    decode_settings,
    hicache_ratio_of,
    l2_pages,
)
from hicache.core.settings import UNSET, Setting, plain
from hicache.runtime import cache_flags
from hicache.scenarios.scenario import CACHE_SETTINGS, CacheSpec, parse_scenario, section_keys

ROOT = Path(__file__).resolve().parent.parent
DECODE = ["node", "decode", "--engine", "tcp", "--prefill", "127.0.0.1:1"]
SETTINGS = decode_settings()
FLAGGED = {name: s for name, s in SETTINGS.items() if s.flag is not None}
IN_CACHE = {name: s for name, s in SETTINGS.items() if s.scenario_key("cache") is not None}
# Where a runtime node starts from another default than the core's, on purpose (`node_default`).
NODE_DEFAULTS = {
    "l1_pages": 1024,
    "l2_pages": None,
    "page_size": 16,
    "transfer_retries": 6,
    "transfer_backoff_s": 0.2,
    "write_policy": None,  # by whether an L3 is named (`test_a_node_backs_up_...`)
}


def parse(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args([*DECODE, *flags])


def values_of(s: Setting) -> st.SearchStrategy[Any]:
    """Values the setting accepts, as the core holds them."""
    if s.choices is not None:
        return st.sampled_from(s.choices)
    low = s.low or 0
    if s.kind is int:
        return st.integers(int(low), int(low) + 10**6)
    return st.floats(low, 1e12, allow_nan=False, allow_infinity=False)


def text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


# --- described once -----------------------------------------------------------------------------


def test_every_field_of_the_core_config_is_described() -> None:
    assert set(SETTINGS) == set(attrs.fields_dict(DecodeConfig))
    for name, s in SETTINGS.items():
        assert s.name == name and s.help, name
        assert (s.default is UNSET) == (name in ("l1_pages", "l2_pages")), name  # the sizes drivers give


def test_the_core_stays_free_of_argparse() -> None:
    for path in sorted((ROOT / "hicache" / "core").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "argparse" not in names, path


def test_the_node_flags_of_core_settings_are_generated_from_the_descriptions() -> None:
    """runtime/cache_flags.py writes out only the node's own --tick-interval and
    --prefill-silence-timeout; every other flag of its table is a core setting's, as described."""
    literal = [f for f in cache_flags.ALL_FLAGS if f.dest not in cache_flags.SETTINGS]
    assert literal == [cache_flags.TICK_INTERVAL, cache_flags.PREFILL_SILENCE]
    for f in cache_flags.ALL_FLAGS:
        if f.dest in cache_flags.SETTINGS:
            made = cache_flags.Flag.of(cache_flags.SETTINGS[f.dest])
            assert attrs.evolve(f, kind=str) == attrs.evolve(made, kind=str)  # parsers: closures
    assert set(cache_flags.SETTINGS) == set(FLAGGED) | {"hicache_ratio", "hicache_size_gb"}
    assert cache_flags.EXTRA_CONFIG_KEYS == {
        "prefetch_threshold": "prefetch_threshold_tokens",
        "prefetch_timeout_base": "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token": "prefetch_timeout_per_ki_token",
        "prefetch_timeout_max": "prefetch_timeout_max",
    }


def test_the_scenarios_cache_keys_are_generated_from_the_descriptions() -> None:
    assert section_keys("cache") == tuple(CACHE_SETTINGS)
    assert tuple(CACHE_SETTINGS)[:4] == ("page_size", "l1_tokens", "hicache_ratio", "l2_tokens")
    described = {s.scenario_key("cache") for s in (*SETTINGS.values(), *L2_SIZE.values())} - {None}
    assert set(CACHE_SETTINGS) == described | {"l1_tokens"}
    assert [a.name for a in attrs.fields(CacheSpec)] == list(CACHE_SETTINGS)


def test_sglangs_names_are_accepted_for_the_settings_it_has() -> None:
    sglang = {n for s in (*SETTINGS.values(), *L2_SIZE.values()) for n in s.sglang}
    assert sglang == {
        "--page-size",
        "--tp-size",
        "--hicache-ratio",
        "--hicache-size",
        "--radix-eviction-policy",
        "--hicache-write-policy",
        "--hicache-storage-prefetch-policy",
        "--num-reserved-decode-tokens",
        "--max-running-requests",
    }
    for name, s in FLAGGED.items():  # each is one of the flag's names (parsed: the property below)
        assert set(s.sglang) <= set(s.flags), name


# --- one value whichever way it is stated -------------------------------------------------------


@st.composite
def flag_cases(draw: st.DrawFn) -> tuple[str, str, Any]:
    name = draw(st.sampled_from(sorted(FLAGGED)))
    s = FLAGGED[name]
    return name, draw(st.sampled_from(s.flags)), draw(values_of(s))


@settings(max_examples=examples(200), deadline=None)
@given(flag_cases())
def test_parsing_a_settings_flag_under_any_of_its_names_gives_the_field(case: tuple[str, str, Any]) -> None:
    name, spelled, value = case
    config = cache_flags.decode_config(parse(spelled, text(value)))
    assert plain(getattr(config, name)) == value


@st.composite
def cache_cases(draw: st.DrawFn) -> tuple[str, Any]:
    name = draw(st.sampled_from(sorted(IN_CACHE)))
    return name, draw(values_of(IN_CACHE[name]))


@settings(max_examples=examples(200), deadline=None)
@given(cache_cases())
def test_a_scenario_key_gives_the_same_value_as_the_flag(case: tuple[str, Any]) -> None:
    name, value = case
    s = IN_CACHE[name]
    cache = parse_scenario({"cache": {s.scenario_key("cache"): value}}, "x.toml").cache
    from_scenario = cache.decode_config(l1_pages=10, l2_pages=0)
    from_flag = cache_flags.decode_config(parse(s.flag, text(value)))
    assert plain(getattr(from_scenario, name)) == value == plain(getattr(from_flag, name))


@settings(max_examples=examples(100), deadline=None)
@given(
    l1=st.integers(1, 1 << 20),
    page=st.integers(1, 256),
    ratio=st.floats(0, 8, allow_nan=False).map(lambda x: round(x, 3)),
)
def test_a_ratio_sizes_l2_alike_as_a_flag_and_as_a_scenario_key(l1: int, page: int, ratio: float) -> None:
    node = cache_flags.decode_config(
        parse("--l1-pages", str(l1), "--page-size", str(page), "--hicache-ratio", repr(ratio))
    )
    cache = parse_scenario({"cache": {"page_size": page, "hicache_ratio": ratio}}, "x.toml").cache
    assert node.l2_pages == cache.l2_pages_for(l1) == l2_pages(l1, page, hicache_ratio=ratio)


# --- one default --------------------------------------------------------------------------------


def test_defaults_agree_across_the_core_the_scenario_and_the_flags() -> None:
    """The core's default is the scenario's and the node flag's, but where the node starts from
    another on purpose (`node_default`: its L1, L2 and page size, and the retries that ride out a
    prefill restart); a new difference must be stated there, and listed here."""
    core = DecodeConfig(l1_pages=1, l2_pages=0)
    cache = CacheSpec()
    node, serve = parse(), build_parser().parse_args(["serve"])
    for name, s in SETTINGS.items():
        if s.default is not UNSET:
            assert plain(getattr(core, name)) == s.default, name
        key = s.scenario_key("cache")
        if key is not None:
            assert getattr(cache, key) == s.default, name
        if s.flag is not None:
            want = NODE_DEFAULTS.get(name, s.default)
            assert getattr(node, name) == getattr(serve, name) == want, name
    assert {n for n, s in SETTINGS.items() if s.node_default is not UNSET} == set(NODE_DEFAULTS)
    assert all(SETTINGS[n].why_node_default for n in NODE_DEFAULTS)
    for name, s in L2_SIZE.items():  # the inputs of l2_pages
        if s.scenario_key("cache"):
            assert getattr(cache, s.scenario_key("cache")) == s.default
        if s.flag:
            assert getattr(node, name) == s.default
    assert cache.hicache_ratio == node.hicache_ratio == HICACHE_RATIO


def test_a_node_with_no_flags_runs_the_cores_defaults_but_its_own() -> None:
    config = cache_flags.decode_config(parse())
    assert config == DecodeConfig(
        l1_pages=1024,
        l2_pages=2048,
        page_size=16,
        transfer_retries=6,
        transfer_backoff_s=0.2,
        storage=False,
        write_policy="write_back",
    )


@pytest.mark.parametrize(
    ("flags", "policy"),
    [
        ((), "write_back"),  # L1 and L2 are the same host memory: each page once
        (("--hicache-storage-backend", "memory"), "write_through"),  # on to L3 at once
        (("--storage-dir", "/tmp/l3"), "write_through"),
        (("--hicache-write-policy", "write_through"), "write_through"),  # given: as given
        (("--storage-dir", "/tmp/l3", "--hicache-write-policy", "write_back"), "write_back"),
        (("--hicache-write-policy", "write_through_selective"), "write_through_selective"),
    ],
)
def test_a_node_backs_up_through_to_l2_only_when_an_l3_is_named_unless_told(
    flags: tuple[str, ...], policy: str
) -> None:
    assert cache_flags.decode_config(parse(*flags)).write_policy == policy


def test_where_another_scenario_section_states_a_setting_its_default_is_the_sections_own() -> None:
    """Settings a scenario states outside [cache] describe its modelled hardware and cluster, with
    their own defaults (and None: the preset's figure); the simulator passes them to the core."""
    scenario = parse_scenario({}, "x.toml")
    differ = {}
    for s in SETTINGS.values():
        if s.scenario is not None and s.scenario_key("cache") is None:
            section, key = s.scenario.split(".")
            value = getattr(getattr(scenario, section), key)
            if value != s.default:
                differ[s.scenario] = value
    assert differ == {
        "storage.bandwidth": 10e9,
        "cluster.max_running": 256,
        "cluster.layerwise_transfer": True,  # becomes the transfer groups (`cache_flags.layer_groups`)
        "hardware.host_bandwidth": None,
        "hardware.network_bandwidth": None,
        "hardware.network_latency": None,
    }


# --- L2's one rule, against the five places that sized it before ---------------------------------
# The formulas as they were, kept as the reference.


def before_cache_flags(l1: int, ratio: float, size_gb: float, page_bytes: int | None) -> int:
    """runtime/cache_flags.py `decode_config`, no --l2-pages given."""
    if size_gb > 0 and page_bytes is not None:
        return int(size_gb * 1e9 // page_bytes)
    return int(ratio * l1)


def before_nodes(l2_gigabytes: float, page_bytes: int) -> int:
    """runtime/nodes.py `_run_decode`, with --hicache-size."""
    return int(l2_gigabytes * 1e9 // page_bytes)


def before_cache_spec(l1_tokens: int, l2_tokens: int, ratio: float) -> int:
    """scenarios/scenario.py `CacheSpec.l2_tokens_for` (tokens; its callers divided by the page)."""
    return l2_tokens if l2_tokens > 0 else int(ratio * l1_tokens)


def before_tier_pages(l1_pages: int, page: int, l2_tokens: int, ratio: float, p1: int) -> tuple[int, int]:
    """sim/setup.py `tier_pages`: the decode node's L2, and a caching prefill node's."""
    return before_cache_spec(l1_pages * page, l2_tokens, ratio) // page, int(p1 * ratio)


def before_twin(l1_pages: int, l2_pages_: int, page: int) -> float | None:
    """sim/twin.py `scenario_doc`: the ratio it wrote, or None when it wrote l2_tokens."""
    ratio = l2_pages_ / l1_pages
    return ratio if int(ratio * (l1_pages * page)) == l2_pages_ * page else None


PAGES = st.integers(1, 1 << 24)
PAGE_SIZES = st.one_of(st.sampled_from([1, 2, 4, 16, 32, 64, 128, 256]), st.integers(1, 1000))
RATIOS = st.one_of(
    st.floats(0, 16, allow_nan=False).map(lambda x: round(x, 3)), st.floats(0, 16, allow_nan=False)
)
GIGABYTES = st.floats(0, 4096, allow_nan=False)
PAGE_BYTES = st.integers(1, 1 << 30)


def power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


@settings(max_examples=examples(300), deadline=None)
@given(
    l1=PAGES, page=PAGE_SIZES, ratio=RATIOS, size_gb=GIGABYTES, page_bytes=st.one_of(st.none(), PAGE_BYTES)
)
@example(l1=1000, page=3, ratio=0.009, size_gb=0.0, page_bytes=None)
def test_l2_pages_is_what_the_runtime_flags_computed(
    l1: int, page: int, ratio: float, size_gb: float, page_bytes: int | None
) -> None:
    """By size, exactly. By ratio, the flags counted in pages (`int(ratio * l1)`) where the rule
    counts in tokens (`int(ratio * l1 * page) // page`, as the scenario did and SGLang does):
    the same at every power-of-two page size (multiplying by 2**k is exact in floating point);
    at other page sizes the two float roundings can part by a page, where ratio x L1 is a whole
    number of pages (0.009 x 1000 pages of 3 tokens: 9 before, 8 now)."""
    sized = size_gb > 0 and page_bytes is not None
    new = l2_pages(
        l1, page, hicache_ratio=ratio, l2_bytes=size_gb * 1e9 if sized else 0.0, page_bytes=page_bytes or 0
    )
    old = before_cache_flags(l1, ratio, size_gb, page_bytes)
    if sized or power_of_two(page):
        assert new == old
    else:
        assert new == before_cache_spec(l1 * page, 0, ratio) // page and abs(new - old) <= 1
        assert new == old or math.isclose(ratio * l1, round(ratio * l1), rel_tol=1e-12)


def test_l2_pages_at_page_size_three_is_the_token_rule() -> None:
    assert before_cache_flags(1000, 0.009, 0.0, None) == 9  # 0.009 * 1000 == 9.0 in floats
    assert l2_pages(1000, 3, hicache_ratio=0.009) == before_cache_spec(3000, 0, 0.009) // 3 == 8


@settings(max_examples=examples(300), deadline=None)
@given(l1=PAGES, page=PAGE_SIZES, size_gb=GIGABYTES.filter(lambda g: g > 0), page_bytes=PAGE_BYTES)
def test_l2_pages_is_what_the_node_computed_from_hicache_size(
    l1: int, page: int, size_gb: float, page_bytes: int
) -> None:
    new = l2_pages(l1, page, l2_bytes=size_gb * 1e9, page_bytes=page_bytes)
    assert new == before_nodes(size_gb, page_bytes)


@settings(max_examples=examples(300), deadline=None)
@given(l1=PAGES, page=PAGE_SIZES, l2_tokens=st.one_of(st.just(0), st.integers(0, 1 << 40)), ratio=RATIOS)
def test_l2_pages_is_what_the_scenario_computed(l1: int, page: int, l2_tokens: int, ratio: float) -> None:
    """CacheSpec.l2_tokens_for (then divided by the page, by sim/setup.py's `tier_pages` and
    runtime/cache_flags.py's `scenario_flags`) and the sim's decode L2: exactly."""
    cache = CacheSpec(page_size=page, l2_tokens=l2_tokens, hicache_ratio=ratio)
    want = before_cache_spec(l1 * page, l2_tokens, ratio) // page
    assert cache.l2_pages_for(l1) == l2_pages(l1, page, hicache_ratio=ratio, l2_tokens=l2_tokens) == want
    assert want == before_tier_pages(l1, page, l2_tokens, ratio, 1)[0]


@settings(max_examples=examples(300), deadline=None)
@given(p1=PAGES, page=PAGE_SIZES, ratio=RATIOS)
def test_l2_pages_is_what_the_sim_gave_a_prefill_node(p1: int, page: int, ratio: float) -> None:
    """A caching prefill node's L2 was `int(p1 * ratio)`, in pages: the same at power-of-two page
    sizes, within a page at others (see the runtime flags above)."""
    new = l2_pages(p1, page, hicache_ratio=ratio)
    old = before_tier_pages(1, page, 0, ratio, p1)[1]
    if power_of_two(page):
        assert new == old
    else:
        assert abs(new - old) <= 1


@settings(max_examples=examples(300), deadline=None)
@given(l1=PAGES, l2=st.integers(0, 1 << 26), page=PAGE_SIZES)
@example(l1=3, l2=1, page=16)
@example(l1=7, l2=3, page=3)
def test_hicache_ratio_of_is_the_twins_reverse_map(l1: int, l2: int, page: int) -> None:
    ratio = hicache_ratio_of(l1, l2, page)
    assert ratio == before_twin(l1, l2, page)
    if ratio is not None:  # the ratio gives the recorded L2 back
        assert l2_pages(l1, page, hicache_ratio=ratio) == l2


def test_l2_rules_apply_in_order() -> None:
    assert l2_pages(10, 16) == 20  # the default ratio, 2
    assert l2_pages(10, 16, hicache_ratio=0.5, l2_tokens=100) == 6  # tokens first, whole pages
    assert l2_pages(10, 16, hicache_ratio=0.5, l2_bytes=1e6, page_bytes=4096) == 244  # then bytes
    assert l2_pages(10, 16, hicache_ratio=0.5, l2_bytes=1e6, page_bytes=0) == 5  # no page size yet: ratio


@pytest.mark.parametrize("name", sorted(FLAGGED))
def test_help_states_each_settings_flag_and_default(name: str) -> None:
    s = FLAGGED[name]
    group = argparse.ArgumentParser()
    cache_flags.flag(name).add_to(group)
    help_text = " ".join(group.format_help().split())
    for spelled in s.flags:
        assert spelled in help_text
    assert "(default: " in help_text

"""The flags that fit a node's memory to its model: `--dtype`, `--kv-cache-dtype`,
`--max-total-tokens` and `--mem-fraction-static` (SGLang's names). Bad values are refused in one
line naming the flag; L1 sized from memory follows SGLang's rules (`runtime/kv/l1_sizing.py`);
`hicache serve` passes the flags on to the nodes it starts."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.cli import build_parser
from hicache.runtime import cache_flags
from hicache.runtime.kv.l1_sizing import Memory, SizingError, host_memory, l1_pages_for

GiB = 2**30


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


DECODE = ["node", "decode", "--prefill", "127.0.0.1:9"]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype"),
        (["--kv-cache-dtype", "float64"], "--kv-cache-dtype"),
        (["--dtype", "half"], "--dtype"),
        (["--max-total-tokens", "0"], "--max-total-tokens"),
        (["--max-total-tokens", "many"], "--max-total-tokens"),
        (["--mem-fraction-static", "1"], "--mem-fraction-static"),
        (["--mem-fraction-static", "0"], "--mem-fraction-static"),
        (["--mem-fraction-static", "-0.5"], "--mem-fraction-static"),
        (["--mem-fraction-static", "x"], "--mem-fraction-static"),
    ],
)
@pytest.mark.parametrize("command", [DECODE, ["serve"]], ids=["decode", "serve"])
def test_bad_values_are_refused_naming_the_flag(
    command: list[str], argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refusal(command + argv, capsys)
    assert f"argument {flag}" in line, line


@pytest.mark.parametrize("flag", ["--dtype", "--kv-cache-dtype"])
def test_the_prefill_node_takes_the_dtype_flags(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert getattr(parse(["node", "prefill", flag, "bfloat16"]), flag[2:].replace("-", "_")) == "bfloat16"
    assert f"argument {flag}" in refusal(["node", "prefill", flag, "int8"], capsys)


def test_l1_flags_that_contradict_each_other_are_refused() -> None:
    args = parse([*DECODE, "--max-total-tokens", "4096", "--l1-pages", "10"])
    with pytest.raises(
        cache_flags.SettingsError, match="--max-total-tokens: sizes L1, and so does --l1-pages"
    ):
        cache_flags.decode_config(args)


def test_serve_passes_the_memory_flags_on_to_its_decode_node() -> None:
    args = parse(["serve", "--max-total-tokens", "8192", "--mem-fraction-static", "0.5"])
    out = cache_flags.forwarded(args)
    assert out[out.index("--max-total-tokens") + 1] == "8192"
    assert float(out[out.index("--mem-fraction-static") + 1]) == 0.5
    again = parse([*DECODE, *out])
    assert (again.max_total_tokens, again.mem_fraction_static) == (8192, 0.5)


def test_l2_follows_a_resized_l1_unless_given_otherwise() -> None:
    assert cache_flags.l2_ratio(parse([*DECODE, "--max-total-tokens", "64"])) == 2.0
    assert cache_flags.l2_ratio(parse([*DECODE, "--hicache-ratio", "3", "--max-total-tokens", "64"])) == 3.0
    assert cache_flags.l2_ratio(parse([*DECODE, "--l2-pages", "5", "--max-total-tokens", "64"])) is None
    assert cache_flags.l2_ratio(parse([*DECODE, "--no-decode-cache"])) is None


@given(
    tokens=st.integers(0, 10**7),
    page_size=st.sampled_from([1, 16, 64]),
    page_bytes=st.integers(8, 2**22),
    fraction=st.sampled_from([0.0, 0.1, 0.5, 0.88, 0.99]),
    total=st.integers(1, 64),
    used=st.floats(0, 1),
)
def test_l1_pages_follow_sglangs_rules(
    tokens: int, page_size: int, page_bytes: int, fraction: float, total: int, used: float
) -> None:
    mem = Memory(total=total * GiB, available=int(total * GiB * (1 - used)))
    want: list[int] = []
    if tokens > 0:
        want.append(tokens // page_size)
    if fraction > 0:
        want.append(max(0, mem.available - int(mem.total * (1 - fraction))) // page_bytes)
    try:
        got = l1_pages_for(
            page_size=page_size,
            page_bytes=page_bytes,
            max_total_tokens=tokens,
            mem_fraction_static=fraction,
            memory=mem,
        )
    except SizingError as exc:
        assert min(want) < 1  # refused only when a rule leaves no page
        assert (
            "--max-total-tokens" if tokens and tokens // page_size < 1 else "--mem-fraction-static"
        ) in str(exc)
        return
    assert got == (min(want) if want else None)
    assert got is None or got >= 1


def test_host_memory_reads_this_machine() -> None:
    mem = host_memory()
    assert 0 < mem.available <= mem.total

"""The `hicache` command refuses bad input in one line that names the flag, with exit status 2;
a node that cannot start (its port taken, its prefill node unreachable or refusing) says why in
one line, exit 2; Ctrl-C stops a runtime replay, keeps what it measured and exits 130; and a
runtime replay leaves no temporary L3 folder behind. Everything runs as the user runs it: a
`python -m hicache` process."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import NodeProcess, free_port, hicache, running

TRACE = [  # two requests at once, the third ten minutes later: Ctrl-C comes in between
    {"timestamp": 0, "input_length": 40, "output_length": 4, "hash_ids": [1]},
    {"timestamp": 1000, "input_length": 40, "output_length": 4, "hash_ids": [2]},
    {"timestamp": 600_000, "input_length": 40, "output_length": 4, "hash_ids": [3]},
]
SCENARIO = """\
[workload]
kind = "trace"
path = "trace.jsonl"

[cache]
page_size = 16
l1_tokens = 1024
prefetch_threshold_tokens = 16
decode_reserve_tokens = 64

[run]
baselines = ["l1_l2_l3"]
"""


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "not-a-folder"
    path.write_text("")
    return path


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    path = tmp_path / "tiny.toml"
    path.write_text(SCENARIO)
    return path


PREFILL = ["node", "prefill", "--engine", "tcp"]
DECODE = ["node", "decode", "--engine", "tcp", "--prefill", "127.0.0.1:1"]
BAD = [
    (PREFILL, "--port", "70000"),
    (PREFILL, "--port", "-5"),
    (PREFILL, "--port", "abc"),
    (PREFILL, "--page-size", "0"),
    (PREFILL, "--staging-pages", "0"),
    (PREFILL, "--mmap-threshold", "-1"),
    (PREFILL, "--model-seed", "-1"),
    (DECODE, "--port", "65536"),
    (DECODE, "--page-size", "-16"),
    (DECODE, "--l1-pages", "0"),
    (DECODE, "--l2-pages", "-1"),
    (DECODE, "--tick-interval", "0"),
    (DECODE, "--max-running", "-1"),
    (DECODE, "--prefetch-threshold-tokens", "-1"),
    (DECODE, "--decode-reserve-tokens", "-1"),
    (DECODE, "--storage-dir", "FILE"),
    (PREFILL, "--max-connections", "0"),
    (DECODE, "--frame-bytes-in-flight", "0"),
    (DECODE, "--frame-timeout", "-1"),
    (PREFILL, "--idle-timeout", "inf"),
    (["node", "decode", "--engine", "tcp"], "--prefill", "localhost:0"),
    (["node", "decode", "--engine", "tcp"], "--prefill", "localhost:70000"),
    (DECODE, "--max-tokens", "0"),
    (DECODE, "--transfer-retries", "-1"),
    (DECODE, "--transfer-backoff", "-0.5"),
    (DECODE, "--transfer-backoff-max", "nan"),
    (["run", "SCENARIO", "--runtime"], "--limit", "-3"),
    (["run", "SCENARIO", "--runtime"], "--time-scale", "-1"),
    (["run", "SCENARIO", "--runtime"], "--time-scale", "nan"),
    (["run", "SCENARIO", "--runtime"], "--storage-dir", "FILE"),
    (["trace", "stats", "TRACE"], "--time-scale", "0"),
    (["serve", "--model", "default"], "--served-model-name", " "),
]


@pytest.mark.process
@pytest.mark.parametrize(("command", "flag", "value"), BAD, ids=[f"{c[1]}{f}={v}" for c, f, v in BAD])
def test_a_bad_flag_value_is_one_line_naming_it_and_exit_2(
    command: list[str], flag: str, value: str, a_file: Path, scenario: Path, tmp_path: Path
) -> None:
    fill = {"FILE": str(a_file), "SCENARIO": str(scenario), "TRACE": str(tmp_path / "trace.jsonl")}
    args = [fill.get(a, a) for a in [*command, flag, value]]
    done = hicache(*args, "--out", str(tmp_path / "out")) if command[0] == "run" else hicache(*args)
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert flag in line and "expected" in line
    assert not (tmp_path / "out").exists()  # refused before anything ran


@contextlib.contextmanager
def prefill_node(*args: str) -> Iterator[tuple[NodeProcess, int]]:
    """A prefill node process (`args`: `node prefill ...`) and its port, stopped with SIGTERM
    when the block ends; its stderr stays readable (`stderr()`)."""
    assert args[0] == "node"
    with running(*args[1:], stop_s=60) as node:
        yield node, node.port


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A port some other socket listens on, for as long as the block runs."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.mark.process
def test_a_prefill_node_on_a_port_in_use_says_so_in_one_line(tmp_path: Path) -> None:
    with taken_port() as port:
        done = hicache(*PREFILL, "--port", str(port))
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert f"--port {port}" in line and "in use" in line
    assert done.stdout == ""  # never said it was ready


@pytest.mark.process
def test_a_decode_node_on_a_port_in_use_names_the_port_not_the_prefill(tmp_path: Path) -> None:
    with taken_port() as port:
        done = hicache(*DECODE, "--port", str(port))
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert f"--port {port}" in line and "in use" in line


@pytest.mark.process
def test_a_decode_node_whose_prefill_is_unreachable_says_so_in_one_line() -> None:
    port = free_port()
    done = hicache("node", "decode", "--engine", "tcp", "--prefill", f"127.0.0.1:{port}")
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert f"--prefill 127.0.0.1:{port}" in line and "cannot reach" in line
    assert done.stdout == ""


@pytest.mark.process
@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")
def test_a_decode_node_on_another_engine_than_its_prefill_is_refused_in_one_line(tmp_path: Path) -> None:
    with prefill_node(*PREFILL) as (prefill, port):
        done = hicache("node", "decode", "--engine", "nixl", "--prefill", f"127.0.0.1:{port}")
    prefill_err = prefill.stderr()
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert f"--prefill 127.0.0.1:{port}" in line and "refused" in line
    assert prefill.returncode == 0  # the prefill node went on serving
    assert "engine differs: 'tcp' here, 'nixl' at the decode node" in one_line(prefill_err)


@pytest.mark.process
def test_a_runtime_replay_leaves_no_temporary_l3_folder(scenario: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = hicache(
        "run", str(scenario), "--runtime", "--engine", "tcp", "--limit", "2", "--out", str(out), "--quiet"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "requests.csv").exists()
    assert not list(out.glob("l3-*"))


@pytest.mark.process
def test_ctrl_c_stops_a_runtime_replay_keeps_the_finished_requests_and_exits_130(
    scenario: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    replay = subprocess.Popen(
        [sys.executable, "-m", "hicache", "run", str(scenario), "--runtime", "--engine", "tcp"]
        + ["--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert replay.stderr is not None
        seen = b""
        while not re.search(rb"\b2/3\b", seen):  # the progress bar: two requests finished
            chunk = os.read(replay.stderr.fileno(), 4096)
            assert chunk, seen.decode(errors="replace")
            seen += chunk
        replay.send_signal(signal.SIGINT)
        _, rest = replay.communicate(timeout=60)
    finally:
        if replay.poll() is None:
            replay.kill()
            replay.wait()
    assert replay.returncode == 130, (seen + rest).decode(errors="replace")
    assert b"interrupted: 2 of 3 requests finished" in rest
    with (out / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["id"], r["outcome"]) for r in rows] == [("r0", "finished"), ("r1", "finished")]
    summary = json.loads((out / "summary.json").read_text())["runs"]["runtime"]
    assert summary["interrupted"] is True and summary["completed"] == 2
    assert summary["exit_codes"] == {"decode": 0, "prefill": 0}  # stopped, cleanly
    assert not list(out.glob("l3-*"))


@pytest.mark.process
def test_nodes_with_different_page_sizes_refuse_each_other_at_connect() -> None:
    """Before the connect check, a decode node at 32 tokens a page against a prefill node at 16
    said it was ready and then failed every request."""
    with prefill_node(*PREFILL, "--page-size", "16") as (prefill, port):
        done = hicache(
            "node", "decode", "--engine", "tcp", "--page-size", "32", "--prefill", f"127.0.0.1:{port}"
        )
    prefill_err = prefill.stderr()
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""  # never said it was ready
    assert "page_size differs: 16 here, 32 at the decode node" in one_line(done.stderr)
    assert "page_size differs: 16 here, 32 at the decode node" in one_line(prefill_err)
    assert prefill.returncode == 0  # the prefill node went on serving


def test_the_limit_flags_reach_the_nodes() -> None:
    from hicache.cli import build_parser
    from hicache.commands.runtime_commands import limits as limits_of

    args = build_parser().parse_args(
        [*DECODE, "--max-connections", "3", "--frame-bytes-in-flight", "4096", "--frame-timeout", "2.5"]
        + ["--idle-timeout", "9"]
    )
    limits = limits_of(args)
    assert (limits.max_connections, limits.frame_bytes_in_flight) == (3, 4096)
    assert (limits.frame_timeout_s, limits.idle_timeout_s) == (2.5, 9.0)


def test_the_limit_flags_reach_the_nodes_max_tokens_and_backoff_too() -> None:
    from hicache.cli import build_parser
    from hicache.commands.runtime_commands import limits
    from hicache.runtime.cache_flags import decode_config

    args = build_parser().parse_args(
        [*DECODE, "--max-tokens", "77", "--transfer-retries", "3", "--transfer-backoff", "0.5"]
        + ["--transfer-backoff-max", "2", "--tp-size", "2"]
    )
    assert limits(args).max_tokens == 77
    cfg = decode_config(args)
    assert cfg.tp_size == 2
    assert (cfg.transfer_retries, cfg.transfer_backoff_s, cfg.transfer_backoff_max_s) == (3, 0.5, 2.0)


@pytest.mark.process
def test_a_decode_node_needs_exactly_one_way_to_find_its_prefill(tmp_path: Path) -> None:
    neither = hicache("node", "decode", "--engine", "tcp")
    both = hicache(*DECODE, "--prefill-file", str(tmp_path / "f"))
    for done in (neither, both):
        assert done.returncode == 2
    assert "one of the arguments --prefill --prefill-file is required" in neither.stderr
    assert "--prefill-file: not allowed with argument --prefill" in both.stderr


@pytest.mark.process
def test_an_unusable_secret_or_key_file_is_one_line_naming_it(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret-s3cret-s3cret")
    secret.chmod(0o644)
    done = hicache(*PREFILL, "--secret-file", str(secret))
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert f"--secret-file {secret}" in line and "lets others read or change it" in line
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nkey = "short"\ntenant = "a"\n')
    with prefill_node(*PREFILL) as (_, port):
        done = hicache(
            "node", "decode", "--engine", "tcp", "--prefill", f"127.0.0.1:{port}", "--api-keys", str(keys)
        )
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert f"--api-keys {keys}: [[key]] #1: field 'key' must be a string of at least 16" in line


@pytest.mark.process
def test_nodes_with_different_secrets_refuse_each_other_at_connect(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for path, text in ((ours, "ours-ours-ours-ours"), (theirs, "theirs-theirs-theirs")):
        path.write_text(text)
        path.chmod(0o600)
    with prefill_node(*PREFILL, "--secret-file", str(ours)) as (prefill, port):
        done = hicache(
            "node",
            "decode",
            "--engine",
            "tcp",
            "--prefill",
            f"127.0.0.1:{port}",
            "--secret-file",
            str(theirs),
        )
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert f"--prefill 127.0.0.1:{port}" in line and "cluster secret" in line
    assert "does not hold this node's cluster secret" in one_line(prefill.stderr())
    assert prefill.returncode == 0


def test_served_model_name_repeats_into_aliases() -> None:
    from hicache.cli import build_parser

    args = build_parser().parse_args(["serve", "--served-model-name", "a", "--served-model-name", "b"])
    assert args.served_model_name == ["a", "b"]
    assert build_parser().parse_args(["serve"]).served_model_name == []

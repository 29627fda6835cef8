"""Pinning glibc's mmap threshold: taken on glibc, refused values named, 0 leaves it adaptive."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import hicache

from hicache.runtime.malloc_tuning import MAX_MMAP_THRESHOLD, pin_mmap_threshold

GLIBC = sys.platform.startswith("linux") and "glibc" in " ".join(__import__("platform").libc_ver())


@pytest.mark.process
@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_glibc_takes_the_threshold_in_a_fresh_process() -> None:
    code = "from hicache.runtime.malloc_tuning import pin_mmap_threshold as p; print(p(131072), p(0))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


@pytest.mark.parametrize("bad", [-1, MAX_MMAP_THRESHOLD + 1])
def test_a_threshold_out_of_range_is_refused_naming_the_range(bad: int) -> None:
    with pytest.raises(ValueError, match=f"expected 0..{MAX_MMAP_THRESHOLD} bytes, got {bad}"):
        pin_mmap_threshold(bad)


@pytest.mark.process
def test_the_node_command_refuses_a_bad_threshold_with_exit_2() -> None:
    out = hicache("node", "prefill", "--engine", "tcp", "--mmap-threshold", "-5", timeout=120)
    assert out.returncode == 2 and "mmap threshold: expected 0.." in out.stderr

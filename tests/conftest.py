"""Hypothesis settings profiles, chosen by the environment variable HICACHE_HYPOTHESIS_PROFILE.

- "ci" (the default): hypothesis' default 100 examples, no deadline (the first call of a numba
  kernel compiles, and a loaded CI machine is slow), and no too_slow health check.
- "long": 2000 examples, for a soak before a release or after touching the core.
- "dev": 20 examples, for a quick edit-test loop.

A property test that sets its own example count does so through `builders.examples(n)`, which
scales `n` by the same profile (twenty times under "long"); the profile fills in everything a
test does not set. `pytest --hypothesis-profile NAME` also works
and wins over the variable (hypothesis' plugin loads it after this file).

Test tiers. Three markers say why a test is left out of the fast tier: `process` (it starts OS
processes: nodes, `hicache serve`, a CLI run in a child Python, a child pytest, Ray or a process
pool), `real_model` (it loads the real default model or transformers) and `slow` (anything else
taking more than a second or two on the project's 2-core machine). `pytest --quick` (what
`./dev.sh quick` runs) deselects every test carrying one of them; plain `pytest` (`./dev.sh test`,
CI) runs everything. A test marked `plain_python` counts as `process` while the compiled build is
in use, since it then runs in a child pytest (below).

A file whose tests all belong to a slow tier says so once, with a module-level `pytestmark`, and
`--quick` does not even import it: `pytest_ignore_collect` reads that one statement from the
source (no import), so the quick tier's collection pays for none of the file's imports (the
server stack, Ray, hypercorn). Why this and not a table of files here: the marker stays beside the
tests it describes, pytest applies the very same marks when it does import the file (`-m` and
`--quick` agree on every test), and a pre-check that cannot read a file's marks only costs time,
never a test: the file is imported and its tests deselected one by one. Single tests in mixed
files carry a decorator. Torch itself is imported by the runtime modules the fast runtime tests
exercise (about 2 s), so it stays; transformers and Ray are imported only inside the tests that
need them, and so is openai.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from tiers import TIERS, module_tiers

from hicache import compiled

PROFILE_VARIABLE = "HICACHE_HYPOTHESIS_PROFILE"

settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("long", parent=settings.get_profile("ci"), max_examples=2000)
settings.register_profile("dev", parent=settings.get_profile("ci"), max_examples=20)


def _profile_name() -> str:
    """The profile the environment asks for; an unknown name fails here, before any test runs."""
    return os.environ.get(PROFILE_VARIABLE, "").strip() or "ci"


settings.load_profile(_profile_name())

# Nodes and engines the tests start prove to each other that they hold the cluster secret
# (`runtime/cluster_secret.py`); one for the whole run keeps them from creating the default
# file under the user's home. Tests of the other sources set or clear it themselves.
os.environ.setdefault("HICACHE_CLUSTER_SECRET", "hicache-tests-" + os.urandom(8).hex())


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick",
        action="store_true",
        help="the fast tier: leave out tests marked " + ", ".join(TIERS) + " (./dev.sh quick)",
    )


_SKIPPED_KEY = pytest.StashKey[list[str]]()  # the files --quick did not import


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not config.getoption("quick") or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_") or not module_tiers(collection_path):
        return None
    config.stash.setdefault(_SKIPPED_KEY, []).append(collection_path.name)
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if compiled.active():
        for item in items:
            if item.get_closest_marker("plain_python") is not None:
                item.add_marker("process")
    _skip_gpu_tests_without_cuda(items)
    if not config.getoption("quick"):
        return
    keep = [item for item in items if not any(item.get_closest_marker(t) for t in TIERS)]
    if len(keep) < len(items):
        kept = set(map(id, keep))
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
        items[:] = keep


def _skip_gpu_tests_without_cuda(items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need a CUDA device; torch is asked only when such a test was collected."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    for item in gpu:
        item.add_marker(pytest.mark.skip(reason="marked gpu: torch sees no CUDA device"))


def pytest_report_collectionfinish(config: pytest.Config) -> str | None:
    if not config.getoption("quick"):
        return None
    skipped = sorted(set(config.stash.get(_SKIPPED_KEY, [])))  # once per file, however many args
    return f"--quick: {len(skipped)} files left unimported (marked as a whole): {', '.join(skipped)}"


# A test marked `plain_python` spies on the core or the simulator by replacing a method on an
# instance, which the compiled build's native classes do not allow (`hicache/compiled.py`).
# With the build in use, such a test runs in a child pytest with HICACHE_PURE=1, and its
# outcome is the child's.
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "plain_python: run this test on the plain-Python modules")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped where torch sees none)")
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {what} (left out by --quick)")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if pyfuncitem.get_closest_marker("plain_python") is None or not compiled.active():
        return None
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", pyfuncitem.nodeid],
        cwd=pyfuncitem.config.rootpath,
        env={**os.environ, "HICACHE_PURE": "1"},
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        pytest.fail(f"on plain Python:\n{(run.stdout + run.stderr)[-3000:]}", pytrace=False)
    return True

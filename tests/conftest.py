"""Hypothesis settings profiles, chosen by the environment variable HICACHE_HYPOTHESIS_PROFILE.

- "ci" (the default): hypothesis' default 100 examples, no deadline (the first call of a numba
  kernel compiles, and a loaded CI machine is slow), and no too_slow health check.
- "long": 2000 examples, for a soak before a release or after touching the core.
- "dev": 20 examples, for a quick edit-test loop.

A property test that sets its own example count does so through `builders.examples(n)`, which
scales `n` by the same profile (twenty times under "long"); the profile fills in everything a
test does not set. `pytest --hypothesis-profile NAME` also works
and wins over the variable (hypothesis' plugin loads it after this file).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings

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


# A test marked `plain_python` spies on the core or the simulator by replacing a method on an
# instance, which the compiled build's native classes do not allow (`hicache/compiled.py`).
# With the build in use, such a test runs in a child pytest with HICACHE_PURE=1, and its
# outcome is the child's.
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "plain_python: run this test on the plain-Python modules")


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

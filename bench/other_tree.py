"""The environment that runs another checkout of hicache (an export of an older commit, for a
before/after figure) with this virtualenv: its own `hicache`, `runtime`, `sim` and `scenarios`,
none of this checkout's (other_tree_site/sitecustomize.py says why PYTHONPATH alone mixes them).
Start such a process from a folder that is not a checkout: `-m hicache` looks in the cwd first."""

from __future__ import annotations

import os
from pathlib import Path

SITE = Path(__file__).resolve().with_name("other_tree_site")


def env_for(src: str | Path) -> dict[str, str]:
    """os.environ, with the checkout at `src` in place of the installed one."""
    src = str(Path(src).resolve())
    return dict(os.environ, HICACHE_SRC=src, PYTHONPATH=os.pathsep.join([str(SITE), src]))

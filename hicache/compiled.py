"""The core and the simulator's event loop compiled to C with mypyc, from the same sources.

Why: a replay spends its time in the core's Python (the tree, the slot pools, the state machine)
and in the simulator's handlers, one small call at a time; mypyc turns the type-annotated modules
into C extension modules that make the same calls without the interpreter's dispatch. The
Python sources stay the reference and the only code anyone edits. A compiled build is used only
when it was made from exactly the sources on disk (their fingerprint names its folder), so an
edit falls back to plain Python until the next build, never to stale code. `HICACHE_PURE=1`
turns compiled modules off.

    hicache compile            # ./dev.sh runs this after installing
    hicache compile --status

Builds live under `<sys.prefix>/hicache-compiled/<fingerprint>/` (or `$HICACHE_COMPILED_DIR`):
beside the interpreter they were compiled for, never in the source tree.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# What is compiled. Left as Python: modules of attrs classes with field validators or converters
# (config, events, commands, restore_cost: mypyc's native classes cannot hold attrs' field
# descriptors), numba kernels (pages, sim.keyset), and whatever is not on a replay's hot path.
CORE = (
    "account",
    "backoff",
    "decode_admission",
    "decode_base",
    "decode_batch",
    "decode_finish",
    "decode_node",
    "decode_ops",
    "decode_restore",
    "decode_store_back",
    "decode_transfer",
    "dispatch",
    "errors",
    "eviction",
    "failed_pages",
    "lifecycles",
    "node",
    "policy_enum",
    "pool",
    "prefetch_rule",
    "prefill_plan",
    "prefix_match",
    "promise",
    "receipts",
    "request",
    "router",
    "states",
    "tree",
    "tree_backups",
    "tree_eviction",
    "tree_results",
    "tree_stores",
    "tree_structure",
    "value",
    "write_policy",
)
SIM = ("channel", "cluster", "costs", "decode", "engine", "prefill", "store")
MODULES = tuple(f"hicache.core.{m}" for m in CORE) + tuple(f"hicache.sim.{m}" for m in SIM)
# Packages copied into the build's staging tree: what mypy reads to type the compiled modules.
STAGED = ("hicache", "hicache.core", "hicache.sim", "hicache.scenarios")
GROUP = "hicache_compiled"  # the shared library's name: `hicache_compiled__mypyc`
MANIFEST = "manifest.json"


def _package_dir(package: str) -> Path:
    """Where `package`'s sources are (the drivers install under `hicache.` from top-level
    folders), found without importing it."""
    if package == "hicache":
        return Path(__file__).resolve().parent
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"no package {package}")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def source_of(module: str) -> Path:
    package, _, name = module.rpartition(".")
    return _package_dir(package) / f"{name}.py"


def sources() -> list[Path]:
    """What a build depends on: the compiled modules, and the core's other modules, whose
    classes the compiled code was typed against."""
    core = _package_dir("hicache.core")
    return sorted({source_of(m) for m in MODULES} | set(core.glob("*.py")))


def digest(files: Sequence[Path]) -> str:
    """A digest of the interpreter's ABI and of `files`' names and bytes."""
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{sys.implementation.cache_tag} {sysconfig.get_platform()}\n".encode())
    for f in files:
        h.update(f"{f.parent.name}/{f.name}\n".encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def fingerprint() -> str:
    """The name of the build of the sources on disk."""
    return digest(sources())


def builds_dir() -> Path:
    return Path(os.environ.get("HICACHE_COMPILED_DIR") or Path(sys.prefix) / "hicache-compiled")


def current_build() -> Path | None:
    """The folder of a complete build of the sources on disk, or None."""
    try:
        folder = builds_dir() / fingerprint()
    except (OSError, ImportError):
        return None
    return folder if (folder / MANIFEST).is_file() else None


class _CompiledFinder(importlib.abc.MetaPathFinder):
    """Serves the compiled modules (and their shared library) from one build folder."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def install() -> bool:
    """Put the compiled modules ahead of the sources, when a build of these sources exists and
    `HICACHE_PURE` is not set. True when they are in use."""
    if os.environ.get("HICACHE_PURE") or active():
        return active()
    folder = current_build()
    if folder is None:
        return False
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = {name: folder / rel for name, rel in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if set(MODULES) - set(files) or not all(f.is_file() for f in files.values()):
        return False
    sys.meta_path.insert(0, _CompiledFinder(files))
    return True


def active() -> bool:
    return any(isinstance(f, _CompiledFinder) for f in sys.meta_path)


def compiled(module: ModuleType) -> bool:
    """Whether `module` was loaded from a compiled build."""
    return isinstance(getattr(module, "__loader__", None), importlib.machinery.ExtensionFileLoader)


_SETUP = """
import sys
from mypyc.build import mypycify
from setuptools import setup
out, temp, group, *paths = sys.argv[1:]
setup(
    name="hicache-compiled",
    ext_modules=mypycify(paths, group_name=group, opt_level="3", debug_level="0"),
    script_args=["build_ext", "--build-lib", out, "--build-temp", temp],
)
"""


def build(*, force: bool = False) -> Path:
    """Compile MODULES for this interpreter (a minute or so), unless a build of these sources
    is already there. The build is staged apart and appears whole or not at all."""
    fp = fingerprint()
    root = builds_dir()
    target = root / fp
    if (target / MANIFEST).is_file() and not force:
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hicache-compile-") as tmp:
        stage = Path(tmp) / "src"
        for package in STAGED:
            dst = stage.joinpath(*package.split("."))
            dst.mkdir(parents=True, exist_ok=True)
            for f in _package_dir(package).glob("*.py"):
                shutil.copy2(f, dst / f.name)
        out = Path(tmp) / "out"
        paths = [str(Path(*m.split(".")).with_suffix(".py")) for m in MODULES]
        print(f"hicache compile: {len(MODULES)} modules with mypyc (about a minute)", file=sys.stderr)
        run = subprocess.run(
            [sys.executable, "-c", _SETUP, str(out), str(Path(tmp) / "temp"), GROUP, *paths],
            cwd=stage,
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            raise RuntimeError(f"mypyc failed:\n{(run.stdout + run.stderr)[-4000:]}")
        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        files: dict[str, str] = {}
        for name in (*MODULES, f"{GROUP}__mypyc"):
            rel = Path(*name.split(".")).with_name(name.rpartition(".")[2] + suffix)
            if not (out / rel).is_file():
                raise RuntimeError(f"mypyc built no {rel}")
            files[name] = str(rel)
        (out / MANIFEST).write_text(json.dumps({"fingerprint": fp, "files": files}, indent=1))
        partial = root / f"{fp}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(out, partial)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    for old in root.iterdir():  # builds of other sources are never used again
        if old.name != fp:
            shutil.rmtree(old, ignore_errors=True)
    return target


def command(*, status: bool, force: bool) -> int:
    """`hicache compile`: build (or with `status`, say what is in use), 0 on success."""
    if status:
        folder = current_build()
        if os.environ.get("HICACHE_PURE"):
            print("pure Python (HICACHE_PURE is set)")
        elif folder is None:
            print(f"pure Python: no build of these sources under {builds_dir()}")
        else:
            print(f"compiled: {folder}")
        return 0
    try:
        built = build(force=force)
    except (RuntimeError, OSError) as exc:
        print(f"hicache compile: {exc}", file=sys.stderr)
        return 1
    print(f"compiled {len(MODULES)} modules: {built}")
    return 0

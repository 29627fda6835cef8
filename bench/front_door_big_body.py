"""What one 16 MiB text body costs the front door: its peak resident memory while the body is
sent and answered, and how long a small request sent meanwhile takes.

The front door runs in a child process (the default model's real tokenizer, an echoing
backend from tests/serving_fakes.py, no nodes), so its memory is its own. `--src` points the
child at another checkout, to compare a change with the code before it:

    python bench/front_door_big_body.py                      # this checkout
    python bench/front_door_big_body.py --src /path/to/old   # another one, same machine
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

CHILD = r"""
import importlib.util, sys
src = sys.argv[1]
import hicache  # from src (PYTHONPATH); its runtime too, whatever an editable install points at
spec = importlib.util.spec_from_file_location(
    "hicache.runtime", src + "/runtime/__init__.py", submodule_search_locations=[src + "/runtime"]
)
sys.modules["hicache.runtime"] = module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
import trio
sys.path.insert(0, src + "/tests")
from serving_fakes import FakeBackend
from hicache.runtime.serve import Codec, load_tokenizer
from hicache.runtime.serving import create_app, serve_http
tokenizer, _ = load_tokenizer("default")
async def main():
    app = create_app(FakeBackend(max_context=8192), Codec(tokenizer), model_name="bench")
    async with trio.open_nursery() as n:
        port = await n.start(serve_http, app, "127.0.0.1", 0)
        print(port, flush=True)
trio.run(main)
"""


def status(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def post(url: str, body: bytes, timeout: float = 600) -> tuple[int, float]:
    start = time.monotonic()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            code = r.status
    except urllib.error.HTTPError as e:
        e.read()
        code = e.code
    return code, time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1]), help="the checkout to run")
    ap.add_argument("--mib", type=int, default=16, help="the body's size in MiB (default 16)")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=args.src, HICACHE_SRC=args.src, HICACHE_PURE="1")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, args.src], stdout=subprocess.PIPE, text=True, env=env, cwd="/tmp"
    )
    try:
        port = int(child.stdout.readline())  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}/generate"
        small = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 4}}).encode()
        post(url, small)
        before = status(child.pid, "VmRSS")
        text = "Hello world, this is a long prompt. " * (args.mib * 2**20 // 36)
        wrapper = len(json.dumps({"text": "", "sampling_params": {"max_new_tokens": 1}}))
        body = {"text": text[: args.mib * 2**20 - wrapper - 1], "sampling_params": {"max_new_tokens": 1}}
        big = json.dumps(body).encode()  # just under the body limit
        result: dict[str, tuple[int, float]] = {}
        sender = threading.Thread(target=lambda: result.__setitem__("big", post(url, big)))
        sender.start()
        time.sleep(0.5)
        result["small"] = post(url, small)
        sender.join()
        peak = status(child.pid, "VmHWM")
        print(
            json.dumps(
                {
                    "src": args.src,
                    "body_mib": round(len(big) / 2**20, 1),
                    "rss_before_mb": round(before / 1e6),
                    "rss_peak_mb": round(peak / 1e6),
                    "big_status": result["big"][0],
                    "big_s": round(result["big"][1], 2),
                    "small_meanwhile_s": round(result["small"][1], 3),
                    "load_average": os.getloadavg()[0],
                }
            )
        )
    finally:
        child.terminate()
        child.wait(10)


if __name__ == "__main__":
    main()

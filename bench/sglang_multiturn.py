"""SGLang's own multi-turn client, `benchmark/hicache/bench_multiturn.py`, unmodified, against
`hicache serve`: its clients post to `/generate` (streamed), append each answer and a new
question to their history, and call `/flush_cache` before each of its 13 request rates (16 down
to 1 per second). Prints its summaries, and the server's own cache hit rate from `/metrics`.

SGLang's wheels do not carry `benchmark/`: give the script's path (`--script`). An older copy
(SGLang commit 1d651e28) imports `sglang.bench_serving` from a release whose
`sample_random_requests` still returns tuples: sglang 0.4.0, installed without its server's
dependencies into a virtualenv of its own (`bench/.venvs/sglang-0.4`, the default `--python`).
The current one (with its own cache-hit figure, `--api-format sglang|openai`) needs a current
sglang, whose client imports most of its server and a CUDA build of torch (6 GB): make that
virtualenv by hand and pass its python (BENCHMARKS.md says how). The tokenizer is the default
model's, saved from the GGUF by transformers; the prompts come from a local file in ShareGPT's
shape made from this project's documentation (the script otherwise downloads ShareGPT).

    .venv/bin/python bench/sglang_multiturn.py --script PATH/bench_multiturn.py [--python PY] \
        [--num-clients 4 --num-rounds 3 --request-length 128 --output-length 16] [--url URL] \
        [-- MORE SCRIPT FLAGS]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from serve_clients import VENVS, hicache_serve

SGLANG = "sglang==0.4.0"  # its bench_serving returns the (prompt, in, out) tuples the script reads
DEPS = ["aiohttp", "numpy", "requests", "tqdm", "transformers==4.46.3", "IPython"]
ROOT = Path(__file__).resolve().parent.parent


def client_python() -> Path:
    venv = VENVS / "sglang-0.4"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = str(venv / "bin" / "pip")
        subprocess.run([pip, "install", "-q", "--no-deps", SGLANG], check=True)  # not its server
        subprocess.run([pip, "install", "-q", *DEPS], check=True)
    return python


def tokenizer_dir(out: Path) -> Path:
    """The default model's tokenizer as a Hugging Face folder that transformers 4.46 reads."""
    from transformers import AutoTokenizer

    from hicache.runtime.model.model_file import default_model_path

    gguf = default_model_path()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    config = out / "tokenizer_config.json"
    fields = json.loads(config.read_text())
    fields["tokenizer_class"] = "PreTrainedTokenizerFast"  # newer transformers name their own class
    config.write_text(json.dumps(fields))
    return out


def sharegpt_file(out: Path) -> Path:
    """Conversations in ShareGPT's shape, from the README's and architecture's paragraphs."""
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "architecture.md").read_text()
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 200]
    rows = [
        {"id": str(i), "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": q}]}
        for i, (p, q) in enumerate(zip(paras, paras[1:] + paras[:1], strict=True))
    ]
    out.write_text(json.dumps(rows))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--script", type=Path, required=True, help="SGLang's bench_multiturn.py")
    ap.add_argument("--url", default=None, help="a running front door (default: start one)")
    ap.add_argument("--num-clients", type=int, default=4)
    ap.add_argument("--num-rounds", type=int, default=3)
    ap.add_argument("--request-length", type=int, default=128)
    ap.add_argument("--output-length", type=int, default=16)
    ap.add_argument("--python", type=Path, default=None, help="the client's python (default: sglang 0.4.0's)")
    ap.add_argument("more", nargs="*", help="more flags for the script, after --")
    args = ap.parse_args()
    python = args.python or client_python()
    with tempfile.TemporaryDirectory() as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        url = args.url
        if url is None:
            url = stack.enter_context(hicache_serve([], tmp / "serve.log"))["url"]
        where = urllib.parse.urlsplit(url)
        log = tmp / "performance_metrics.jsonl"
        cmd = [str(python), str(args.script.resolve()), "--host", str(where.hostname)]
        cmd += ["--port", str(where.port), "--model-path", str(tokenizer_dir(tmp / "tokenizer"))]
        cmd += ["--dataset-path", str(sharegpt_file(tmp / "sharegpt.json")), "--log-file", str(log)]
        cmd += ["--num-clients", str(args.num_clients), "--max-parallel", str(args.num_clients)]
        cmd += ["--num-rounds", str(args.num_rounds), "--request-length", str(args.request_length)]
        cmd += ["--output-length", str(args.output_length), *args.more]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if done.returncode != 0:
            raise SystemExit(f"bench_multiturn.py failed:\n{done.stderr[-3000:]}")
        print("rate  requests  TTFT mean / median / p90 s  latency mean s  requests/s  its hit rate")
        for line in log.read_text().splitlines():
            s = json.loads(line)["summary"]
            hit = f"{s['cache_hit_rate']:.4f}" if "cache_hit_rate" in s else "-"  # the current script's
            print(
                f"{s['request_rate']:>4}  {s['total_requests']:>8}  {s['average_ttft']:.2f} / "
                f"{s['median_ttft']:.2f} / {s['p90_ttft']:.2f}  {s['average_latency']:.2f}  "
                f"{s['throughput']:.2f}  {hit}"
            )
        metrics = urllib.request.urlopen(url + "/metrics").read().decode()
        for name in ("sglang:num_requests_total", "sglang:cache_hit_rate"):
            value = next(line.split()[-1] for line in metrics.splitlines() if line.startswith(name))
            print(f"{name} {value}")


if __name__ == "__main__":
    main()

"""The `openai` package, unmodified and in a virtualenv of its own, against `hicache serve`:
chat and completions, streaming and not, and a multi-turn chat whose later turns report cached
prompt tokens (`usage.prompt_tokens_details.cached_tokens`).

The client's virtualenv (`bench/.venvs/openai`, created on first use with `pip install
openai==3.57.0`) holds nothing of this project: what it sends and reads is only the public API.
Starts `hicache serve` on the default model unless `--url` names a running one.

    .venv/bin/python bench/openai_client.py [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import tempfile
from pathlib import Path

from serve_clients import client_venv, hicache_serve

ROOT = Path(__file__).resolve().parent.parent
OPENAI = "openai==3.57.0"

CLIENT = r"""
import json, sys, time
from openai import OpenAI

url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=url + "/v1", api_key="unused")
out = {"models": [m.id for m in client.models.list().data]}
ask = [{"role": "user", "content": "What is the capital of France?"}]
reply = client.chat.completions.create(model=model, messages=ask, max_tokens=20, temperature=0)
out["chat"] = reply.choices[0].message.content
start = time.perf_counter()
usage = {"include_usage": True}
stream = client.chat.completions.create(
    model=model, messages=ask, max_tokens=20, temperature=0, stream=True, stream_options=usage
)
pieces, first = [], None
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        first = first or time.perf_counter() - start
        pieces.append(chunk.choices[0].delta.content)
out["chat_stream"], out["chat_stream_ttft_s"] = "".join(pieces), first
done = client.completions.create(model=model, prompt="The largest planet is", max_tokens=8, temperature=0)
out["completion"] = done.choices[0].text
chunks = client.completions.create(
    model=model, prompt="The largest planet is", max_tokens=8, temperature=0, stream=True
)
text = "".join(c.choices[0].text for c in chunks if c.choices)
out["completion_stream"] = text
history = [{"role": "system", "content": "You are a concise geography tutor. Answer in one sentence."}]
turns = []
for question in ("Where is Paris?", "And Rome?", "And Madrid?", "And Vienna?"):
    history.append({"role": "user", "content": question})
    r = client.chat.completions.create(model=model, messages=history, max_tokens=24, temperature=0)
    history.append({"role": "assistant", "content": r.choices[0].message.content})
    details = r.usage.prompt_tokens_details
    cached = details.cached_tokens if details else None
    turns.append({"prompt_tokens": r.usage.prompt_tokens, "cached_tokens": cached})
out["turns"] = turns
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running front door (default: start one)")
    args = ap.parse_args()
    python = client_venv("openai", OPENAI, "python")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        url, model = args.url, "SmolLM2-135M-Instruct"
        if url is None:
            ready = stack.enter_context(hicache_serve([], Path(tmp) / "serve.log"))
            url, model = ready["url"], ready["model"]
        done = subprocess.run([str(python), "-c", CLIENT, url, model], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the openai client failed:\n{done.stderr[-3000:]}")
    print(json.dumps(json.loads(done.stdout), indent=1))


if __name__ == "__main__":
    main()

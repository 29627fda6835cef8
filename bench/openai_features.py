"""The `openai` package and `langchain-openai`, unmodified and each in a virtualenv of its own,
against `hicache serve`: `n` choices, `logprobs`/`top_logprobs`, `echo`, lists of prompts,
penalties, `logit_bias`, `min_p`, tools refused by name where the template has none, `echo`
with `logprobs`, and SGLang's `return_logprob` from `logprob_start_len` 0. A handful of short
requests; prints what each client saw.

    .venv/bin/python bench/openai_features.py [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import tempfile
from pathlib import Path

from serve_clients import client_venv, hicache_serve

OPENAI = "openai==3.57.0"
LANGCHAIN = "langchain-openai==1.7.4"

CLIENT = r"""
import json, sys, urllib.request
import openai
from openai import OpenAI

url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
out = {}
ask = [{"role": "user", "content": "Name a colour."}]
r = client.chat.completions.create(
    model=model, messages=ask, max_tokens=5, n=2, temperature=0.9, seed=3, logprobs=True, top_logprobs=2
)
out["chat_n2_logprobs"] = [
    {"index": c.index, "text": c.message.content,
     "logprobs": [(t.token, round(t.logprob, 4), [(a.token, round(a.logprob, 4)) for a in t.top_logprobs])
                  for t in c.logprobs.content]}
    for c in r.choices
]
out["chat_n2_usage"] = r.usage.model_dump()
texts = {}
for chunk in client.chat.completions.create(
    model=model, messages=ask, max_tokens=5, n=2, temperature=0.9, stream=True, logprobs=True,
    stream_options={"include_usage": True},
):
    for c in chunk.choices:
        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    if chunk.usage:
        out["chat_stream_usage"] = chunk.usage.model_dump()
out["chat_stream_n2"] = texts
r = client.completions.create(
    model=model, prompt=["The sky is", [504, 3179, 314]], max_tokens=4, n=2, temperature=0.7, logprobs=2
)
out["completions_prompt_list"] = [
    {"index": c.index, "text": c.text, "tokens": c.logprobs.tokens,
     "token_logprobs": [round(x, 4) for x in c.logprobs.token_logprobs],
     "top_logprobs": c.logprobs.top_logprobs, "text_offset": c.logprobs.text_offset}
    for c in r.choices
]
out["completions_usage"] = r.usage.model_dump()
r = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0, echo=True)
out["echo"] = r.choices[0].text
plain = client.completions.create(model=model, prompt="one one one one", max_tokens=8, temperature=0)
pen = client.completions.create(
    model=model, prompt="one one one one", max_tokens=8, temperature=0, presence_penalty=1.5,
    frequency_penalty=1.0, extra_body={"repetition_penalty": 1.5, "min_p": 0.05},
)
out["penalties"] = {"without": plain.choices[0].text, "with": pen.choices[0].text}
first = client.completions.create(model=model, prompt="The sky is", max_tokens=1, temperature=0, logprobs=0)
banned = first.choices[0].text
tok = first.choices[0].logprobs.tokens[0]
def generate(body):
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), headers)
    return json.loads(urllib.request.urlopen(req).read())
greedy = {"max_new_tokens": 1, "temperature": 0}
ids = generate({"text": "The sky is", "sampling_params": greedy})["output_ids"]
biased = client.completions.create(
    model=model, prompt="The sky is", max_tokens=1, temperature=0, logit_bias={str(ids[0]): -100}
)
out["logit_bias"] = {"greedy": banned, "greedy_id": ids[0], "with_bias_-100": biased.choices[0].text}
refusals = {}
for name, call in {
    "tools": lambda: client.chat.completions.create(model=model, messages=ask, max_tokens=2,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    "tool_calls": lambda: client.chat.completions.create(model=model, max_tokens=2, messages=[ask[0],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "x"}]),
}.items():
    try:
        call()
        refusals[name] = "accepted"
    except openai.BadRequestError as exc:
        refusals[name] = f"{exc.status_code} param={exc.body.get('param')}: {exc.body.get('message')}"
out["refusals"] = refusals
r = client.completions.create(
    model=model, prompt="The sky is", max_tokens=2, temperature=0, echo=True, logprobs=1
)
lp = r.choices[0].logprobs
out["echo_logprobs"] = {"text": r.choices[0].text, "tokens": lp.tokens,
                        "token_logprobs": [None if x is None else round(x, 4) for x in lp.token_logprobs],
                        "top_logprobs": lp.top_logprobs, "text_offset": lp.text_offset}
body = {"text": "The sky is", "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True,
        "logprob_start_len": 0}
meta = generate(body)["meta_info"]
keys = ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs")
out["sglang_return_logprob"] = {k: meta[k] for k in keys}
print(json.dumps(out))
"""

LANGCHAIN_CLIENT = r"""
import json, sys
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI

url, model = sys.argv[1], sys.argv[2]
llm = ChatOpenAI(base_url=url + "/v1", api_key="unused", model=model, max_tokens=5, n=2,
                 temperature=0.9, logprobs=True, top_logprobs=2)
result = llm.generate([[HumanMessage("Name a colour.")]])
gens = result.generations[0]
print(json.dumps({
    "choices": len(gens),
    "texts": [g.text for g in gens],
    "logprobs_first_choice": [(t["token"], round(t["logprob"], 4), len(t["top_logprobs"]))
                              for t in gens[0].generation_info["logprobs"]["content"]],
    "usage": result.llm_output.get("token_usage"),
}))
"""


def _run(python: Path, program: str, url: str, model: str) -> dict:
    done = subprocess.run([str(python), "-c", program, url, model], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the client failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running front door (default: start one)")
    args = ap.parse_args()
    openai_python = client_venv("openai", OPENAI, "python")
    langchain_python = client_venv("langchain-openai", LANGCHAIN, "python")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        url, model = args.url, "SmolLM2-135M-Instruct"
        if url is None:
            ready = stack.enter_context(hicache_serve([], Path(tmp) / "serve.log"))
            url, model = ready["url"], ready["model"]
        out = {"openai": _run(openai_python, CLIENT, url, model)}
        out["langchain_openai"] = _run(langchain_python, LANGCHAIN_CLIENT, url, model)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

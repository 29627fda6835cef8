"""`hicache serve` end to end on one device, against transformers: one prepared script (a script,
not a test) that fits in 8 minutes on one H100/H200 and runs whole on a CPU (`--device cpu`).

Usage:
    python bench/gpu_serve_check.py [--device cuda|cpu] [--base-gpu-id N] [--quick]
                                    [--budget-s 480] [--out results.json] [--log-dir DIR]

Sections (each records its own error in the JSON and the script goes on; exit 1 if any failed;
a section the --budget-s cannot hold any more is skipped, and says so):

- copy: load-back L2 (host pool) -> L1 (device pool) in GB/s for 1 MiB and 8 MiB pages, measured
  by bench/gpu_check.py's code, beside pinned host-to-device copies of one large buffer; on a CPU
  both sides are host memory and the reference is a host memcpy (marked `device: cpu`);
- greedy: 24 greedy tokens of a chat prompt from the server (/generate with input_ids,
  temperature 0, ignore_eos) against transformers `generate(do_sample=False)` on the same device
  in the same dtype; how many agree and where they first diverge (bf16 kernels differ by device);
- conversation: 4 turns, each prompt the whole history plus a new user message, with each turn's
  cached tokens per tier (`meta_info.cached_tokens_details`): turn 2 from L1; turn 3 from L2 (no
  HTTP route evicts L1 alone, so filler prompts totalling more than L1 push the conversation out
  of L1 while write-through keeps it in L2); turn 4 from L3 (after the L3 files stop changing,
  POST /flush_cache empties L1 and L2);
- decode: output tokens/s at batch 1 and at 32 concurrent requests (fixed length, ignore_eos;
  tokens over wall time, a short prompt's prefill included) against transformers `generate` at
  batch 1 and 32 (left padded);
- ttft: a 4,000-token history sent once, then a follow-up turn (history + reply + a new message)
  timed to its first token, on the server above (decode cache on) and on a second server started
  with --no-decode-cache (off: the decode node receives the whole prompt's KV from prefill, which
  may still reuse its own prefill cache).

The server is `python -m hicache serve --device D --dtype bfloat16` with an L3 (`--hicache-storage-
backend file --storage-dir` in a temporary folder), so L1, L2 and L3 all exist; transformers
loads the same GGUF (`--device` is cuda when torch sees CUDA, else cpu). The results go to --out
(default: a file under $TMPDIR/hicache-gpu-serve-check/) as JSON, and to stdout as tables.
Offline installation on a machine without network: bench/gpu_wheels.py.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion bar, read when tqdm loads
import gpu_check as gc  # noqa: E402  (maps runtime/ to hicache.runtime in a bare checkout)
import torch  # noqa: E402
import trio  # noqa: E402

from hicache.runtime.kv.copy_engine import CopyEngine  # noqa: E402
from hicache.runtime.kv.kv_pool import KVPool  # noqa: E402

VOCAB_LOW, VOCAB_HIGH = 100, 49000  # ordinary tokens of the default model (as serve_vs_llamacpp.py)
GREEDY_PROMPT = "What is the capital of France?"
GREEDY_TOKENS = 24
SECTIONS = ("copy", "greedy", "conversation", "decode", "ttft")
REQUEST_TIMEOUT_S = 120.0  # the longest any one socket read waits
CLEANUP_S = 20.0  # kept back from --budget-s for stopping servers and writing results
FIRST_MESSAGE = (
    "I am planning a two-week trip through Europe next spring with my partner and our two "
    "children, who are eight and twelve. We will land in Paris and leave from Rome. We like "
    "museums, but the children get bored after two hours, so we want to mix in parks, beaches "
    "and a few days of hiking. Our budget is about six thousand euros for everything except the "
    "flights, and we would rather take trains than rent a car. My partner does not eat meat, and "
    "our younger child is allergic to peanuts, so restaurants matter. We would like to see "
    "Paris, somewhere in Switzerland with mountains, Venice or Florence, and Rome, but we are "
    "open to changing that list if the travel days become too long. We prefer small family "
    "hotels or apartments with a kitchen to large chain hotels, and we need two bedrooms or at "
    "least a sofa bed. We also want one slow day each week with no plans at all. Spring weather "
    "worries me a little: should we pack for rain, and how cold are the Alps in April? Please "
    "suggest a day-by-day route with the train legs, how long each leg takes, and roughly what "
    "each part of the trip will cost."
)
FOLLOW_UPS = (
    "Which city should we visit first after Paris, and why?",
    "Write a short packing list for the children for that route.",
    "Summarise the whole plan in three sentences.",
)


# ------------------------------------------------------------------------------- budget, sections


class Budget:
    """The whole script's wall-clock allowance; sections ask it before they start."""

    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic()
        self.deadline = self.start + seconds

    def left(self) -> float:
        """Seconds left for work, less what stopping servers and writing results take."""
        return self.deadline - time.monotonic() - CLEANUP_S

    def timeout(self, floor: float = 10.0) -> float:
        """A socket timeout that ends about when the budget does, and one stuck request never
        takes the whole budget."""
        return min(REQUEST_TIMEOUT_S, max(floor, self.left() + CLEANUP_S / 2))


def run_section(
    results: dict[str, Any], name: str, need_s: float, budget: Budget, fn: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """Run one section: its figures, or its error, or why it was skipped, under results[name]."""
    left = budget.left()
    if left < need_s:
        entry: dict[str, Any] = {
            "status": "skipped",
            "reason": f"out of budget: {left:.0f} s left, the section needs about {need_s:.0f} s",
        }
        print(f"[{name}] skipped: {entry['reason']}", flush=True)
    else:
        print(f"[{name}] ... ({left:.0f} s of budget left)", flush=True)
        start = time.perf_counter()
        try:
            got = fn()
            # A section that measured but whose check failed keeps its figures beside the error.
            entry = {"status": "failed" if got.get("error") else "ok", **got}
            if got.get("error"):
                print(f"[{name}] FAILED: {got['error']}", flush=True)
        except Exception as exc:  # recorded; the other sections still run
            entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            entry["traceback"] = traceback.format_exc()[-4000:]
            print(f"[{name}] FAILED: {entry['error']}", flush=True)
        entry["wall_s"] = time.perf_counter() - start
    results["sections"][name] = entry
    return entry


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


# ---------------------------------------------------------------------------------------- server


class Server:
    """`python -m hicache serve` in a child process group of its own, on a free port."""

    def __init__(self, name: str, flags: list[str], log_dir: Path) -> None:
        self.name = name
        self.cmd = [sys.executable, "-m", "hicache", "serve", "--port", "0", "--log-level", "warning"]
        self.cmd += ["--log-dir", str(log_dir / name), *flags]
        self.log = log_dir / f"{name}.stderr.log"
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.ready: dict[str, Any] = {}
        self.host, self.port = "127.0.0.1", 0

    def start(self) -> None:
        """Start it; `wait_ready` waits for its ready line (so other work can overlap start-up)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        print(f"  starting {self.name}: {' '.join(self.cmd[1:])}", flush=True)
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(
                self.cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
            )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(
                    f"{self.name}: not ready after {timeout:.0f} s: {self.log_tail()}"
                ) from None
            if line is None:
                raise RuntimeError(f"{self.name}: exited before it was ready: {self.log_tail()}")
            try:
                ready = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(ready, dict) and "url" in ready:
                self.ready = ready
                url = urlsplit(ready["url"])
                self.host, self.port = url.hostname or "127.0.0.1", int(url.port or 0)
                return ready

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM (a clean shutdown of serve and its nodes), then SIGKILL to its process group."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the nodes it started, if any stayed
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    # -- requests ---------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any, timeout: float) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body)
            conn.request(method, path, data, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def generate(
        self, ids: list[int], new: int, timeout: float, *, ignore_eos: bool = True
    ) -> dict[str, Any]:
        """SGLang's /generate with token ids, greedy; the reply's JSON."""
        params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": ignore_eos}
        status, data = self.request(
            "POST", "/generate", {"input_ids": ids, "sampling_params": params}, timeout
        )
        if status != 200:
            raise RuntimeError(f"/generate: HTTP {status}: {data[:500]!r}")
        return json.loads(data)

    def stream(self, ids: list[int], new: int, timeout: float) -> dict[str, Any]:
        """A streamed /generate: seconds to the first token, in all, and the last snapshot."""
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        start = time.perf_counter()
        try:
            conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"/generate stream: HTTP {resp.status}: {resp.read()[:500]!r}")
            first, last = -1.0, None
            while line := resp.readline():
                line = line.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                last = json.loads(line[5:])
                if first < 0 and last.get("output_ids"):
                    first = time.perf_counter() - start
        finally:
            conn.close()
        if last is None or first < 0:
            raise RuntimeError("/generate stream: no token came back")
        return {"ttft_s": first, "total_s": time.perf_counter() - start, "reply": last}

    def metrics(self, timeout: float = 30.0) -> dict[str, float]:
        """The decode node's gauges from /metrics (hicache_backend_*), by their short names."""
        status, data = self.request("GET", "/metrics", None, timeout)
        if status != 200:
            raise RuntimeError(f"/metrics: HTTP {status}")
        out = {}
        for line in data.decode().splitlines():
            if line.startswith("hicache_backend_") and " " in line:
                key, value = line.rsplit(" ", 1)
                out[key.removeprefix("hicache_backend_")] = float(value)
        return out

    def flush(self, timeout: float = 30.0) -> str:
        status, data = self.request("POST", "/flush_cache", None, timeout)
        if status != 200:
            raise RuntimeError(f"/flush_cache: HTTP {status}: {data[:300]!r}")
        return data.decode().strip()


def tiers(reply: dict[str, Any]) -> dict[str, int]:
    """Prompt tokens restored from each tier, as the server reports them."""
    meta = reply.get("meta_info", {})
    details = meta.get("cached_tokens_details") or {}
    out = {tier: int(details.get(tier, 0)) for tier in ("l1", "l2", "l3")}
    out["cached"] = int(meta.get("cached_tokens", 0))
    out["prompt"] = int(meta.get("prompt_tokens", 0))
    return out


# ----------------------------------------------------------------------------------- transformers


class Reference:
    """transformers' model and tokenizer from the default GGUF, on the device and in the dtype
    the server runs (as tests/test_llama.py's `reference` fixture loads it, EOS stopping off)."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from hicache.runtime.model.model_file import default_model_path

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        start = time.perf_counter()
        path = default_model_path()
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        self.model = model.to(device).eval()
        self.model.generation_config.eos_token_id = None  # never stop early, as ignore_eos
        self.model.generation_config.pad_token_id = 0
        self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        self.device = device
        self.load_s = time.perf_counter() - start

    def chat_ids(self, content: str) -> list[int]:
        got: Any = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
        )
        if hasattr(got, "keys"):  # a BatchEncoding (transformers 5)
            got = got["input_ids"]
        if got and isinstance(got[0], list):
            got = got[0]
        return [int(t) for t in got]

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def generate(self, prompts: Sequence[list[int]], new: int) -> tuple[list[list[int]], float]:
        """Greedy `generate` of the prompts as one left-padded batch: new ids and seconds."""
        width = max(map(len, prompts))
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        sync(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        sync(self.device)
        seconds = time.perf_counter() - start
        return out[:, width:].tolist(), seconds


# ------------------------------------------------------------------------------------- sections


async def copy_section(device: str, quick: bool) -> dict[str, Any]:
    """Load-back L2 -> L1 at 1 MiB and 8 MiB pages beside the plain host-to-device rate."""
    cuda = device.startswith("cuda")
    counts = [16, 64] if quick or not cuda else [16, 64, 256]
    repeat = 3
    out: dict[str, Any] = {"device": device}
    if cuda:
        link = gc.link_bandwidth(256 << 20, repeat)
        out["reference"] = {"what": "pinned H2D, one 256 MiB buffer", "gbps": link["h2d_best_gbps"], **link}
    else:
        host_parts = await gc.host_parts(quick=True)
        out["reference"] = {"what": "host memcpy, 64 MiB (no GPU)", "gbps": host_parts["memcpy_gbps"]}
    engine = CopyEngine(threads=2)
    rows: list[dict[str, Any]] = []
    for label in ("1 MiB", "8 MiB"):
        layout = gc.LAYOUTS[label]
        pages = max(counts)
        host = KVPool(layout, pages, name="l2")
        dev = KVPool(layout, pages, device=device, name="l1")
        gc.fill_pattern(dev)
        host.words_view().copy_(dev.words_view())
        dev.words_view().zero_()
        sync(device)
        rows += await gc.load_back(engine, label, host, dev, counts, repeat)
        del host, dev
        if cuda:
            torch.cuda.empty_cache()
    for row in rows:
        row["vs_reference"] = row["best_gbps"] / out["reference"]["gbps"]
    out["load_back"] = rows
    if not all(r["bit_exact"] for r in rows):
        out["error"] = "a load-back was not bit-exact"
    return out


def greedy_section(server: Server, ref: Reference, budget: Budget) -> dict[str, Any]:
    ids = ref.chat_ids(GREEDY_PROMPT)
    reply = server.generate(ids, GREEDY_TOKENS, budget.timeout())
    ours = [int(t) for t in reply["output_ids"]][:GREEDY_TOKENS]
    (theirs,), seconds = ref.generate([ids], GREEDY_TOKENS)
    equal = [a == b for a, b in zip(ours, theirs, strict=False)]
    first = next((i for i, same in enumerate(equal) if not same), None)
    if first is None and len(ours) != len(theirs):
        first = min(len(ours), len(theirs))
    out: dict[str, Any] = {
        "prompt": GREEDY_PROMPT,
        "prompt_tokens": len(ids),
        "tokens": GREEDY_TOKENS,
        "agree": GREEDY_TOKENS if first is None else first,  # the tokens before the first divergence
        "equal_positions": sum(equal),
        "first_divergence": first,  # None: all agree
        "server_ids": ours,
        "transformers_ids": theirs,
        "server_text": ref.tokenizer.decode(ours),
        "transformers_text": ref.tokenizer.decode(theirs),
        "transformers_s": seconds,
    }
    if first is not None and first < min(len(ours), len(theirs)):
        # How close a call it was for transformers: its logit of its own token less that of ours.
        prefix = torch.tensor([ids + theirs[:first]], device=ref.device)
        with torch.inference_mode():
            logits = ref.model(prefix).logits[0, -1].float()
        out["divergence_logit_gap"] = float(logits[theirs[first]] - logits[ours[first]])
        out["divergence_logit_spread"] = float(logits.max() - logits.min())
    return out


def storage_settled(folder: Path, timeout: float) -> int:
    """Wait until the L3 folder's file count stops changing (write-through stores done)."""
    deadline = time.monotonic() + timeout
    last, same = -1, 0
    while time.monotonic() < deadline:
        count = sum(1 for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0
        same = same + 1 if count == last else 0
        if same >= 3:
            return count
        last = count
        time.sleep(0.3)
    return last


def conversation_section(
    server: Server, ref: Reference | None, storage: Path, rng: random.Random, budget: Budget, new: int
) -> dict[str, Any]:
    """Four turns; turn 3 restored from L2 (fillers pushed the history out of L1), turn 4 from
    L3 (L1 and L2 flushed)."""
    if ref is not None:
        prompt = ref.chat_ids(FIRST_MESSAGE)
        eos = ref.encode("<|im_end|>")

        def next_message(text: str) -> list[int]:
            return ref.encode(f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")

        how_text = "chat template, real text"
    else:  # transformers did not load: random ids stand in for the text
        prompt, eos = random_ids(rng, 320), []

        def next_message(text: str) -> list[int]:
            return random_ids(rng, 40)

        how_text = "random ids (no tokenizer: transformers did not load)"
    gauges = server.metrics()
    l1_tokens = int(gauges.get("max_total_tokens", 0))
    context = int(server.ready.get("context_length") or l1_tokens)
    turns: list[dict[str, Any]] = []
    for turn in range(4):
        how = {0: "cold (its system prompt may be cached from the greedy section)", 1: "history in L1"}.get(
            turn, ""
        )
        expect = {0: None, 1: "l1", 2: "l2", 3: "l3"}[turn]
        if turn == 2:
            # No HTTP route evicts L1 alone (/flush_cache evicts L1 and L2): prompts totalling
            # 1.15x L1 push the history out of L1 (LRU); write-through already copied it to L2.
            want = int(1.15 * l1_tokens) + 1
            n = max(2, math.ceil(want / max(1, min(context - 8, 4096))))
            size = math.ceil(want / n)
            for _ in range(n):
                server.generate(random_ids(rng, size), 1, budget.timeout())
            how = f"{n} filler prompts of {size} tokens (1.15x L1 = {l1_tokens} tokens) evicted L1"
        if turn == 3:
            files = storage_settled(storage, min(20.0, max(1.0, budget.left())))
            said = server.flush()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                gauges = server.metrics()
                if gauges.get("l1_pages_used", 0) == 0 and gauges.get("l2_pages_used", 0) == 0:
                    break
                time.sleep(0.2)
            how = f"POST /flush_cache ({said!r}; L1 and L2 emptied) after {files} L3 files settled"
        before = server.metrics()
        reply = server.generate(prompt, new, budget.timeout(), ignore_eos=False)
        got = tiers(reply)
        out_ids = [int(t) for t in reply["output_ids"]]
        turns.append(
            {
                "turn": turn + 1,
                "expect": expect,
                "how": how,
                **got,
                "l1_pages_used_before": before.get("l1_pages_used"),
                "l2_pages_used_before": before.get("l2_pages_used"),
                "e2e_s": reply.get("meta_info", {}).get("e2e_latency"),
                "reply_tokens": len(out_ids),
            }
        )
        print(f"  turn {turn + 1}: {got} ({how})", flush=True)
        if turn < 3:
            if eos and out_ids[-len(eos) :] == eos:
                out_ids = out_ids[: -len(eos)]
            prompt = prompt + out_ids + next_message(FOLLOW_UPS[turn])
    missing = [
        f"turn {t['turn']}: nothing from {t['expect']}" for t in turns if t["expect"] and t[t["expect"]] <= 0
    ]
    out: dict[str, Any] = {"prompt_text": how_text, "turns": turns}
    if missing:
        out["error"] = "; ".join(missing)
    return out


def server_rate(server: Server, prompts: list[list[int]], new: int, budget: Budget) -> dict[str, Any]:
    """Output tokens/s of the prompts sent at once, one request (and connection) each."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda p: server.generate(p, new, budget.timeout()), prompts))
    wall = time.perf_counter() - start
    tokens = sum(len(r["output_ids"]) for r in replies)
    if tokens != new * len(prompts):
        raise RuntimeError(f"expected {new * len(prompts)} output tokens, got {tokens}")
    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens}


def decode_section(
    server: Server, ref: Reference | None, rng: random.Random, budget: Budget, new: int
) -> dict[str, Any]:
    prompts = [random_ids(rng, rng.randrange(24, 41)) for _ in range(33)]
    server.generate(random_ids(rng, 16), 4, budget.timeout())  # warm
    out: dict[str, Any] = {"new_tokens": new, "prompt_tokens": [len(p) for p in prompts]}
    out["server_b1"] = server_rate(server, prompts[:1], new, budget)
    server_rate(server, [random_ids(rng, 16) for _ in range(32)], 2, budget)  # warm the batch
    out["server_b32"] = server_rate(server, prompts[1:], new, budget)
    if ref is None:
        raise RuntimeError("transformers did not load: no reference rates")
    ref.generate([prompts[0][:8]], 4)  # warm
    _, seconds = ref.generate(prompts[:1], new)
    out["transformers_b1"] = {"tok_s": new / seconds, "wall_s": seconds}
    _, seconds = ref.generate(prompts[1:], new)
    out["transformers_b32"] = {"tok_s": 32 * new / seconds, "wall_s": seconds}
    for b in ("b1", "b32"):
        out[f"ratio_{b}"] = out[f"server_{b}"]["tok_s"] / out[f"transformers_{b}"]["tok_s"]
    return out


def ttft_run(server: Server, history: list[int], messages: list[list[int]], budget: Budget) -> dict[str, Any]:
    """The history once (cold), then each follow-up (history + reply + message) timed."""
    warm = server.stream(history, 8, budget.timeout())
    reply_ids = [int(t) for t in warm["reply"]["output_ids"]]
    follow = [server.stream(history + reply_ids + m, 4, budget.timeout()) for m in messages]
    ttfts = [f["ttft_s"] for f in follow]
    return {
        "cold_ttft_s": warm["ttft_s"],
        "follow_up_ttft_s": statistics.median(ttfts),
        "follow_up_ttfts_s": ttfts,
        "follow_up_prompt_tokens": len(history) + len(reply_ids) + len(messages[0]),
        "follow_up_cached": [tiers(f["reply"]) for f in follow],
    }


# ------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--base-gpu-id", type=int, default=0, help="the GPU of --device cuda (serve's flag)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--quick", action="store_true", help="the smallest sizes (what the test runs)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole script's wall-clock budget")
    ap.add_argument("--out", type=Path, help="the JSON results (default: under $TMPDIR)")
    ap.add_argument("--log-dir", type=Path, help="keep the servers' logs here (default: a temporary folder)")
    ap.add_argument("--l1-pages", type=int, help="the server's L1 pages (default: by device and --quick)")
    ap.add_argument("--decode-tokens", type=int, help="output tokens per request in the decode section")
    ap.add_argument("--ttft-tokens", type=int, help="history tokens of the TTFT section (default 4000)")
    ap.add_argument("--ttft-repeats", type=int, help="timed follow-ups per server (median)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    # Sizes: the CPU run must stay within a few minutes on 2 cores; L1 must hold 32 requests.
    # --quick: 32 requests of <= 40 + 16 tokens and a 16-token reserve take 4 pages each, and a
    # smaller L1 takes fewer filler tokens to push the conversation out of it.
    args.l1_pages = args.l1_pages or (160 if args.quick else 1024 if cuda else 384)
    args.reserve_tokens = 16 if args.quick else 64
    args.decode_tokens = args.decode_tokens or (16 if args.quick else 256 if cuda else 32)
    args.ttft_tokens = args.ttft_tokens or (600 if args.quick else 4000)
    args.ttft_repeats = args.ttft_repeats or (3 if cuda and not args.quick else 1)
    return args


def serve_flags(args: argparse.Namespace) -> list[str]:
    """What both servers share: the device, the dtypes, L1 and a small per-request reserve (so
    that 32 requests run at once in a small L1)."""
    flags = ["--device", args.device, "--dtype", args.dtype]
    if args.device == "cuda":
        flags += ["--base-gpu-id", str(args.base_gpu_id)]
    if args.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    return flags + ["--l1-pages", str(args.l1_pages), "--decode-reserve-tokens", str(args.reserve_tokens)]


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    budget = Budget(args.budget_s)
    device = f"cuda:{args.base_gpu_id}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(args.base_gpu_id)
    info = gc.device_info() | {"device": device, "dtype": args.dtype}
    if args.device == "cuda":
        info["gpu_used"] = torch.cuda.get_device_name(args.base_gpu_id)
    results: dict[str, Any] = {"device": info, "args": {k: str(v) for k, v in vars(args).items()}}
    results["sections"] = {}
    rng = random.Random(args.seed)
    logs = args.log_dir or work / "logs"
    storage = work / "l3"
    base = serve_flags(args)
    cache_on = Server(
        "serve_cache_on", [*base, "--hicache-storage-backend", "file", "--storage-dir", str(storage)], logs
    )
    cache_off = Server("serve_cache_off", [*base, "--no-decode-cache"], logs)
    results["servers"] = {"cache_on": cache_on.cmd[1:], "cache_off": cache_off.cmd[1:]}

    run_section(results, "copy", 10, budget, lambda: trio.run(copy_section, device, args.quick))

    ref: Reference | None = None
    ref_error = "not loaded"
    ready_error: str | None = None
    try:
        try:
            cache_on.start()  # starts while transformers loads here
        except Exception as exc:
            ready_error = f"{type(exc).__name__}: {exc}"
        try:
            ref = Reference(device, getattr(torch, args.dtype))
            results["transformers_load_s"] = ref.load_s
        except Exception as exc:
            ref_error = f"{type(exc).__name__}: {exc}"
            results["transformers_error"] = ref_error
        if ready_error is None:
            try:
                results["ready"] = cache_on.wait_ready(max(10.0, min(300.0, budget.left())))
                print(f"  ready: {json.dumps(cache_on.ready)}", flush=True)
            except Exception as exc:
                ready_error = str(exc)

        def with_server(fn: Callable[[], dict[str, Any]], needs_ref: bool = False) -> Callable[[], dict]:
            def go() -> dict[str, Any]:
                if ready_error is not None:
                    raise RuntimeError(f"the server did not start: {ready_error}")
                if needs_ref and ref is None:
                    raise RuntimeError(f"transformers did not load: {ref_error}")
                return fn()

            return go

        run_section(
            results, "greedy", 15, budget, with_server(lambda: greedy_section(cache_on, ref, budget), True)
        )
        run_section(
            results,
            "conversation",
            30,
            budget,
            with_server(lambda: conversation_section(cache_on, ref, storage, rng, budget, 24)),
        )
        run_section(
            results,
            "decode",
            30,
            budget,
            with_server(lambda: decode_section(cache_on, ref, rng, budget, args.decode_tokens)),
        )

        def ttft() -> dict[str, Any]:
            history = random_ids(rng, args.ttft_tokens)
            messages = [random_ids(rng, 24) for _ in range(args.ttft_repeats)]
            out: dict[str, Any] = {"history_tokens": args.ttft_tokens, "repeats": args.ttft_repeats}
            out["on"] = ttft_run(cache_on, history, messages, budget) | {"server": "L1+L2+L3 (server above)"}
            cache_on.stop()
            if budget.left() < 60:
                out["off"] = {"skipped": f"out of budget: {budget.left():.0f} s left for a second server"}
                return out
            cache_off.start()
            cache_off.wait_ready(max(10.0, min(300.0, budget.left())))
            off = ttft_run(cache_off, history, messages, budget)
            out["off"] = off | {"server": "--no-decode-cache (prefill may reuse its own cache)"}
            out["speedup"] = off["follow_up_ttft_s"] / out["on"]["follow_up_ttft_s"]
            return out

        run_section(results, "ttft", 45, budget, with_server(ttft))
    finally:
        for server in (cache_on, cache_off):
            code = server.stop()
            if code is not None:
                results.setdefault("server_exit", {})[server.name] = code
                if code not in (0, -signal.SIGTERM):
                    results.setdefault("server_logs", {})[server.name] = server.log_tail()
    results["wall_s"] = time.monotonic() - budget.start
    return results


# ----------------------------------------------------------------------------------------- output


def tables(results: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of every table printed."""
    s = results["sections"]
    dev = results["device"]

    def f(x: Any, fmt: str = ".2f") -> str:
        if x is None:
            return "-"
        return format(x, fmt) if isinstance(x, float) else str(x)

    out: list[tuple[str, list[str], list[list[str]]]] = []
    summary = []
    for name in SECTIONS:
        e = s.get(name, {"status": "missing"})
        note = e.get("error") or e.get("reason") or ""
        summary.append([name, e["status"], f(e.get("wall_s"), ".1f"), note[:100]])
    title = f"gpu_serve_check on {dev['device']} ({dev.get('gpu_used', dev.get('host'))}), {dev['dtype']}"
    out.append((title, ["section", "status", "wall s", "note"], summary))
    if s.get("copy", {}).get("status") == "ok":
        c = s["copy"]
        rows = [["reference", "-", "-", f(c["reference"]["gbps"]), "1.00", c["reference"]["what"]]]
        for r in c["load_back"]:
            rows.append(
                [f"load-back {r['page']}", str(r["pages"]), str(r["mib"]), f(r["best_gbps"]),
                 f(r["vs_reference"]), f"bit-exact {r['bit_exact']}"]
            )  # fmt: skip
        out.append(
            (f"copy (GB/s, device {c['device']})", ["what", "pages", "MiB", "GB/s", "x ref", ""], rows)
        )
    if s.get("greedy", {}).get("status") == "ok":
        g = s["greedy"]
        rows = [
            ["agree (before the first divergence)", f"{g['agree']}/{g['tokens']}"],
            ["equal positions", f"{g['equal_positions']}/{g['tokens']}"],
            ["first divergence", f(g["first_divergence"])],
            ["transformers' logit gap there", f(g.get("divergence_logit_gap"), ".3f")],
            ["server", repr(g["server_text"])[:90]],
            ["transformers", repr(g["transformers_text"])[:90]],
        ]
        out.append(("greedy tokens vs transformers", ["", ""], rows))
    if s.get("conversation", {}).get("status") == "ok":
        rows = [
            [
                str(t["turn"]),
                str(t["prompt"]),
                str(t["l1"]),
                str(t["l2"]),
                str(t["l3"]),
                f(t["expect"]),
                t["how"],
            ]
            for t in s["conversation"]["turns"]
        ]
        out.append(
            (
                "conversation: cached tokens by tier",
                ["turn", "prompt", "L1", "L2", "L3", "expect", "how"],
                rows,
            )
        )
    if s.get("decode", {}).get("status") == "ok":
        d = s["decode"]
        rows = [
            [
                b,
                f(d[f"server_{b}"]["tok_s"], ".1f"),
                f(d[f"transformers_{b}"]["tok_s"], ".1f"),
                f(d[f"ratio_{b}"]),
            ]
            for b in ("b1", "b32")
        ]
        out.append(
            (
                f"decode tok/s ({d['new_tokens']} tokens a request)",
                ["batch", "serve", "transformers", "x"],
                rows,
            )
        )
    if s.get("ttft", {}).get("status") == "ok":
        t = s["ttft"]
        rows = []
        for key in ("on", "off"):
            r = t.get(key, {})
            if "skipped" in r:
                rows.append([key, "-", "-", "-", r["skipped"]])
                continue
            cached = r["follow_up_cached"][0]
            rows.append(
                [key, f(r["cold_ttft_s"], ".3f"), f(r["follow_up_ttft_s"], ".3f"),
                 f"L1 {cached['l1']} L2 {cached['l2']} L3 {cached['l3']}", r["server"]]
            )  # fmt: skip
        title = f"TTFT of a follow-up on a {t['history_tokens']}-token history (s)"
        if "speedup" in t:
            title += f": cache on is {t['speedup']:.1f}x faster"
        out.append((title, ["decode cache", "cold", "follow-up", "follow-up cached", "server"], rows))
    return out


def print_tables(results: dict[str, Any]) -> None:
    """With rich when it is installed (a bench extra), else plain columns."""
    try:
        from rich.console import Console
        from rich.table import Table

        fancy = True
    except ImportError:
        fancy = False
    for title, header, rows in tables(results):
        if fancy:
            table = Table(title=title, title_justify="left")
            for h in header:
                table.add_column(h)
            for row in rows:
                table.add_row(*row)
            Console(width=160).print(table)
            continue
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        print(f"\n{title}")
        for row in [header, *rows]:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    print(f"\nwall {results['wall_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = (
        args.out
        or Path(tempfile.gettempdir()) / "hicache-gpu-serve-check" / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    with tempfile.TemporaryDirectory(prefix="gpu-serve-check-") as tmp:
        results = run(args, Path(tmp))
    failed = [n for n in SECTIONS if results["sections"].get(n, {}).get("status") == "failed"]
    results["failed"] = failed
    results["skipped"] = [n for n in SECTIONS if results["sections"].get(n, {}).get("status") == "skipped"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print_tables(results)
    print(f"results: {out}")
    if results["skipped"]:
        print(f"SKIPPED sections (out of --budget-s): {', '.join(results['skipped'])}")
    if failed:
        print(f"FAILED sections: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

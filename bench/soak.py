"""Soak a prefill and a decode node on loopback: steady multi-turn traffic for a bounded time,
watching the decode process for leaks (a script, not a test; `tests/test_soak.py` runs it short).

Usage: python bench/soak.py [--seconds 600] [--warmup S] [--conversations 4] [--fault-rate 0.01]
                            [--faults SPEC | --no-faults] [--kv-every 4] [--out FILE.json]

Two processes (`hicache node prefill` and `hicache node decode`, TCP engine, an L3 file store in a
temporary folder, small L1 and L2 so that pages move through every tier) and, here,
`--conversations` clients that talk without pause. Each client keeps `--sessions` conversations
and continues one of them, picked at random, each turn: the prompt is the conversation so far plus
new tokens, until it passes `--max-context` tokens and a new conversation takes its place (all of
them open with one shared system prompt). When the decode node takes `--faults`, every kind of
operation it performs fails, is cut short or corrupted at `--fault-rate` (errors, partial
results, corrupted pages; no peer deaths). Every reply is checked against the model
(`KVLedger`: each page bit-identical to bytes computed for it, tokens equal to greedy
generation); one in `--kv-every` also brings its whole KV, compared with a forward pass.

Every second the script samples the decode process's resident memory (VmRSS in
/proc/PID/status) and its open file descriptors (/proc/PID/fd). It reports the least-squares RSS
slope after `--warmup` seconds in MB/min, the range of the fd count after warm-up, how many
requests were sent and how many ended (an unanswered request is a failure of the soak), their
outcomes, and the faults the node injected and caught. The JSON report goes to stdout's last line
and to `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

try:
    import hicache.runtime  # noqa: F401  (only probing whether the package is importable)
except ImportError:  # run from a checkout without installing: put the repo root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio  # noqa: E402

from hicache.runtime.launch import NodeProcess, start_node  # noqa: E402
from hicache.runtime.model.llama import TinyConfig, TinyModel  # noqa: E402
from hicache.runtime.verify import KVLedger  # noqa: E402
from hicache.runtime.wire import protocol  # noqa: E402
from hicache.runtime.wire.client import DecodeClient  # noqa: E402

# Fault kinds injected at `--fault-rate` each, per kind of operation of the decode node.
FAULT_KINDS = {
    "l3_exists": ("error", "partial"),
    "l3_get": ("error", "partial", "corrupt"),
    "l3_put": ("error", "partial", "corrupt"),
    "load": ("error", "partial", "corrupt"),
    "backup": ("error", "partial", "corrupt"),
    "transfer": ("error", "partial", "corrupt"),
    "timer": ("error",),
}
REQUEST_TIMEOUT_S = 120.0  # an answer later than this counts as a request that never ended


def fault_spec(rate: float, seed: int) -> str:
    items = [f"{op}:{kind}:{rate / len(kinds):g}" for op, kinds in FAULT_KINDS.items() for kind in kinds]
    return ",".join([*items, f"seed:{seed}"])


def decode_takes_faults() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "hicache", "node", "decode", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    return "--faults" in out.stdout


# ------------------------------------------------------------------------------------ sampling


def sample(pid: int) -> tuple[float, int]:
    """(resident MB, open file descriptors) of process `pid`."""
    rss_kb = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
                break
    return rss_kb / 1024.0, len(os.listdir(f"/proc/{pid}/fd"))


def slope_per_minute(t: list[float], y: list[float]) -> float:
    """Least-squares slope of y over t (seconds), per minute."""
    if len(t) < 2:
        return math.nan
    return float(np.polyfit(np.asarray(t), np.asarray(y), 1)[0]) * 60.0


# ------------------------------------------------------------------------------------ traffic


class Soak:
    def __init__(self, args: argparse.Namespace, decode: NodeProcess) -> None:
        self.args = args
        self.decode = decode
        self.ledger = KVLedger(TinyModel(TinyConfig(seed=args.model_seed)), args.page_size)
        self.vocab = TinyConfig().vocab
        self.system = np.random.default_rng(args.seed).integers(0, self.vocab, args.system_prompt).tolist()
        self.samples: list[tuple[float, float, int]] = []  # (seconds since start, RSS MB, fds)
        self.sent = 0
        self.ended = 0
        self.unanswered: list[str] = []
        self.outcomes: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.problems: list[str] = []
        self.verified = 0
        self.kv_compared = 0
        self.conversations = 0
        self.tokens = 0
        self.start = 0.0

    async def run(self) -> None:
        self.start = trio.current_time()
        deadline = self.start + self.args.seconds
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sampler, nursery.cancel_scope)
            async with trio.open_nursery() as clients:
                for worker in range(self.args.conversations):
                    clients.start_soon(self._talk, worker, deadline)
            nursery.cancel_scope.cancel()

    async def _sampler(self, scope: trio.CancelScope) -> None:
        while True:
            try:
                rss, fds = sample(self.decode.proc.pid)
            except (FileNotFoundError, ProcessLookupError):
                scope.cancel()  # the decode process is gone: the report says so
                return
            self.samples.append((trio.current_time() - self.start, rss, fds))
            await trio.sleep(1.0)

    async def _talk(self, worker: int, deadline: float) -> None:
        """One client: it keeps `--sessions` conversations and continues one of them, picked at
        random, each turn, so a conversation's pages have often left L1 (or L2) by its next turn."""
        rng = np.random.default_rng([self.args.seed, worker])
        client = await DecodeClient.connect("127.0.0.1", self.decode.port)
        sessions: list[list[int]] = [[] for _ in range(self.args.sessions)]
        n = 0
        try:
            while trio.current_time() < deadline:
                k = int(rng.integers(len(sessions)))
                prompt = sessions[k]
                if not prompt or len(prompt) > self.args.max_context:
                    self.conversations += 1
                    prompt = self.system + rng.integers(0, self.vocab, int(rng.integers(8, 64))).tolist()
                rid = f"w{worker}r{n}"
                n += 1
                max_new = int(rng.integers(4, 17))
                with_kv = self.args.kv_every > 0 and self.sent % self.args.kv_every == 0
                self.sent += 1
                with trio.move_on_after(REQUEST_TIMEOUT_S) as scope:
                    # Every request reports its pages' digests (the ledger needs every version of
                    # every page to check the restored ones); every kv_every-th one is also
                    # compared with a monolithic forward.
                    reply, kv = await client.generate(rid, prompt, max_new, verify=True)
                if scope.cancelled_caught:
                    self.unanswered.append(rid)
                    return  # this connection is stuck behind the request: stop this worker
                kv = kv if with_kv else None
                self.ended += 1
                self.outcomes[reply["outcome"]] += 1
                if reply["outcome"] != "finished":
                    self.reasons[str(reply.get("reason"))[:80]] += 1
                    sessions[k] = []
                    continue
                self.tokens += len(prompt) + len(reply["tokens"])
                problems = await trio.to_thread.run_sync(self.ledger.check, prompt, max_new, reply, kv)
                self.problems += problems
                self.verified += not problems
                self.kv_compared += kv is not None
                user = rng.integers(0, self.vocab, int(rng.integers(16, 65))).tolist()
                sessions[k] = prompt + reply["tokens"] + user
        except (protocol.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, EOFError) as exc:
            self.problems.append(f"worker {worker}: connection to the decode node lost: {exc!r}")
            self.unanswered.append(f"w{worker}r{n - 1}")
        finally:
            await client.aclose()

    def report(
        self, audit: dict[str, Any] | None, exit_code: int | None, faults: str | None
    ) -> dict[str, Any]:
        warm = [(t, r, f) for t, r, f in self.samples if t >= self.args.warmup]
        elapsed = self.samples[-1][0] if self.samples else 0.0
        out: dict[str, Any] = {
            "seconds": self.args.seconds,
            "warmup_s": self.args.warmup,
            "faults": faults,
            "conversations": self.conversations,
            "sent": self.sent,
            "ended": self.ended,
            "unanswered": self.unanswered,
            "outcomes": dict(self.outcomes),
            "unsuccessful_reasons": dict(self.reasons),
            "verified": self.verified,
            "kv_compared": self.kv_compared,
            "problems": self.problems[:20],
            "problem_count": len(self.problems),
            "requests_per_s": self.ended / elapsed if elapsed else None,
            "tokens": self.tokens,
            "samples": len(self.samples),
            "rss_mb": {
                "first": self.samples[0][1] if self.samples else None,
                "after_warmup": warm[0][1] if warm else None,
                "last": self.samples[-1][1] if self.samples else None,
                "max": max((r for _, r, _ in self.samples), default=None),
            },
            "rss_slope_mb_per_min": slope_per_minute([t for t, _, _ in warm], [r for _, r, _ in warm]),
            "fds": {
                "min_after_warmup": min((f for *_, f in warm), default=None),
                "max_after_warmup": max((f for *_, f in warm), default=None),
                "all": [min(f for *_, f in self.samples), max(f for *_, f in self.samples)]
                if self.samples
                else None,
            },
            "decode_exit_code": exit_code,
        }
        stats = audit.get("stats", {})
        out["node_tokens"] = {
            k: stats.get(k) for k in ("prompt_tokens", "l1_tokens", "l2_tokens", "l3_tokens")
        }
        out["node_tokens"].update(
            transferred=stats.get("transferred_tokens"), fallback=stats.get("fallback_tokens")
        )
        out["retracted"] = stats.get("retracted")
        out["faults_injected"] = audit.get("faults_injected")
        out["faults_caught"] = audit.get("faults_caught")
        out["core_check"] = audit.get("check")
        held = ("l1_leaked", "l2_leaked", "locks", "pins", "live", "reserved")
        out["held_at_rest"] = {k: audit[k] for k in held if k in audit} or None
        return out


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="hicache-soak-"))
    logs, storage = workdir / "logs", workdir / "l3"
    faults: str | None = None
    if not args.no_faults:
        if decode_takes_faults():
            faults = args.faults or fault_spec(args.fault_rate, args.seed)
        else:
            print(
                "soak: this `hicache node decode` takes no --faults; soaking without faults", file=sys.stderr
            )
    page = ["--page-size", str(args.page_size), "--model-seed", str(args.model_seed)]
    prefill = await start_node(["prefill", "--engine", "tcp", *page], logs, "prefill")
    decode: NodeProcess | None = None
    try:
        cmd = ["decode", "--engine", "tcp", "--prefill", f"127.0.0.1:{prefill.port}", *page]
        cmd += [
            "--l1-pages",
            str(args.l1_pages),
            "--l2-pages",
            str(args.l2_pages),
            "--storage-dir",
            str(storage),
        ]
        cmd += ["--prefetch-threshold-tokens", str(args.page_size), "--decode-reserve-tokens", "32"]
        if faults:
            cmd += ["--faults", faults]
        decode = await start_node(cmd, logs, "decode")
        run = Soak(args, decode)
        await run.run()
        audit: dict[str, Any] = {}
        if decode.proc.poll() is None:
            client = await DecodeClient.connect("127.0.0.1", decode.port)
            try:
                with trio.move_on_after(30):
                    await client.idle()
                    audit["stats"] = await client.stats()
                    audit.update((await client.call({"op": "audit"}))[0])
            except protocol.ProtocolError:
                pass  # a node without the audit op
            finally:
                await client.aclose()
        exit_code = decode.stop()  # SIGTERM: a clean shutdown exits 0
        return run.report(audit, exit_code, faults)
    finally:
        if decode is not None:
            decode.kill()
        prefill.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds", type=float, default=600.0, help="how long to send requests (default 600)"
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds excluded from the figures (default: a fifth, at most 60)",
    )
    parser.add_argument("--conversations", type=int, default=4, help="concurrent clients (default 4)")
    parser.add_argument(
        "--sessions", type=int, default=6, help="conversations each client keeps going (default 6)"
    )
    parser.add_argument(
        "--fault-rate",
        type=float,
        default=0.01,
        help="share of each operation kind that fails (default 0.01)",
    )
    parser.add_argument(
        "--faults", default=None, help="a --faults SPEC for the decode node instead of --fault-rate's"
    )
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument(
        "--kv-every",
        type=int,
        default=4,
        help="also compare one reply's whole KV in N with a forward pass (0: none)",
    )
    parser.add_argument(
        "--max-context", type=int, default=768, help="tokens after which a conversation restarts"
    )
    parser.add_argument("--system-prompt", type=int, default=48, help="tokens every conversation opens with")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--l1-pages", type=int, default=192)
    parser.add_argument("--l2-pages", type=int, default=384)
    parser.add_argument("--model-seed", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workdir", default=None, help="where logs and L3 go (default: a new temporary folder)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = parser.parse_args()
    if args.warmup is None:
        args.warmup = min(60.0, args.seconds / 5)
    began = time.perf_counter()
    report = trio.run(soak, args)
    report["wall_s"] = round(time.perf_counter() - began, 1)
    text = json.dumps(report, sort_keys=True)
    if args.out is not None:
        args.out.write_text(text + "\n")
    fds = report["fds"]
    print(
        f"soak: {report['ended']}/{report['sent']} requests ended "
        f"({report['requests_per_s'] or 0:.1f}/s, outcomes {report['outcomes']}), "
        f"{report['verified']} verified, {report['problem_count']} problems; decode RSS "
        f"{report['rss_mb']['after_warmup']} -> {report['rss_mb']['last']} MB, slope "
        f"{report['rss_slope_mb_per_min']:.2f} MB/min after {args.warmup:g} s; fds "
        f"{fds['min_after_warmup']}..{fds['max_after_warmup']}; faults {report.get('faults_injected')}",
        file=sys.stderr,
    )
    print(text)
    ok = not report["unanswered"] and report["ended"] == report["sent"] and report["decode_exit_code"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

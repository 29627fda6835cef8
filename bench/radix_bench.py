"""Our tiered prefix tree against SGLang's radix caches, side by side (a script, not a test).

Usage::

    .venv/bin/python bench/radix_bench.py --python /tmp/sglang-venv/bin/python \\
        --hi-python /tmp/sglang20-venv/bin/python [--quick] [--json figures.json] [--profile]

Without ``--python`` / ``--hi-python`` only our side runs. ``--quick`` is a smoke run of about a
minute; the full run (best of 3) took 30 minutes on a shared 2-vCPU machine.

SGLang's virtualenvs (outside the repository; the project's .venv is not touched). ``RadixCache`` is
measured with sglang 0.5.23, ``HiRadixCache`` with 0.5.20, the last release that ships it::

    python3 -m venv /tmp/sglang-venv
    /tmp/sglang-venv/bin/pip install torch==2.13.0 numpy       # must resolve to the CPU wheel
    /tmp/sglang-venv/bin/pip install --no-deps sglang==0.5.23  # pip warns about unmet deps: expected
    python3 -m venv /tmp/sglang20-venv
    /tmp/sglang20-venv/bin/pip install torch==2.13.0 numpy psutil
    /tmp/sglang20-venv/bin/pip install --no-deps sglang==0.5.20

Never install an unpinned torch there: sglang's metadata would pull a multi-GB CUDA build.
bench/radix_peer_sglang.py explains how SGLang's tree is imported without the rest of SGLang.

Workloads, generated deterministically here and written once to an .npz that both sides read:

- ``chat``: ``--conversations`` (2,000) conversations x ``--turns`` (5) over a shared
  ``--system-prompt`` (2,048 tokens); each turn adds user text of ``--user-tokens`` (1-8K) tokens
  and an output of ``--output-tokens`` (128-1,024) tokens, and its prompt is the previous prompt +
  output + the new text (`hicache.scenarios.multiturn.MultiTurnChat`). Prompt and output are
  inserted.
- ``mooncake``: the Mooncake conversation trace (``--trace``). Token j of block id h is
  ``splitmix64(h * 512 + j) % (vocab - 1) + 1``, so equal ids give equal tokens on both sides;
  prompts are cut to ``input_length``. Only prompts are inserted (the trace names no output).

Page size 1 runs on smaller workloads (``--page1-conversations`` chat conversations, the first
``--page1-requests`` trace requests): our tree pays Python work per page, which at page 1 is per
token. Both sides always run the same workload file.

Phases, each (side, workload, page size) in its own process so memory figures are its own:

- offline: insert every sequence in arrival order; match every prompt (a seeded shuffle);
  evict everything in ``--evict-chunk`` token calls; memory = RSS growth over the tree's build
  (with its slot pools) per cached token. Our side's L1-only tree: ``write_back`` with an empty
  L2 (so nothing is backed up). SGLang's side: ``RadixCache`` with a no-op allocator.
- online: requests in arrival order - match the prompt, lock, load the L2 hit back, evict to fit,
  insert prompt + output, unlock - on ``--capacity-tokens`` of L1: our tree L1-only against
  ``RadixCache``, and our tree with an L2 of ``--host-ratio`` x L1 under ``write_through`` (backups
  completed at once) against ``HiRadixCache`` with its host pool of the same size.

Times cover the tree calls only, as CPU time of the calling thread (``time.thread_time``, less
the clock's own cost): on a machine shared with other jobs, wall time also counts whoever else
ran. Each side runs ``--repeat`` times, taking turns, and the best run of each phase is reported
(all runs and wall times are in the ``--json`` file). Building keys is outside the timing on
both sides (SGLang: token ids into ``array('q')``); ours are chained page keys (`page_keys`,
numba, then ``tolist``), timed separately and reported as ``keys``, since SGLang's tree hashes
its page tuples inside its own calls. Both sides check each other: the offline match must hit
the same number of tokens, and the replays should land on the same hit ratios.

Bars, from the project's plan: >= 5x ``RadixCache`` on insert and match at page 64, >= 10x
``HiRadixCache`` on the online replay, no more memory per token than ``RadixCache``.
``--profile`` adds cProfile's top entries of our side per phase (a separate, slower run).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import io
import json
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np

try:
    import hicache.core.tree  # noqa: F401  (only probing whether the package is importable)
except ImportError:  # run from a checkout without installing: put the repo root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from radix_peer_sglang import Timer, Workload, peak_rss_bytes, rss_bytes  # noqa: E402

from hicache.core.commands import Backup  # noqa: E402
from hicache.core.pages import namespace_seed, page_keys  # noqa: E402
from hicache.core.pool import SlotPool  # noqa: E402
from hicache.core.tree import TieredRadixTree  # noqa: E402
from hicache.scenarios.multiturn import MultiTurnChat  # noqa: E402
from hicache.scenarios.traces import MOONCAKE_BLOCK, read_mooncake  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEER = Path(__file__).resolve().with_name("radix_peer_sglang.py")
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
VOCAB = 32_000
KEY_SEED = namespace_seed("radix-bench")

# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class ChatParams:
    """The multi-turn chat workload's parameters (generation is deterministic in them)."""

    conversations: int
    turns: int = 5
    system_prompt: int = 2048
    user_tokens: tuple[int, int] = (1024, 8192)
    output_tokens: tuple[int, int] = (128, 1024)
    hours: float = 1.0  # conversation starts spread over this long
    think_time: float = 60.0  # mean seconds between turns
    seed: int = 0


def chat_workload(p: ChatParams) -> Workload:
    """Each conversation's tokens are stored once: every turn's prompt + output is a prefix of
    the conversation's last turn, so a request is one segment of its conversation."""
    gen = MultiTurnChat(
        conversations=p.conversations,
        turns=p.turns,
        system_prompt=p.system_prompt,
        user_tokens=p.user_tokens,
        output_tokens=p.output_tokens,
        rate=p.conversations / (p.hours * 3600.0),
        think_time=p.think_time,
        vocab=VOCAB,
        seed=p.seed,
    )
    requests = gen.generate()
    last: dict[int, np.ndarray] = {}
    for r in requests:
        if r.turn == p.turns - 1:
            last[r.conversation] = np.concatenate([r.prompt, r.output])
    offsets = np.zeros(p.conversations + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(last[c]) for c in range(p.conversations)])
    tokens = np.concatenate([last[c] for c in range(p.conversations)]).astype(np.int32)
    prompt = np.array([len(r.prompt) for r in requests], dtype=np.int64)
    full = prompt + np.array([len(r.output) for r in requests], dtype=np.int64)
    for r in requests:  # the prefix property the layout relies on
        start = int(offsets[r.conversation])
        mid, end = start + len(r.prompt), start + len(r.prompt) + len(r.output)
        if not (np.array_equal(tokens[start:mid], r.prompt) and np.array_equal(tokens[mid:end], r.output)):
            raise AssertionError(f"chat workload: conversation {r.conversation} turn {r.turn} is no prefix")
    return Workload(
        name=f"chat {p.conversations}x{p.turns}",
        tokens=tokens,
        seg_start=np.array([offsets[r.conversation] for r in requests], dtype=np.int64),
        seg_len=full.copy(),
        req_seg=np.arange(len(requests) + 1, dtype=np.int64),
        prompt_len=prompt,
        full_len=full,
        arrival=np.array([r.arrival for r in requests], dtype=np.float64),
        match_order=np.random.default_rng(p.seed + 1).permutation(len(requests)).astype(np.int64),
    )


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def block_tokens(block_ids: np.ndarray, block: int = MOONCAKE_BLOCK) -> np.ndarray:
    """Rows of `block` token ids, one per block id: token j of id h is
    ``splitmix64(h * block + j) % (VOCAB - 1) + 1``."""
    out = np.empty((len(block_ids), block), dtype=np.int32)
    j = np.arange(block, dtype=np.uint64)
    step = max(1, (1 << 22) // block)
    for a in range(0, len(block_ids), step):
        ids = block_ids[a : a + step].astype(np.uint64)[:, None]
        with np.errstate(over="ignore"):
            x = splitmix64(ids * np.uint64(block) + j)
        out[a : a + step] = (x % np.uint64(VOCAB - 1) + np.uint64(1)).astype(np.int32)
    return out


def mooncake_workload(path: Path, limit: int | None, seed: int = 0) -> Workload:
    """The trace's first `limit` requests (all when None), prompts only."""
    reqs = read_mooncake(path)
    if limit is not None:
        reqs = reqs[:limit]
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)  # stable: ties keep file order
    reqs = [reqs[i] for i in order]
    ids = [np.asarray(r.block_ids, dtype=np.int64) for r in reqs]
    all_ids = np.concatenate(ids)
    distinct, rows = np.unique(all_ids, return_inverse=True)
    table = block_tokens(distinct)
    n_blocks = np.array([len(x) for x in ids], dtype=np.int64)
    req_seg = np.zeros(len(reqs) + 1, dtype=np.int64)
    req_seg[1:] = np.cumsum(n_blocks)
    prompt = np.array([r.input_length for r in reqs], dtype=np.int64)
    label = f"mooncake {len(reqs)} req" if limit is None else f"mooncake first {len(reqs)} req"
    return Workload(
        name=label,
        tokens=table.reshape(-1),
        seg_start=rows.astype(np.int64) * MOONCAKE_BLOCK,
        seg_len=np.full(len(all_ids), MOONCAKE_BLOCK, dtype=np.int64),
        req_seg=req_seg,
        prompt_len=prompt,
        full_len=prompt.copy(),
        arrival=np.array([r.arrival for r in reqs], dtype=np.float64),
        match_order=np.random.default_rng(seed + 1).permutation(len(reqs)).astype(np.int64),
    )


# ---------------------------------------------------------------------------------------------
# Our side (one workload and page size per process)
# ---------------------------------------------------------------------------------------------


class Profiles:
    """cProfile per phase when asked for; the top entries by own time, as text."""

    def __init__(self, enabled: bool, top: int = 25) -> None:
        self.enabled = enabled
        self.top = top
        self.text: dict[str, str] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        prof = cProfile.Profile()
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(self.top)
            self.text[name] = out.getvalue()


def complete_backups(tree: TieredRadixTree) -> int:
    """Complete every command the tree emitted (backups finish at once); returns how many."""
    done = 0
    for cmd in tree.drain():
        if isinstance(cmd, Backup):
            tree.backup_done(cmd.op)
            done += 1
    return done


def sequence_keys(w: Workload, page_size: int, timer: Timer) -> list[np.ndarray]:
    out = []
    for i in range(w.n):
        seq = w.sequence(i)
        timer.start()
        out.append(page_keys(seq, page_size, KEY_SEED))
        timer.stop(len(seq))
    return out


def run_ours_offline(w: Workload, page_size: int, evict_chunk: int, prof: Profiles) -> dict[str, Any]:
    hashing, listing = Timer(), Timer()
    keys = sequence_keys(w, page_size, hashing)
    unique_pages = int(np.unique(np.concatenate(keys)).shape[0])
    max_pages = max(len(k) for k in keys)
    gc.collect()
    rss0 = rss_bytes()
    device = SlotPool("L1", unique_pages + max_pages)
    tree = TieredRadixTree(device, SlotPool("L2", 0), eviction="lru", write_policy="write_back")
    insert = Timer()
    with prof.phase("offline insert"):
        for i in range(w.n):
            n = int(w.full_len[i])
            listing.start()
            k = keys[i].tolist()
            listing.stop(n)
            owner = ("request", i)
            slots = device.alloc(len(k), owner)
            insert.start()
            tree.insert(k, slots, owner, float(i))
            insert.stop(n)
    gc.collect()
    held = device.num_used * page_size
    rss_delta = rss_bytes() - rss0

    match = Timer()
    hit = 0
    with prof.phase("offline match"):
        for j, i in enumerate(w.match_order.tolist()):
            n = int(w.prompt_len[i])
            listing.start()
            k = keys[i][: n // page_size].tolist()
            listing.stop(n)
            match.start()
            m = tree.match(k, float(w.n + j))
            match.stop(n)
            hit += m.device_pages * page_size

    evict = Timer()
    chunk = max(1, evict_chunk // page_size)
    with prof.phase("offline evict"):
        while device.num_used:
            evict.start()
            r = tree.evict_device(chunk)
            evict.stop(r.freed * page_size)
            if r.freed == 0 and r.pending == 0:
                break
    tree.check()
    keys_cpu = hashing.seconds + listing.seconds
    return {
        "insert": insert.summary(),
        "match": {**match.summary(), "hit_tokens": hit},
        "evict": {**evict.summary(), "left_tokens": device.num_used * page_size},
        "memory": {
            "tokens_held": held,
            "rss_delta_bytes": rss_delta,
            "bytes_per_token": rss_delta / held if held else 0.0,
        },
        "keys": {
            "tokens": hashing.tokens,
            "seconds": keys_cpu,
            "tokens_per_s": hashing.tokens / keys_cpu if keys_cpu else 0.0,
            "hash_seconds": hashing.seconds,
            "tolist_seconds": listing.seconds,
        },
    }


def run_ours_online(
    w: Workload, page_size: int, capacity: int, host_ratio: float, prof: Profiles, name: str
) -> dict[str, Any]:
    """The replay loop; `host_ratio` 0 gives an L1-only tree (write_back, nothing backed up)."""
    l1_pages = capacity // page_size
    l2_pages = int(capacity * host_ratio) // page_size
    device, host = SlotPool("L1", l1_pages), SlotPool("L2", l2_pages)
    policy = "write_through" if host_ratio > 0 else "write_back"
    tree = TieredRadixTree(device, host, eviction="lru", write_policy=policy)
    # A breakdown of each request's time (wall clock; the request's total is CPU time).
    t = {k: Timer(cpu=False) for k in ("match", "lock", "alloc", "evict", "insert", "backups")}
    total, hashing = Timer(), Timer()
    prompt_tokens = device_hit = host_hit = rejected = 0
    with prof.phase(name):
        for i in range(w.n):
            seq = w.sequence(i)
            now = float(w.arrival[i])
            hashing.start()
            full = page_keys(seq, page_size, KEY_SEED).tolist()
            hashing.stop(len(seq))
            n_prompt = int(w.prompt_len[i])
            prompt = full[: n_prompt // page_size]
            prompt_tokens += n_prompt
            owner = ("request", i)
            total.start()
            t["match"].start()
            m = tree.match(prompt, now)
            t["match"].stop(n_prompt)
            t["lock"].start()
            lock = tree.lock(m.device_node)
            pin = tree.pin_host(m.host_node) if m.host_pages else None
            t["lock"].stop()
            device_hit += m.device_pages * page_size
            host_hit += m.host_pages * page_size
            need = len(full) - m.device_pages
            t["alloc"].start()
            slots = device.alloc(need, owner)
            t["alloc"].stop()
            if slots is None:
                t["evict"].start()
                r = tree.evict_device(need - device.num_free)
                complete_backups(tree)
                slots = device.alloc(need, owner)
                t["evict"].stop(r.freed * page_size)
            t["insert"].start()
            if slots is not None:
                tree.insert(full, m.device_slots + slots, owner, now)
            else:
                rejected += 1
            t["insert"].stop(len(full) * page_size)
            t["backups"].start()
            complete_backups(tree)
            t["backups"].stop()
            t["lock"].start()
            tree.unlock(lock)
            if pin is not None:
                tree.unpin_host(pin)
            t["lock"].stop()
            total.stop()
    tree.check()
    return {
        "requests": w.n,
        "seconds": total.seconds,
        "wall_seconds": total.wall_seconds,
        "req_per_s": w.n / total.seconds if total.seconds else 0.0,
        "wall_req_per_s": w.n / total.wall_seconds if total.wall_seconds else 0.0,
        "request_p50_us": total.summary()["p50_us"],
        "request_p99_us": total.summary()["p99_us"],
        "prompt_tokens": prompt_tokens,
        "device_hit_tokens": device_hit,
        "host_hit_tokens": host_hit,
        "hit_ratio": (device_hit + host_hit) / prompt_tokens if prompt_tokens else 0.0,
        "rejected": rejected,
        "device_tokens": l1_pages * page_size,
        "host_tokens": l2_pages * page_size,
        "keys": hashing.summary(),
        "ops": {k: v.summary() for k, v in t.items()},
    }


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    w = Workload.load(args.ours)
    page_keys(np.arange(8, dtype=np.int32), args.page_size, KEY_SEED)  # load the kernel before timing
    prof = Profiles(args.profile)
    phases = set(args.phases.split(","))
    result: dict[str, Any] = {
        "impl": "hicache",
        "workload": w.name,
        "page_size": args.page_size,
        "requests": w.n,
        "core_digest": core_digest(),
    }
    if "offline" in phases:
        result["offline"] = run_ours_offline(w, args.page_size, args.evict_chunk, prof)
    if "online" in phases:
        result["online_l1"] = run_ours_online(w, args.page_size, args.capacity_tokens, 0.0, prof, "online L1")
        result["online"] = run_ours_online(
            w, args.page_size, args.capacity_tokens, args.host_ratio, prof, "online L1+L2"
        )
    result["peak_rss_bytes"] = peak_rss_bytes()
    if prof.text:
        result["profile"] = prof.text
    return result


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------


def run_child(cmd: list[str], out: Path, timeout: float) -> dict[str, Any] | None:
    """Run one side in its own process; its figures, or None (with the reason printed)."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        print(f"  FAILED ({proc.returncode}): {' '.join(cmd)}\n    " + "\n    ".join(tail), flush=True)
        return None
    result = json.loads(out.read_text(encoding="utf-8"))
    print(f"  {result['impl']}: {time.perf_counter() - start:.0f} s", flush=True)
    return result


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One result from repeats of the same configuration: per phase, the repeat where it ran
    fastest (the least disturbed by other load on a shared machine); memory from the repeat
    with the smallest figure. Each phase keeps the rates of all repeats under ``repeats``."""
    runs = [r for r in runs if r is not None]
    if not runs:
        return None
    out = dict(runs[0])
    if "offline" in out:
        off = {}
        for phase in ("insert", "match", "evict", "keys"):
            if phase in out["offline"]:
                rates = [r["offline"][phase]["tokens_per_s"] for r in runs]
                best = max(runs, key=lambda r, p=phase: r["offline"][p]["tokens_per_s"])
                off[phase] = {**best["offline"][phase], "repeats": rates}
        mems = [r["offline"]["memory"] for r in runs]
        off["memory"] = {
            **min(mems, key=lambda m: m["bytes_per_token"]),
            "repeats": [m["bytes_per_token"] for m in mems],
        }
        out["offline"] = off
    for key in ("online", "online_l1"):
        if key in out:
            best = max(runs, key=lambda r, k=key: r[k]["req_per_s"])
            out[key] = {**best[key], "repeats": [r[key]["req_per_s"] for r in runs]}
    out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in runs)
    return out


def core_digest() -> str:
    """A short digest of hicache/core/*.py, so figures can be tied to the code they measured."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "hicache" / "core").glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def fmt(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


@attrs.frozen
class Row:
    """One line of the table: a figure for both sides, their ratio (higher is better for us)."""

    workload: str
    page_size: int
    metric: str
    ours: float
    peer: float | None
    ratio: float | None
    bar: float | None = None  # the ratio we must reach, when the plan sets one

    @property
    def verdict(self) -> str:
        if self.bar is None or self.ratio is None:
            return ""
        return "ok" if self.ratio >= self.bar else "SHORT"


def rows_for(ours: dict[str, Any], radix: dict[str, Any] | None, hi: dict[str, Any] | None) -> list[Row]:
    wl, ps = ours["workload"], ours["page_size"]
    rows: list[Row] = []

    def add(
        metric: str, mine: float, theirs: float | None, bar: float | None = None, lower: bool = False
    ) -> None:
        ratio = None
        if theirs:
            ratio = theirs / mine if lower else mine / theirs
        rows.append(Row(wl, ps, metric, mine, theirs, ratio, bar))

    off, r_off = ours.get("offline"), (radix or {}).get("offline")
    if off:
        speed_bar = 5.0 if ps == 64 else None
        for phase in ("insert", "match", "evict"):
            theirs = r_off[phase]["tokens_per_s"] / 1e6 if r_off else None
            add(
                f"{phase} Mtok/s",
                off[phase]["tokens_per_s"] / 1e6,
                theirs,
                speed_bar if phase != "evict" else None,
            )
        keys = off["keys"]
        keys_rate = keys["tokens"] / keys["seconds"] / 1e6 if keys["seconds"] else 0.0
        rows.append(Row(wl, ps, "keys Mtok/s (ours only)", keys_rate, None, None))
        ins = off["insert"]
        with_keys = ins["tokens"] / (ins["seconds"] + keys["seconds"]) / 1e6
        theirs = r_off["insert"]["tokens_per_s"] / 1e6 if r_off else None
        add("insert+keys Mtok/s", with_keys, theirs)
        theirs = r_off["memory"]["bytes_per_token"] if r_off else None
        add("tree bytes/token", off["memory"]["bytes_per_token"], theirs, 1.0, lower=True)
    if "online_l1" in ours:
        theirs = radix["online"]["req_per_s"] if radix and "online" in radix else None
        add("online L1 req/s vs RadixCache", ours["online_l1"]["req_per_s"], theirs)
    if "online" in ours:
        theirs = hi["online"]["req_per_s"] if hi and "online" in hi else None
        add("online L1+L2 req/s vs HiRadix", ours["online"]["req_per_s"], theirs, 10.0)
        on = ours["online"]
        add(
            "online L1+L2 req/s, keys incl.", on["requests"] / (on["seconds"] + on["keys"]["seconds"]), theirs
        )
    return rows


def print_table(rows: list[Row]) -> None:
    head = (
        f"{'workload':<24} {'page':>4}  {'metric':<32} {'ours':>10} {'SGLang':>10} {'ratio':>8}  {'bar':>5}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        peer = fmt(r.peer) if r.peer is not None else "-"
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
        bar = f">={r.bar:g}x" if r.bar is not None else ""
        print(
            f"{r.workload:<24} {r.page_size:>4}  {r.metric:<32} {fmt(r.ours):>10} {peer:>10} {ratio:>8}"
            f"  {bar:>5} {r.verdict}"
        )
    print("(ratio: ours / SGLang for rates, SGLang / ours for bytes per token; higher is better for us)")


def print_checks(ours: dict[str, Any], radix: dict[str, Any] | None, hi: dict[str, Any] | None) -> None:
    """Cross-checks that both sides did the same work: equal match hits, comparable replays."""
    tag = f"{ours['workload']}, page {ours['page_size']}"
    if "offline" in ours and radix and "offline" in radix:
        a, b = ours["offline"]["match"]["hit_tokens"], radix["offline"]["match"]["hit_tokens"]
        same = "equal" if a == b else "DIFFER"
        print(f"  {tag}: offline match hits ours {a:,} / RadixCache {b:,} tokens ({same})")
    for key, peer, label in (("online_l1", radix, "RadixCache"), ("online", hi, "HiRadixCache")):
        if key in ours and peer and "online" in peer:
            o, p = ours[key], peer["online"]
            o_l2, p_l2 = (x["host_hit_tokens"] / x["prompt_tokens"] for x in (o, p))
            print(
                f"  {tag}: replay {key}: hit ours {o['hit_ratio']:.3f} (L2 {o_l2:.3f}) / {label}"
                f" {p['hit_ratio']:.3f} (L2 {p_l2:.3f}); rejected {o['rejected']} / {p['rejected']}"
            )


def build_workloads(args: argparse.Namespace, workdir: Path) -> list[tuple[Path, list[int]]]:
    """Write each workload file once; returns (file, page sizes to run on it)."""
    small = [p for p in args.page_sizes if p < args.small_below]
    large = [p for p in args.page_sizes if p >= args.small_below]
    todo: list[tuple[str, Callable[[], Workload], list[int]]] = []
    for wl in args.workloads.split(","):
        if wl == "chat":
            for convs, sizes in ((args.conversations, large), (args.page1_conversations, small)):
                # The smaller workload keeps the arrival rate, so the replay sees the same pressure.
                hours = convs / args.conversations
                p = ChatParams(
                    convs,
                    args.turns,
                    args.system_prompt,
                    args.user_tokens,
                    args.output_tokens,
                    hours,
                    seed=args.seed,
                )
                todo.append((f"chat{convs}", lambda p=p: chat_workload(p), sizes))
        elif wl == "mooncake":
            for limit, sizes in ((args.requests, large), (args.page1_requests, small)):
                stem = f"mooncake{limit if limit is not None else '-all'}"
                todo.append((stem, lambda n=limit: mooncake_workload(args.trace, n, args.seed), sizes))
        else:
            raise SystemExit(f"--workloads: unknown workload {wl!r}; expected chat and/or mooncake")
    out = []
    for stem, make, sizes in todo:
        if not sizes:
            continue
        start = time.perf_counter()
        w = make()
        path = workdir / f"{stem}.npz"
        w.save(path)
        print(
            f"workload {w.name}: {w.n:,} requests, {int(w.prompt_len.sum()):,} prompt tokens, "
            f"{int(w.full_len.sum()):,} inserted tokens ({time.perf_counter() - start:.1f} s)",
            flush=True,
        )
        out.append((path, sizes))
    return out


def side_commands(args: argparse.Namespace, base: list[str]) -> list[tuple[str, list[str]]]:
    """The processes that measure one configuration: our side, then each SGLang side asked for."""
    todo = [("ours", [sys.executable, __file__, "--ours", *base, "--phases", "offline,online"])]
    if args.python:
        todo.append(("radix", [args.python, str(PEER), *base, "--impl", "radix"]))
    if args.hi_python:
        todo.append(("hi", [args.hi_python, str(PEER), *base, "--impl", "hiradix", "--phases", "online"]))
    return todo


def run_configuration(
    args: argparse.Namespace, path: Path, page_size: int, tmp: Path
) -> tuple[dict[str, Any] | None, ...]:
    """Best-of-``--repeat`` figures of each side for one workload file and page size."""
    base = [
        str(path), "--page-size", str(page_size), "--capacity-tokens", str(args.capacity_tokens),
        "--host-ratio", str(args.host_ratio), "--evict-chunk", str(args.evict_chunk),
    ]  # fmt: skip
    todo = side_commands(args, base)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side, _ in todo}
    for rep in range(args.repeat):  # the sides take turns, so a slow spell of the machine hits both
        for side, cmd in todo:
            dest = tmp / f"{path.stem}-{page_size}.{side}.{rep}"
            got = run_child([*cmd, "--out", str(dest)], dest, args.timeout)
            if got is not None:
                runs[side].append(got)
    if args.profile:
        dest = tmp / f"{path.stem}-{page_size}.prof"
        prof = run_child([*todo[0][1], "--profile", "--out", str(dest)], dest, args.timeout)
        for phase, text in (prof or {}).get("profile", {}).items():
            print(f"\n--- cProfile of our side, {path.stem}, page {page_size}, {phase} ---\n{text}")
    return tuple(best_of(runs.get(side, [])) for side in ("ours", "radix", "hi"))


def orchestrate(args: argparse.Namespace) -> int:
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}; "
        f"L1 {args.capacity_tokens:,} tokens, L2 {args.host_ratio:g}x; evict chunk {args.evict_chunk}; "
        f"best of {args.repeat}; CPU time; hicache/core digest {core_digest()}"
    )
    results: list[dict[str, Any]] = []
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="radix-bench-") as tmpdir:
        tmp = Path(tmpdir)
        workdir = Path(args.keep_workloads) if args.keep_workloads else tmp
        workdir.mkdir(parents=True, exist_ok=True)
        for path, sizes in build_workloads(args, workdir):
            for ps in sizes:
                print(f"{path.stem}, page {ps}:", flush=True)
                ours, radix, hi = run_configuration(args, path, ps, tmp)
                if ours is None:
                    continue
                print_checks(ours, radix, hi)
                rows += rows_for(ours, radix, hi)
                results.append({"ours": ours, "radix": radix, "hiradix": hi})
    print_table(rows)
    if args.json:
        machine = {"python": platform.python_version(), "numpy": np.__version__, "arch": platform.machine()}
        doc = {
            "machine": machine,
            "core_digest": core_digest(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "rows": [attrs.asdict(r) for r in rows],
            "runs": results,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1), encoding="utf-8")
        print(f"figures written to {args.json}")
    return 0


def page_size_list(text: str) -> list[int]:
    """An argparse type: comma-separated page sizes, each >= 1."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"page sizes must be >= 1, got {text!r}")
    return sizes


def token_range(text: str) -> tuple[int, int]:
    """An argparse type: ``LO,HI`` with 1 <= LO <= HI."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", help="python of the virtualenv with sglang (RadixCache)")
    parser.add_argument("--hi-python", help="python of the virtualenv with sglang 0.5.20 (HiRadixCache)")
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries of our side")
    parser.add_argument("--workloads", default="chat,mooncake")
    parser.add_argument("--page-sizes", type=page_size_list, default=[1, 64])
    parser.add_argument("--small-below", type=int, default=16, help="smaller page sizes get small workloads")
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--page1-conversations", type=int, default=200)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-prompt", type=int, default=2048)
    parser.add_argument(
        "--user-tokens", type=token_range, default=(1024, 8192), help="LO,HI user text per turn"
    )
    parser.add_argument(
        "--output-tokens", type=token_range, default=(128, 1024), help="LO,HI output per turn"
    )
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=None, help="trace requests (default: all)")
    parser.add_argument("--page1-requests", type=int, default=1000)
    parser.add_argument("--capacity-tokens", type=int, default=1_000_000, help="L1 tokens in the replay")
    parser.add_argument("--host-ratio", type=float, default=2.0, help="L2 / L1 in the replay")
    parser.add_argument("--evict-chunk", type=int, default=4096, help="tokens per evict call (offline)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per side; the best is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    parser.add_argument("--keep-workloads", help="write the workload files here and keep them")
    # One configuration of our side, as the orchestrator runs it in a child process.
    parser.add_argument("--ours", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--page-size", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--phases", default="offline,online", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.page1_conversations = 60, 20
        args.requests, args.page1_requests = 300, 100
        args.capacity_tokens = min(args.capacity_tokens, 200_000)
        args.repeat = 1
    if args.capacity_tokens < 1 or args.host_ratio <= 0 or args.evict_chunk < 1 or args.repeat < 1:
        parser.error("--capacity-tokens, --evict-chunk and --repeat must be >= 1 and --host-ratio > 0")
    if not args.ours and not args.trace.exists() and "mooncake" in args.workloads:
        parser.error(f"--trace: {args.trace} does not exist (or leave mooncake out of --workloads)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ours:
        result = run_ours(args)
        text = json.dumps(result, indent=1)
        if args.out:
            args.out.write_text(text, encoding="utf-8")
        else:
            print(text)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark the transfer engines between two processes on loopback (a script, not a test).

Usage: python bench/transfer_bench.py [--pages 64] [--page-kib 256] [--repeat 20]
                                      [--engines raw,tcp,nixl,nixl-pt]

Each engine gets a fresh target process holding a registered pool. The initiator WRITEs all
pages (in a shuffled order, one descriptor per page, with a notification) and READs them back
into a second pool, checking the bytes once. The baseline is a plain blocking socket in the same
run: `sendall` of the same bytes from one contiguous buffer into `recv_into` on the other side,
then a one-byte ack, i.e. what a byte stream can do without any page bookkeeping.
`nixl-pt` is NIXL with its progress thread enabled on both sides (the engine's default is off).
GB/s = payload bytes / wall time of post + wait (1 GB = 1e9 bytes). The first two repetitions
(not timed) open the connections, including the TCP engine's handshake.

Both processes learn each other's engine (a TCP engine serves only peers it was told about) and
share the cluster secret: HICACHE_CLUSTER_SECRET if set, else a random one for this run.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

try:
    import hicache.runtime.transfer  # noqa: F401  (only probing whether the package is importable)
except ImportError:  # run from a checkout without installing: put the repo root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio  # noqa: E402

from hicache.runtime.transfer import NixlEngine, TcpEngine, TransferEngine, XferState  # noqa: E402

SCRIPT = Path(__file__).resolve()


def make_engine(kind: str, name: str) -> TransferEngine:
    if kind == "tcp":
        return TcpEngine(name=name)
    return NixlEngine(name, progress_thread=kind == "nixl-pt")


# ---------------------------------------------------------------------------------------------
# Target side (a child process)


def serve_raw(nbytes: int) -> None:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(f"@PORT {server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:])
                    if n == 0:
                        return
                    got += n
                conn.sendall(b"k")


async def serve_engine(kind: str, pages: int, page_bytes: int) -> None:
    pool = np.ones((pages, page_bytes), dtype=np.uint8)  # touched now, not during the timing
    async with make_engine(kind, "target") as engine:
        engine.register("pool", pool)
        print("@INFO " + engine.local_info().hex(), flush=True)
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        buf = b""
        while chunk := await stdin.receive_some(1 << 16):  # "ADD <hex>" lines, then EOF
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd, _, rest = line.decode().strip().partition(" ")
                if cmd == "ADD":
                    print("@PEER " + await engine.add_peer(bytes.fromhex(rest)), flush=True)


# ---------------------------------------------------------------------------------------------
# Initiator side


def spawn(kind: str, pages: int, page_bytes: int) -> tuple[subprocess.Popen[bytes], str]:
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--serve",
        kind,
        "--pages",
        str(pages),
        "--page-bytes",
        str(page_bytes),
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode().strip()
        if line.startswith("@"):
            return proc, line.split(" ", 1)[1]
    raise RuntimeError(f"target for {kind} exited with {proc.wait()} before it was ready")


def introduce(proc: subprocess.Popen[bytes], info: bytes) -> None:
    """Tell the target process about the initiator's engine and wait until it knows it."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"ADD " + info.hex().encode() + b"\n")
    proc.stdin.flush()
    for raw in proc.stdout:
        if raw.startswith(b"@PEER"):
            return
    raise RuntimeError(f"target exited with {proc.wait()} before it knew the initiator")


def stop(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench_raw(pages: int, page_bytes: int, repeat: int) -> list[float]:
    nbytes = pages * page_bytes
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    proc, port = spawn("raw", pages, page_bytes)
    times = []
    try:
        with socket.create_connection(("127.0.0.1", int(port))) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(repeat + 2):
                t0 = time.perf_counter()
                conn.sendall(memoryview(src))
                assert conn.recv(1) == b"k"
                if i >= 2:
                    times.append(time.perf_counter() - t0)
    finally:
        stop(proc)
    return times


async def bench_engine(
    kind: str, proc: subprocess.Popen[bytes], info: bytes, pages: int, page_bytes: int, repeat: int
) -> dict[str, list[float]]:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (pages, page_bytes), dtype=np.uint8)
    back = np.zeros_like(src)
    local_pages = rng.permutation(pages)
    remote_pages = rng.permutation(pages)
    times: dict[str, list[float]] = {"WRITE": [], "READ": []}
    async with make_engine(kind, "initiator") as engine:
        r_src = engine.register("src", src)
        r_back = engine.register("back", back)
        peer = await engine.add_peer(info)
        introduce(proc, engine.local_info())
        for op, region in (("WRITE", r_src), ("READ", r_back)):
            for i in range(repeat + 2):
                t0 = time.perf_counter()
                h = await engine.post(op, region, local_pages, peer, "pool", remote_pages, b"n")
                state = await engine.wait(h, timeout=60)
                dt = time.perf_counter() - t0
                if state is not XferState.DONE:
                    raise RuntimeError(f"{kind} {op} ended {state}: {engine.reason(h)}")
                engine.release(h)
                if i >= 2:
                    times[op].append(dt)
        if not np.array_equal(back[local_pages], src[local_pages]):
            raise RuntimeError(f"{kind}: the pages read back differ from the pages written")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-kib", type=int, default=256)
    ap.add_argument("--page-bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--engines", default="raw,tcp,nixl,nixl-pt")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    page_bytes = args.page_bytes or args.page_kib << 10

    if args.serve:
        rc = 0
        try:
            if args.serve == "raw":
                serve_raw(args.pages * page_bytes)
            else:
                trio.run(serve_engine, args.serve, args.pages, page_bytes)
        except BaseException as e:  # noqa: BLE001 - report, then leave without library teardown
            print(f"target {args.serve}: {e!r}", file=sys.stderr)
            rc = 1
        sys.stdout.flush()
        os._exit(rc)  # NIXL/UCX teardown at interpreter exit can crash on some hosts

    # Both processes must hold one cluster secret; the target inherits this environment.
    os.environ.setdefault("HICACHE_CLUSTER_SECRET", "bench-" + secrets.token_hex(16))
    nbytes = args.pages * page_bytes
    mib = nbytes / 2**20
    print(f"{args.pages} pages x {page_bytes >> 10} KiB = {mib:.0f} MiB per transfer, {args.repeat} reps")
    print(f"python {platform.python_version()}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}")
    rows: list[tuple[str, str, list[float]]] = []
    for kind in args.engines.split(","):
        if kind == "raw":
            rows.append(("raw socket", "send", bench_raw(args.pages, page_bytes, args.repeat)))
            continue
        try:
            proc, info = spawn(kind, args.pages, page_bytes)
        except (RuntimeError, ImportError) as e:
            print(f"{kind}: skipped ({e})")
            continue
        try:
            times = trio.run(
                bench_engine, kind, proc, bytes.fromhex(info), args.pages, page_bytes, args.repeat
            )
        finally:
            stop(proc)
        rows += [(kind, op, t) for op, t in times.items()]

    base = next((statistics.median(t) for name, _, t in rows if name == "raw socket"), None)
    print(f"{'engine':<11} {'op':<6} {'median GB/s':>11} {'best GB/s':>10} {'p90 ms':>8} {'vs raw':>7}")
    for name, op, t in rows:
        med = statistics.median(t)
        p90 = sorted(t)[int(0.9 * (len(t) - 1))]
        ratio = f"{base / med:7.2f}" if base else "      -"
        gbps, best = nbytes / med / 1e9, nbytes / min(t) / 1e9
        print(f"{name:<11} {op:<6} {gbps:11.2f} {best:10.2f} {p90 * 1e3:8.1f} {ratio}")
    os._exit(0)


if __name__ == "__main__":
    main()

"""A transfer-engine peer in its own process, driven by the transfer tests over stdin/stdout.

    python tests/transfer_peer.py --engine tcp|nixl --name NAME --pages N --page-bytes B --seed S

It starts an engine, registers a region "pool" holding `initial_pages(seed, N, B)` (zeros when
the seed is negative), prints
`@INFO <local_info hex>` and then answers one command per stdin line until stdin closes:

    ADD <hex>        add a peer from its local_info         -> @PEER <name>
    SUM <i,j,...>    blake2b digests of those pool pages    -> @SUM <hex,hex,...>
    NOTIF <seconds>  wait for the next notification         -> @NOTIF <peer> <hex> | @NONE
    NOTIFS           the notifications queued right now     -> @NOTIFS <peer>:<hex> ...

Replies start with "@" so that anything else a library prints on stdout is ignored. The process
ends with `os._exit`, since NIXL/UCX can crash in library teardown at interpreter exit on some
hosts after the work itself succeeded.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import numpy as np
import trio


def initial_pages(seed: int, num_pages: int, page_bytes: int) -> np.ndarray:
    if seed < 0:
        return np.zeros((num_pages, page_bytes), dtype=np.uint8)
    return np.random.default_rng(seed).integers(0, 256, (num_pages, page_bytes), dtype=np.uint8)


def digest(page: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(page).tobytes(), digest_size=16).hexdigest()


def reply(line: str) -> None:
    sys.stdout.write("@" + line + "\n")
    sys.stdout.flush()


async def lines(stream: trio.abc.ReceiveStream):  # noqa: ANN201 - async generator of str
    buf = b""
    while True:
        chunk = await stream.receive_some(1 << 16)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode()


async def serve(args: argparse.Namespace) -> None:
    from hicache.runtime.transfer import NixlEngine, TcpEngine

    engine = TcpEngine(name=args.name) if args.engine == "tcp" else NixlEngine(args.name)
    pool = initial_pages(args.seed, args.pages, args.page_bytes)
    async with engine:
        engine.register("pool", pool)
        reply("INFO " + engine.local_info().hex())
        async for line in lines(trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))):
            cmd, _, rest = line.strip().partition(" ")
            if cmd == "ADD":
                reply("PEER " + await engine.add_peer(bytes.fromhex(rest)))
            elif cmd == "SUM":
                pages = [int(p) for p in rest.split(",") if p]
                reply("SUM " + ",".join(digest(pool[p]) for p in pages))
            elif cmd == "NOTIF":
                with trio.move_on_after(float(rest)):
                    peer, msg = await engine.next_notif()
                    reply(f"NOTIF {peer} {msg.hex()}")
                    continue
                reply("NONE")
            elif cmd == "NOTIFS":
                reply(" ".join(["NOTIFS"] + [f"{p}:{m.hex()}" for p, m in engine.notifs()]))
            else:
                reply(f"ERROR unknown command {cmd!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("tcp", "nixl"), required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--pages", type=int, required=True)
    ap.add_argument("--page-bytes", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rc = 0
    try:
        trio.run(serve, args)
    except BaseException as e:  # noqa: BLE001 - report, then leave without library teardown
        print(f"transfer_peer: {e!r}", file=sys.stderr)
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    main()

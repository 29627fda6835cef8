"""Serving the app with Hypercorn's trio worker, in the same trio program as its backend."""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.trio.tcp_server import TCPServer
from starlette.applications import Starlette


def _port(bind: str) -> int:
    """The port of a bind Hypercorn reports ("http://127.0.0.1:8000", "http://[::1]:8000")."""
    return int(bind.rsplit(":", 1)[1])


log = logging.getLogger("hicache.runtime.serving")


def _one_connection_at_most() -> None:
    """Hypercorn (0.18) runs every connection in the server's own nursery and lets only an
    OSError out of one quietly: anything else a connection meets ends the whole server. A
    client can cause one: closing its half mid-body while the app answers makes Hypercorn send
    its 400 while it shuts the socket's write side (trio's BusyResourceError). Such an error
    ends that connection only, logged."""
    if getattr(TCPServer.run, "_one_connection", False):
        return
    run = TCPServer.run

    async def guarded(self: TCPServer) -> None:
        try:
            await run(self)
        except Exception as exc:
            log.warning("a connection ended on an error in the HTTP server: %s: %s", type(exc).__name__, exc)

    guarded._one_connection = True  # type: ignore[attr-defined]
    TCPServer.run = guarded  # type: ignore[method-assign]


def listening_socket(host: str, port: int, unread_timeout_s: float | None) -> socket.socket:
    """The front door's socket, bound here rather than by Hypercorn so that the connections it
    accepts inherit TCP_USER_TIMEOUT: the kernel resets a connection whose client has left
    what it was sent unread (a zero window) or unacknowledged for `unread_timeout_s`, which
    ends a response stuck on a client that stopped reading (Hypercorn's writes cannot be
    cancelled). None: the kernel's own behaviour (such a connection lives on)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if unread_timeout_s is not None and hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(
                socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, round(unread_timeout_s * 1000))
            )
        sock.bind((host.strip("[]"), port))
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_http(
    app: Starlette,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    graceful_timeout_s: float = 3.0,
    unread_timeout_s: float | None = 60.0,
) -> None:
    """Serve `app` on host:port until cancelled or until `shutdown_trigger` returns: then the
    generations in flight end as aborts that their responses report (`shutdown.py`), and
    requests in flight get `graceful_timeout_s` to be answered. Reports the bound port, so port 0
    works. `unread_timeout_s`: `listening_socket`'s."""
    _one_connection_at_most()
    sock = listening_socket(host, port, unread_timeout_s)
    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.errorlog = logging.getLogger("hypercorn.error")
    config.accesslog = None
    config.graceful_timeout = graceful_timeout_s
    trigger = None
    if shutdown_trigger is not None:
        stop_when = shutdown_trigger

        async def trigger() -> None:
            await stop_when()
            ctx = getattr(app.state, "ctx", None)
            if ctx is not None:
                ctx.shutdown.begin()

    async with trio.open_nursery() as nursery:
        try:
            binds: list[str] = await nursery.start(
                lambda task_status: serve(app, config, shutdown_trigger=trigger, task_status=task_status)
            )
        except BaseException:
            sock.close()
            raise
        sock.detach()  # Hypercorn holds the descriptor now, in a socket object of its own
        task_status.started(_port(binds[0]))

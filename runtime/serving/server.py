"""Serving the app with Hypercorn's trio worker, in the same trio program as its backend."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _port(bind: str) -> int:
    """The port of a bind Hypercorn reports ("http://127.0.0.1:8000", "http://[::1]:8000")."""
    return int(bind.rsplit(":", 1)[1])


async def serve_http(
    app: Starlette,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    graceful_timeout_s: float = 3.0,
) -> None:
    """Serve `app` on host:port until cancelled or until `shutdown_trigger` returns: then the
    generations in flight end as aborts that their responses report (`shutdown.py`), and
    requests in flight get `graceful_timeout_s` to be answered. Reports the bound port, so port 0
    works: Hypercorn binds the socket itself and reports its address through its own task_status."""
    config = Config()
    config.bind = [_bind(host, port)]
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
        binds: list[str] = await nursery.start(
            lambda task_status: serve(app, config, shutdown_trigger=trigger, task_status=task_status)
        )
        task_status.started(_port(binds[0]))

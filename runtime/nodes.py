"""Starting the runtime's nodes as processes: options, wiring, readiness, clean shutdown.

Each node prints one JSON line on stdout once it accepts connections (its ports), so a parent
process (or an operator's script) knows when and where to connect. SIGINT and SIGTERM cancel
the node's nursery: work in flight is cancelled, files are closed, and since every page file is
written to a temporary name and renamed, no partial page is ever visible in L3.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import attrs
import trio

from hicache.core.config import DecodeConfig
from hicache.faults import FaultSpec
from hicache.runtime.decode_node import DecodeService
from hicache.runtime.faults import FaultyStore
from hicache.runtime.kv_layout import KVLayout
from hicache.runtime.malloc_tuning import DEFAULT_MMAP_THRESHOLD, pin_mmap_threshold
from hicache.runtime.model import TinyConfig, TinyModel
from hicache.runtime.prefill_node import PrefillNode
from hicache.runtime.storage.file_store import FileStore
from hicache.runtime.storage.memory_store import MemoryStore
from hicache.runtime.transfer.base import TransferEngine
from hicache.runtime.transfer.tcp import TcpEngine

ENGINES = ("nixl", "tcp")


def layout_for(model: TinyConfig, page_size: int) -> KVLayout:
    return KVLayout(model.layers, model.kv_heads, model.head_dim, page_size, model.dtype)


def make_engine(kind: str, name: str) -> TransferEngine:
    if kind == "tcp":
        return TcpEngine(name=name)
    if kind == "nixl":
        from hicache.runtime.transfer.nixl_engine import NixlEngine

        return NixlEngine(name)
    raise ValueError(f"unknown transfer engine {kind!r}; expected one of: {', '.join(ENGINES)}")


@attrs.frozen
class PrefillOptions:
    port: int = 0
    host: str = "127.0.0.1"
    engine: str = "tcp"
    page_size: int = 16
    model: TinyConfig = TinyConfig()
    staging_pages: int = 1024
    mmap_threshold: int = DEFAULT_MMAP_THRESHOLD  # 0: leave glibc's adaptive threshold


@attrs.frozen
class DecodeOptions:
    prefill: tuple[str, int]
    core: DecodeConfig
    port: int = 0
    host: str = "127.0.0.1"
    engine: str = "tcp"
    model: TinyConfig = TinyConfig()
    storage_dir: Path | None = None  # None: an in-memory L3
    model_name: str = "tiny"
    tick_interval: float = 0.002
    faults: FaultSpec | None = None  # injected into the node's own operations
    mmap_threshold: int = DEFAULT_MMAP_THRESHOLD  # 0: leave glibc's adaptive threshold


def _ready(info: dict) -> None:
    print(json.dumps(info), flush=True)


async def _until_signal(cancel: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            cancel.cancel()
            return


async def run_prefill(opts: PrefillOptions) -> None:
    engine = make_engine(opts.engine, f"prefill-{opts.engine}-{os.getpid()}")
    async with engine, trio.open_nursery() as nursery:
        node = PrefillNode(
            TinyModel(opts.model),
            layout_for(opts.model, opts.page_size),
            engine,
            staging_pages=opts.staging_pages,
        )
        nursery.start_soon(_until_signal, nursery.cancel_scope)
        listeners = await nursery.start(node.serve, opts.port)
        _ready({"node": "prefill", "port": listeners[0].socket.getsockname()[1], "engine": engine.name})


async def run_decode(opts: DecodeOptions) -> None:
    layout = layout_for(opts.model, opts.core.page_size)
    store = FileStore(opts.storage_dir, layout) if opts.storage_dir is not None else MemoryStore(layout)
    if opts.faults is not None:
        FaultyStore.check(opts.faults, store)  # before anything starts: a bad spec exits with its reason
    # A restarted decode node must not reuse its predecessor's agent name: peers still know it.
    engine = make_engine(opts.engine, f"decode-{opts.engine}-{os.getpid()}")
    async with engine, trio.open_nursery() as nursery:
        service = DecodeService(
            opts.core,
            TinyModel(opts.model),
            layout,
            store,
            engine,
            model_name=opts.model_name,
            tick_interval=opts.tick_interval,
            faults=opts.faults,
        )
        nursery.start_soon(_until_signal, nursery.cancel_scope)
        port = await nursery.start(service.run, opts.port, opts.prefill)
        info = {"node": "decode", "port": port, "engine": engine.name}
        if isinstance(store, FileStore):
            info["leftovers_removed"] = store.leftovers_removed
        _ready(info)


def main_prefill(opts: PrefillOptions) -> int:
    pin_mmap_threshold(opts.mmap_threshold)
    trio.run(run_prefill, opts)
    return 0


def main_decode(opts: DecodeOptions) -> int:
    pin_mmap_threshold(opts.mmap_threshold)
    trio.run(run_decode, opts)
    sys.stdout.flush()
    return 0

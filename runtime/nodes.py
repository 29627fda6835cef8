"""Starting the runtime's nodes as processes: options, wiring, readiness, clean shutdown.

Each node prints one JSON line on stdout once it accepts connections (its ports), so a parent
process (or an operator's script) knows when and where to connect. SIGINT and SIGTERM cancel
the node's nursery: work in flight is cancelled, files are closed, and since every page file is
written to a temporary name and renamed, no partial page is ever visible in L3.

A node that cannot start — its port taken, its prefill node unreachable or refusing the hello,
its storage folder unusable — raises `StartupError` with one line naming the flag and the
reason; the command prints it and exits 2. Only those specific errors, and only during start-up:
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch
import trio

from hicache.core.config import DecodeConfig, l2_pages
from hicache.faults import FaultSpec
from hicache.runtime.decode.decode_node import DecodeService
from hicache.runtime.decode.faults import FaultyStore
from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.l1_sizing import SizingError, device_memory, l1_pages_for
from hicache.runtime.lone_error import sole
from hicache.runtime.malloc_tuning import DEFAULT_MMAP_THRESHOLD, pin_mmap_threshold
from hicache.runtime.model.device import DeviceError, describe, resolve_device
from hicache.runtime.model.llama import LlamaConfig, LlamaModel, TinyConfig, TinyModel
from hicache.runtime.model.tp_model import check_split, shard_model
from hicache.runtime.prefill.prefill_cache import DEFAULT_CACHE_BYTES, Speeds
from hicache.runtime.prefill.prefill_node import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_LAYER_GROUPS,
    DEFAULT_STEP_TOKENS,
    PrefillNode,
)
from hicache.runtime.security.api_keys import ApiKeyError, ApiKeys
from hicache.runtime.security.cluster_secret import ClusterSecret, UntrustedSecret
from hicache.runtime.security.limits import Limits
from hicache.runtime.security.peer_auth import AuthError
from hicache.runtime.storage.file_store import FileStore
from hicache.runtime.storage.memory_store import MemoryStore
from hicache.runtime.tp.tp_group import TPFailure, TPGroup
from hicache.runtime.transfer.base import TransferEngine
from hicache.runtime.transfer.tcp import TcpEngine
from hicache.runtime.wire import protocol
from hicache.runtime.wire.prefill_address import PrefillAddress, advertised, write

ENGINES = ("nixl", "tcp")
# What bind() says when the address cannot be listened on (rather than a peer being unreachable).
_BIND_ERRNOS = {errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES}
# What a prefill node that refuses the decode node's hello (or is not a prefill node) ends in.
_HELLO_ERRORS = (EOFError, protocol.ProtocolError, trio.BrokenResourceError)


_SECRET_FLAGS = "--secret-file or HICACHE_CLUSTER_SECRET"


class StartupError(Exception):
    """A node could not start; the message is one line for the operator, naming the flag."""


def why(exc: OSError) -> str:
    """The system's reason, short; trio's connect hides each attempt's error under one message."""
    if exc.errno is None and isinstance(exc.__cause__, BaseExceptionGroup):
        leaves = [e for e in exc.__cause__.exceptions if isinstance(e, OSError)]
        if leaves:
            exc = leaves[0]
    if exc.errno is not None and exc.errno > 0:
        return os.strerror(exc.errno)
    return exc.strerror or str(exc)


@contextlib.contextmanager
def _startup_error_unwrapped() -> Iterator[None]:
    """Let a `StartupError` out of `trio.run` as itself, not inside nested exception groups."""
    try:
        yield
    except BaseExceptionGroup as group:
        err = sole(group)
        if isinstance(err, StartupError):
            raise err from None
        raise


def layout_for(model: LlamaConfig, page_size: int, kv_dtype: str | None = None) -> KVLayout:
    """The pages' layout: the model's geometry, with K/V in `kv_dtype` (default: the model's)."""
    dtype = model.dtype if kv_dtype is None else kv_dtype
    return KVLayout(model.layers, model.kv_heads, model.head_dim, page_size, dtype)


def model_layout(model: LlamaModel, page_size: int) -> KVLayout:
    """The layout of `model`'s pages, in the dtype it keeps K/V in (`--kv-cache-dtype`)."""
    return layout_for(model.config, page_size, model.kv_dtype_name)


ModelSpec = TinyConfig | str  # the seeded tiny model, or "default" / a GGUF file / an HF folder


def build_model(
    spec: ModelSpec, dtype: str = "auto", kv_dtype: str = "auto", device: str | torch.device = "cpu"
) -> tuple[LlamaModel, str]:
    """The model a node computes with (in `dtype`, K/V in `kv_dtype`; "auto": the checkpoint's
    own) on `device`, and the name its page keys are salted with (pages of two
    models never share a key). A model that cannot be loaded is a `StartupError`."""
    kv = None if kv_dtype == "auto" else kv_dtype
    if isinstance(spec, TinyConfig):
        try:
            config = spec if dtype == "auto" else attrs.evolve(spec, dtype=dtype)
            return TinyModel(config, kv_dtype=kv, device=device), "tiny"
        except ValueError as exc:
            flag = "--kv-cache-dtype" if "kv_dtype" in str(exc) else "--dtype"
            raise StartupError(f"{flag}: not for the tiny model ({exc})") from exc
    from hicache.runtime.model.loader import load_model

    try:
        path = None if spec == "default" else Path(spec)
        loaded = load_model(path, dtype=dtype, kv_dtype=kv_dtype, device=device)
    except (OSError, ValueError) as exc:
        raise StartupError(f"--model {spec}: cannot load it ({exc})") from exc
    config = loaded.model.config
    return loaded.model, f"{config.name or loaded.source.name}:{config.weights[:16]}"


def make_engine(kind: str, name: str, secret: ClusterSecret, host: str = "127.0.0.1") -> TransferEngine:
    """The transfer engine `kind`, listening on the node's `--host` and advertising an address
    peers can dial (`advertised`); `name` gets a random suffix, since peers that still know a
    stopped node's engine refuse to rebind its name to a new address."""
    name = f"{name}-{secrets.token_hex(3)}"
    if kind == "tcp":
        return TcpEngine(host, name=name, secret=secret, advertise=advertised(host))
    if kind == "nixl":
        try:
            from hicache.runtime.transfer.nixl_engine import NixlEngine

            return NixlEngine(name)
        except ImportError as exc:
            raise StartupError(f"--engine nixl: {exc}; --engine tcp needs nothing more") from exc
    raise ValueError(f"unknown transfer engine {kind!r}; expected one of: {', '.join(ENGINES)}")


@attrs.frozen
class PrefillOptions:
    port: int = 0
    host: str = "127.0.0.1"
    engine: str = "tcp"
    page_size: int = 16
    model: ModelSpec = TinyConfig()
    staging_pages: int = 1024
    mmap_threshold: int = DEFAULT_MMAP_THRESHOLD  # 0: leave glibc's adaptive threshold
    limits: Limits = Limits()
    secret_file: Path | None = None  # None: HICACHE_CLUSTER_SECRET, else the default file
    address_file: Path | None = None  # rewritten with HOST:PORT once the node listens
    cache_bytes: int = DEFAULT_CACHE_BYTES  # the prefill cache's L1; 0: none
    cache_host_bytes: int = 0  # its L2 behind L1; 0: none
    storage_dir: Path | None = None  # the decode nodes' L3 folder, read by the prefill cache
    speeds: Speeds = Speeds()  # L3 reads vs computing: first estimates (refined when measuring)
    layer_groups: int = DEFAULT_LAYER_GROUPS  # KV leaves in this many layer groups; 0: after prefill
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # a prompt computes in chunks of at most this
    step_tokens: int = DEFAULT_STEP_TOKENS  # tokens of one step's chunks together
    dtype: str = "auto"  # what the model computes in (--dtype); auto: the checkpoint's
    kv_cache_dtype: str = "auto"  # what K/V is kept in (--kv-cache-dtype); auto: the model's dtype
    device: str = "cpu"  # where the model, its cache's L1 and sampling live (--device)
    base_gpu_id: int = 0  # the GPU of --device cuda (--base-gpu-id)


@attrs.frozen
class DecodeOptions:
    prefill: PrefillAddress | tuple[str, int]
    core: DecodeConfig
    port: int = 0
    host: str = "127.0.0.1"
    engine: str = "tcp"
    model: ModelSpec = TinyConfig()
    storage_dir: Path | None = None  # None: an in-memory L3
    storage_capacity: int = 0  # bytes of L3 pages; 0: unbounded (a file store joins its folder's)
    storage_backend: str = "file"  # with storage_dir: "file", or "nixl" (NIXL's POSIX backend)
    l2_gigabytes: float = 0.0  # > 0: L2 sized to this many GB once a page's bytes are known
    tick_interval: float = 0.002
    prefill_silence_s: float = 60.0  # prefill's silence about a transfer before it is given up
    faults: FaultSpec | None = None  # injected into the node's own operations
    mmap_threshold: int = DEFAULT_MMAP_THRESHOLD  # 0: leave glibc's adaptive threshold
    limits: Limits = Limits()
    secret_file: Path | None = None  # None: HICACHE_CLUSTER_SECRET, else the default file
    api_keys: Path | None = None  # None: an open node (every client an admin naming its tenant)
    # Tensor parallelism (`core.tp_size` ranks): rank 0 starts the others with `tp_argv`.
    tp_rank: int = 0
    tp_store: tuple[str, int] | None = None  # ranks 1..: rank 0's store
    tp_argv: tuple[str, ...] = ()
    collective_timeout: float = 5.0
    command_log: Path | None = None  # a folder: each rank's commands in rank<R>.log
    dtype: str = "auto"  # what the model computes in (--dtype); auto: the checkpoint's
    kv_cache_dtype: str = "auto"  # what K/V is kept in (--kv-cache-dtype); auto: the model's dtype
    # L1 sized from memory once a page's bytes are known (`runtime/kv/l1_sizing.py`); 0: --l1-pages.
    max_total_tokens: int = 0
    mem_fraction_static: float = 0.0
    l2_ratio: float | None = None  # L2 follows a resized L1 at this ratio; None: L2 as configured
    device: str = "cpu"  # where the model, L1 and sampling live (--device); L2 stays on the host
    base_gpu_id: int = 0  # rank r of --device cuda uses GPU base_gpu_id + r (--base-gpu-id)


def node_device(kind: str, base_gpu_id: int, rank: int = 0) -> torch.device:
    """The device a node (rank `rank`) computes on, made the current CUDA device so that
    streams, events and NCCL land on it; a `StartupError` naming the flag when it cannot."""
    try:
        device = resolve_device(kind, base_gpu_id, rank)
    except DeviceError as exc:
        raise StartupError(str(exc)) from None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _secret(path: Path | None) -> ClusterSecret:
    try:
        return ClusterSecret.load(path)
    except (OSError, UntrustedSecret) as exc:
        flag = f"--secret-file {path}" if path is not None else "the cluster secret"
        reason = why(exc) if isinstance(exc, OSError) else str(exc)
        raise StartupError(f"{flag}: cannot use it ({reason}); give {_SECRET_FLAGS}") from exc


def _ready(info: dict) -> None:
    print(json.dumps(info), flush=True)


async def _until_signal(cancel: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            cancel.cancel()
            return


async def run_prefill(opts: PrefillOptions) -> None:
    secret = _secret(opts.secret_file)
    await _check_listen(opts.host, opts.port)  # before the model loads
    device = node_device(opts.device, opts.base_gpu_id)
    engine = make_engine(opts.engine, f"prefill-{opts.engine}-{os.getpid()}", secret, opts.host)
    model, _ = build_model(opts.model, opts.dtype, opts.kv_cache_dtype, device)
    layout = model_layout(model, opts.page_size)
    store = None
    if opts.storage_dir is not None:  # as the decode nodes open it: same files, same keys
        try:
            # Pages sealed with the cluster secret: no key lies on the storage beside them.
            store = FileStore(opts.storage_dir, layout, secret=secret.key, secret_source=secret.source)
        except OSError as exc:
            raise StartupError(f"--storage-dir {opts.storage_dir}: cannot use it ({why(exc)})") from exc
    try:
        async with engine, trio.open_nursery() as nursery:
            node = PrefillNode(
                model,
                layout,
                engine,
                staging_pages=opts.staging_pages,
                cache_bytes=opts.cache_bytes,
                cache_host_bytes=opts.cache_host_bytes,
                store=store,
                speeds=attrs.evolve(opts.speeds),  # the node's running estimate is its own
                limits=opts.limits,
                secret=secret,
                layer_groups=opts.layer_groups,
                chunk_tokens=opts.chunk_tokens,
                step_tokens=opts.step_tokens,
            )
            nursery.start_soon(_until_signal, nursery.cancel_scope)
            try:
                listeners = await nursery.start(functools.partial(node.serve, opts.port, host=opts.host))
            except BaseException as exc:
                err = sole(exc)
                if not isinstance(err, OSError):
                    raise
                raise StartupError(_cannot_listen(opts.host, opts.port, err)) from err
            port = listeners[0].socket.getsockname()[1]
            if opts.address_file is not None:
                try:
                    write(opts.address_file, advertised(opts.host), port)
                except OSError as exc:
                    raise StartupError(
                        f"--address-file {opts.address_file}: cannot write it ({why(exc)})"
                    ) from exc
            _ready({"node": "prefill", "port": port, "engine": engine.name, "device": describe(device)})
    finally:
        if store is not None:
            await store.aclose()


def _cannot_listen(host: str, port: int, exc: OSError) -> str:
    if isinstance(exc, socket.gaierror):  # the address, not the port
        return f"--host {host}: cannot listen on it ({why(exc)})"
    return f"--port {port}: cannot listen on {host}:{port} ({why(exc)})"


async def _check_listen(host: str, port: int) -> None:
    """Bind the decode node's port once before connecting anywhere, so that a port in use is
    told apart from an unreachable prefill node (both are OSErrors out of the service's start)."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise StartupError(_cannot_listen(host, port, exc)) from exc
    for listener in listeners:
        await listener.aclose()


def _decode_start_failure(exc: BaseException, opts: DecodeOptions) -> str | None:
    """The one line for an error out of the decode service's start-up; None: not a start-up error."""
    where = _prefill_flag(opts.prefill)
    if isinstance(exc, OSError):
        if exc.errno in _BIND_ERRNOS:  # the port was taken after `_check_listen`
            return _cannot_listen(opts.host, opts.port, exc)
        return f"{where}: cannot reach the prefill node ({why(exc)})"
    if isinstance(exc, AuthError):
        return f"{where}: {exc}; both nodes need the same cluster secret ({_SECRET_FLAGS})"
    if isinstance(exc, _HELLO_ERRORS):
        return (
            f"{where}: the prefill node refused the connection's hello "
            f"({exc or type(exc).__name__}); both nodes need the same --engine and --page-size"
        )
    return None


def _prefill_flag(prefill: PrefillAddress | tuple[str, int]) -> str:
    if isinstance(prefill, tuple):
        return f"--prefill {prefill[0]}:{prefill[1]}"
    if prefill.file is not None:
        return f"--prefill-file {prefill.file}"
    return f"--prefill {prefill}"


def _tp_group(opts: DecodeOptions, model: LlamaModel) -> TPGroup | None:
    """This rank's TP group (rank 0 starts the others); None for a single-rank node. One GPU
    per rank: collectives on NCCL there, gloo on the CPU (`TPGroup`)."""
    size, rank = opts.core.tp_size, opts.tp_rank
    if size == 1:
        return None
    why = check_split(model.config, size)
    if why is not None:
        raise StartupError(why)
    if opts.faults is not None and opts.faults.active:
        raise StartupError(f"--faults: fault injection is not supported with --tp-size {size}")
    timeout = opts.collective_timeout
    try:
        if rank == 0:
            return TPGroup.lead(size, opts.host, timeout, opts.tp_argv, str(model.device))
        assert opts.tp_store is not None
        return TPGroup.join(rank, size, opts.tp_store, timeout, str(model.device))
    except (RuntimeError, OSError) as exc:
        raise StartupError(f"--tp-size {size}: cannot form the group's store ({exc})") from exc


def _api_keys(path: Path | None) -> ApiKeys | None:
    try:
        return ApiKeys.load(path) if path is not None else None
    except ApiKeyError as exc:
        raise StartupError(f"--api-keys {exc}") from exc


async def run_decode(opts: DecodeOptions) -> None:
    # The files and the port first: a bad one is one line before the model loads, not after.
    _secret(opts.secret_file)
    _api_keys(opts.api_keys)
    if opts.tp_rank == 0:
        await _check_listen(opts.host, opts.port)
    device = node_device(opts.device, opts.base_gpu_id, opts.tp_rank)
    model, model_name = build_model(opts.model, opts.dtype, opts.kv_cache_dtype, device)
    group = _tp_group(opts, model)
    try:
        await _run_decode(opts, model, model_name, group)
    finally:
        if group is not None:
            group.stop_children()


async def _run_decode(opts: DecodeOptions, model: LlamaModel, model_name: str, group: TPGroup | None) -> None:
    rank = 0 if group is None else group.rank
    if group is not None:
        model = shard_model(model, rank, group.size, group.all_reduce_sum)
    layout = model_layout(model, opts.core.page_size)
    core = _sized_l1(opts, layout, model.device)
    if opts.l2_gigabytes > 0:  # --hicache-size: GB of host memory, in this model's pages
        l2 = l2_pages(
            core.l1_pages, core.page_size, l2_bytes=opts.l2_gigabytes * 1e9, page_bytes=layout.page_bytes
        )
        core = attrs.evolve(core, l2_pages=l2)
    capacity, tp_size = opts.storage_capacity, opts.core.tp_size
    secret = _secret(opts.secret_file)  # also seals the L3 pages: no key lies beside them
    files = FileStore
    if opts.storage_backend == "nixl":
        try:
            from hicache.runtime.storage.nixl_store import NixlFileStore
        except ImportError as exc:
            raise StartupError(f"--hicache-storage-backend nixl: {exc}") from exc
        files = NixlFileStore
    try:
        store = (  # with TP ranks, each rank its own shard (`FileStore`'s rank and tp_size)
            files(
                opts.storage_dir,
                layout,
                secret=secret.key,
                secret_source=secret.source,
                capacity_bytes=capacity or None,
                rank=rank,
                tp_size=tp_size,
            )
            if opts.storage_dir is not None
            else MemoryStore(layout, capacity_pages=max(1, capacity // layout.page_bytes) if capacity else 0)
        )
    except OSError as exc:  # not a folder, not writable
        raise StartupError(f"--storage-dir {opts.storage_dir}: cannot use it ({why(exc)})") from exc
    except (ImportError, RuntimeError) as exc:  # NIXL missing, or its POSIX backend refused
        raise StartupError(f"--hicache-storage-backend {opts.storage_backend}: {exc}") from exc
    if opts.faults is not None:
        FaultyStore.check(opts.faults, store)  # before anything starts: a bad spec exits with its reason
    keys = _api_keys(opts.api_keys)  # checked before the model loaded (`run_decode`); read here
    # A restarted decode node must not reuse its predecessor's agent name: peers still know it.
    engine = make_engine(opts.engine, f"decode-{opts.engine}-{os.getpid()}", secret, opts.host)
    log_file = None
    if opts.command_log is not None:
        opts.command_log.mkdir(parents=True, exist_ok=True)
        log_file = (opts.command_log / f"rank{rank}.log").open("w")
    async with engine, trio.open_nursery() as nursery:
        service = DecodeService(
            core,
            model,
            layout,
            store,
            engine,
            model_name=model_name,
            tick_interval=opts.tick_interval,
            transfer_timeout=opts.prefill_silence_s,
            faults=opts.faults,
            limits=opts.limits,
            secret=secret,
            api_keys=keys,
            tp=group,
            command_log=log_file,
            device=str(model.device),
        )
        nursery.start_soon(_until_signal, nursery.cancel_scope)
        start = functools.partial(service.run, opts.port, opts.prefill, host=opts.host)
        try:
            port = await nursery.start(start)
        except BaseException as exc:
            if isinstance(sole(exc), TPFailure):
                raise StartupError(str(sole(exc))) from exc
            line = _decode_start_failure(sole(exc), opts)
            if line is None:
                raise
            raise StartupError(line) from exc
        info = {"node": "decode", "port": port, "engine": engine.name, "device": describe(model.device)}
        if group is not None:
            info.update(tp_size=group.size, tp_rank=rank, tp_pids=[c.pid for c in group.children])
        if isinstance(store, FileStore):
            info["leftovers_removed"] = store.leftovers_removed
        _ready(info)
        if keys is None:
            logging.getLogger("hicache.runtime.decode").warning(
                "no --api-keys: every client may name its tenant and run admin operations"
            )


def _sized_l1(opts: DecodeOptions, layout: KVLayout, device: torch.device) -> DecodeConfig:
    """The core's config with L1 sized from memory (`--max-total-tokens`, `--mem-fraction-static`:
    the GPU's when L1 is on one, else the host's) when either is given, and L2 following it at
    `l2_ratio`."""
    core = opts.core
    try:
        pages = l1_pages_for(
            page_size=core.page_size,
            page_bytes=layout.page_bytes,
            max_total_tokens=opts.max_total_tokens,
            mem_fraction_static=opts.mem_fraction_static,
            memory=device_memory(device) if opts.mem_fraction_static > 0 else None,
        )
    except SizingError as exc:
        raise StartupError(str(exc)) from None
    if pages is None:
        return core
    l2 = core.l2_pages
    if opts.l2_ratio is not None:
        l2 = l2_pages(pages, core.page_size, hicache_ratio=opts.l2_ratio)
    return attrs.evolve(core, l1_pages=pages, l2_pages=l2)


def main_prefill(opts: PrefillOptions) -> int:
    pin_mmap_threshold(opts.mmap_threshold)
    with _startup_error_unwrapped():
        trio.run(run_prefill, opts)
    return 0


def main_decode(opts: DecodeOptions) -> int:
    pin_mmap_threshold(opts.mmap_threshold)
    with _startup_error_unwrapped():
        trio.run(run_decode, opts)
    sys.stdout.flush()
    if opts.core.tp_size > 1:  # a collective's worker thread may still sit in gloo: do not join it
        sys.stderr.flush()
        os._exit(0)
    return 0

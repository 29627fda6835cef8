"""`hicache serve`: a prefill node, a decode node and the HTTP front door, ready for real clients.

By default the two nodes are started here as processes on loopback (each loads the model), and
the front door runs in this process with the model's tokenizer and chat template. `--decode
HOST:PORT` attaches the front door to a decode node already running elsewhere (and starts
nothing); `--prefill HOST:PORT` starts only a decode node, attached to that prefill node.

The decode node started here gets an API-key file holding one admin key, which only this front
door knows: clients reach the node through the front door, which authenticates them itself
(`--api-keys`) and passes each client's tenant on. One JSON line on stdout says the front door is
ready: `{"url": "http://HOST:PORT", "model": ..., "decode": ..., "prefill": ..., "pids": ...}`.

Before any node loads the model, the flags and files are checked (`serve_checks.py`). A request
may hold the model's context (`--context-length` overrides it), capped by what the decode
nodes' L1 holds. At most as many requests as the decode nodes can hold run at once, and
`--max-queued-requests` more wait here; the next one is a 503 with Retry-After
(`serving/admission.py`). Every node started here is watched (`supervisor.py`): one that exits is
logged with its status and stderr, /health answers 503 at once, and it is restarted (at most
`--node-restarts` times in 10 minutes; past that serve stops the others and exits 1).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import signal
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from hicache.core.router import Router
from hicache.runtime.launch import NodeFailed, NodeProcess, start_node
from hicache.runtime.model.chat_template import template_features
from hicache.runtime.model.tokenizer import ChatTokenizer
from hicache.runtime.security.api_keys import ApiKeys
from hicache.runtime.serve_checks import ServeError
from hicache.runtime.serving.admission import Admission
from hicache.runtime.serving.app import create_app
from hicache.runtime.serving.backend import ModelInfo
from hicache.runtime.serving.door import DoorLimits
from hicache.runtime.serving.health import Health
from hicache.runtime.serving.node_backend import NodeBackend
from hicache.runtime.serving.routed_backend import RoutedBackend
from hicache.runtime.serving.server import serve_http
from hicache.runtime.serving.token_rate import TokenRate
from hicache.runtime.serving.trace_recorder import RecordingError, TraceRecorder, config_header
from hicache.runtime.supervisor import Supervisor, check_attached, tcp_probe
from hicache.runtime.wire import protocol
from hicache.runtime.wire.client import DecodeClient

log = logging.getLogger("hicache.runtime.serve")
GRACE_S = 3.0  # after SIGTERM: for the responses in flight to say so and be sent

# How many times a decode node started here retries a transfer: enough, with the backoff capped
# at 5 s (--transfer-backoff-max), to ride out a prefill node restarted here (its model loads
# again: 7-12 s on a loaded 2-core machine) without losing the requests in flight.
SUPERVISED_TRANSFER_RETRIES = 12


@attrs.frozen
class ServeOptions:
    model: str = "default"  # "default", a GGUF file or a Hugging Face folder
    dtype: str = "auto"  # both nodes' --dtype
    kv_cache_dtype: str = "auto"  # both nodes' --kv-cache-dtype (they must agree)
    device: str = "cpu"  # both nodes' --device
    base_gpu_id: int = 0  # both nodes' --base-gpu-id (a decode node's rank r: that GPU + r)
    chunked_prefill_size: int = 512  # the prefill nodes started here: tokens of a prompt per step
    max_prefill_tokens: int = 1024  # ... and tokens of all of one step's chunks
    host: str = "127.0.0.1"
    port: int = 0
    engine: str = "tcp"
    page_size: int = 16
    decode: tuple[tuple[str, int], ...] = ()  # attach to these decode nodes, start nothing
    prefill: tuple[tuple[str, int], ...] = ()  # start decode nodes attached to these prefill nodes
    prefill_nodes: int = 1  # prefill processes to start (without `prefill`)
    decode_nodes: int = 1  # decode processes to start; decode node i uses prefill node i mod P
    router: str = "cache_aware"  # which decode node serves a request (`hicache.core.router`)
    decode_api_key: str | None = None  # the key the front door uses at an attached decode node
    api_keys: Path | None = None  # the front door's clients
    max_tokens: int = 32768
    context_length: int | None = None  # SGLang's --context-length; None: the model's own
    max_queued_requests: int | None = None  # the front door's queue; None: as many as run at once
    queue_timeout_s: float | None = 60.0  # a request queued this long gets a 503; None: no limit
    max_connections: int = 1024  # requests open at the front door at once (door.py)
    max_body_bytes_in_flight: int = 64 << 20  # bytes of request bodies held at once
    body_timeout_s: float = 30.0  # a body must arrive whole within this of its headers
    max_requests_per_tenant: int | None = None  # None: as many as run at once + half the queue
    max_tokens_per_minute_per_tenant: int | None = None  # None: no token rate limit
    stream_stall_timeout_s: float | None = 30.0  # a stream its client does not read is aborted
    node_restarts: int = 3  # restarts of one node within `restart_window_s`; 0: a death ends serve
    restart_window_s: float = 600.0
    health_check_interval_s: float = 5.0  # how often attached nodes are checked
    log_dir: Path | None = None
    log_level: str = "info"
    extra_decode_args: tuple[str, ...] = ()  # passed on to the decode node started here
    record_trace: Path | None = None  # record the requests served into this new file from the start
    record_trace_dir: Path | None = None  # where /start_trace_recording may write (default: its folder)
    record_block_size: int | None = None  # tokens per hash id in a recorded trace (None: the page size)
    shared_open_cache: bool = False  # without --api-keys: every caller in one cache namespace
    special_tokens_in_content: bool = False  # special tokens typed in chat messages stay special
    served_model_names: tuple[str, ...] = ()  # names clients may call the model by; the first is shown


class Codec:
    """The model's tokenizer as the front door's `TextCodec`."""

    def __init__(self, tokenizer: ChatTokenizer, *, special_tokens_in_content: bool = False) -> None:
        self.tokenizer = tokenizer
        self.special_tokens_in_content = special_tokens_in_content

    @property
    def max_token_chars(self) -> int | None:
        return self.tokenizer.max_token_chars

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    @property
    def chat_features(self) -> frozenset[str]:
        template = self.tokenizer.chat_template
        return template_features(template) if template else frozenset()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        return self.tokenizer.encode_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens_in_content=self.special_tokens_in_content,
            tools=tools,
        )


@attrs.frozen
class ModelSource:
    """What the front door reads of a model without its weights: the tokenizer and chat
    template, the name users call it by, and the context it was trained for (None if unsaid)."""

    tokenizer: ChatTokenizer
    name: str
    context_length: int | None


def load_model_source(model: str) -> ModelSource:
    """The tokenizer and context length of `model`: `max_position_embeddings` of a Hugging Face
    folder's config.json, or `<arch>.context_length` of a GGUF file (8192 for the default)."""
    from hicache.runtime.model.model_file import default_model_path

    path = default_model_path() if model == "default" else Path(model)
    if path.is_dir():
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        return ModelSource(
            ChatTokenizer.from_dir(path), path.name, _positive(config.get("max_position_embeddings"))
        )
    import gguf

    from hicache.runtime.model.model_file import read_metadata

    meta = read_metadata(gguf.GGUFReader(path))
    arch = meta.get("general.architecture")
    # The file's name without its quantisation ("SmolLM2-135M-Instruct.Q4_1.gguf"): what users
    # call the model, unlike GGUF's free-text general.name.
    return ModelSource(
        ChatTokenizer.from_gguf_metadata(meta, source=str(path)),
        path.name.split(".")[0],
        _positive(meta.get(f"{arch}.context_length")),
    )


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def load_tokenizer(model: str) -> tuple[ChatTokenizer, str]:
    """The tokenizer (and chat template) of `model`, read without loading its weights."""
    source = load_model_source(model)
    return source.tokenizer, source.name


def context_limit(opts: ServeOptions, model_context: int | None) -> int:
    """Tokens of one request, prompt and output: `--context-length` if given, else the model's
    own, and never over `--max-tokens` (the pools' cap is applied once the nodes say theirs)."""
    if opts.context_length is not None:
        if model_context is not None and opts.context_length > model_context:
            log.warning(
                "--context-length %d is over the %d tokens the model was trained for; past them its "
                "output degrades",
                opts.context_length,
                model_context,
            )
        limit = opts.context_length
    else:
        limit = model_context or opts.max_tokens
    return min(limit, opts.max_tokens)


def prefill_args(opts: ServeOptions, address: Path) -> list[str]:
    """The command line of a prefill node started here, which writes its address to `address`."""
    args = ["prefill", *_node_args(opts), "--address-file", str(address)]
    args += ["--chunked-prefill-size", str(opts.chunked_prefill_size)]
    return [*args, "--max-prefill-tokens", str(opts.max_prefill_tokens)]


def _node_args(opts: ServeOptions) -> list[str]:
    args = ["--engine", opts.engine, "--page-size", str(opts.page_size), "--model", opts.model]
    args += ["--dtype", opts.dtype, "--kv-cache-dtype", opts.kv_cache_dtype]
    args += ["--device", opts.device, "--base-gpu-id", str(opts.base_gpu_id)]
    # The nodes share this machine's cores: a thread of one waiting on a core another keeps busy
    # would stall every step of its model at the next barrier.
    started = (0 if opts.prefill else opts.prefill_nodes) + opts.decode_nodes
    threads = max(1, (os.cpu_count() or 2) // max(1, started))
    return [*args, "--log-level", opts.log_level, "--threads", str(threads)]


async def serve(
    opts: ServeOptions,
    stopping: trio.Event | None = None,
    *,
    task_status: trio.TaskStatus[dict] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start what `opts` asks for and serve until cancelled, or until `stopping` is set: then
    the requests in flight are answered as aborted (streams with an error event) and it
    returns; reports the ready line's dict. Raises `NodeDied` when a node started here exits
    past its restarts."""
    try:
        source = load_model_source(opts.model)
    except (OSError, ValueError) as exc:
        raise ServeError(f"--model {opts.model}: cannot read its tokenizer ({exc})") from exc
    keys = ApiKeys.load(opts.api_keys) if opts.api_keys is not None else None
    context = context_limit(opts, source.context_length)
    tokenizer, name = source.tokenizer, source.name
    health = Health()
    with tempfile.TemporaryDirectory(prefix="hicache-serve-") as tmp:
        work = Path(tmp)
        logs = opts.log_dir or work / "logs"
        supervisor = Supervisor(logs, health, max_restarts=opts.node_restarts, window_s=opts.restart_window_s)
        recorder: TraceRecorder | None = None
        try:
            decode_at, admin_key, prefill_at = await _start_nodes(opts, work, logs, supervisor, context)
            each = [NodeBackend(h, p, None, api_key=admin_key) for h, p in decode_at]  # type: ignore[arg-type]
            limit, running, pool, reserve, page = context, 0, 0, 0, opts.page_size
            for node in each:
                try:
                    stats = await node.stats()
                except (OSError, protocol.ProtocolError) as exc:
                    raise ServeError(f"the decode node at {node.host}:{node.port}: {exc}") from exc
                # A request the node can never hold is the client's error (400), not the node's.
                limit = min(limit, int(stats.get("max_prompt_tokens", limit)))
                running += max(1, int(stats.get("max_running_requests", 1)))
                pool += int(stats.get("max_total_tokens", 0))  # 0 (a node that does not say): not counted
                reserve = max(reserve, int(stats.get("decode_reserve_tokens", 0)))
                if int(stats.get("l1_pages", 0)) > 0:  # a node's own page size, attached or started
                    page = int(stats.get("max_total_tokens", 0)) // int(stats["l1_pages"]) or page
            info = ModelInfo(
                name=name,
                max_context_tokens=limit,
                eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
                vocab_size=tokenizer.vocab_size,
            )
            for node in each:
                node.info = info
            started = [n for n in supervisor.nodes if n.args[0] == "decode"]  # none with --decode
            for watched, node in zip(started, each if started else [], strict=True):
                watched.on_restart = functools.partial(_moved, node)
            backend: NodeBackend | RoutedBackend = each[0]
            if len(each) > 1:
                backend = RoutedBackend(each, Router(opts.router, len(each)))
            queued = running if opts.max_queued_requests is None else opts.max_queued_requests
            admission = Admission(
                running, queued, max_tokens=pool, reserve_tokens=reserve, queue_timeout_s=opts.queue_timeout_s
            )
            # One caller may fill the running slots but only half the queue: the rest stays for others.
            per_tenant = opts.max_requests_per_tenant or running + max(1, queued // 2)
            limits = DoorLimits(
                body_timeout_s=opts.body_timeout_s,
                body_bytes_in_flight=opts.max_body_bytes_in_flight,
                max_connections=opts.max_connections,
                max_requests_per_tenant=per_tenant,
            )
            tpm = opts.max_tokens_per_minute_per_tenant
            recorder = await _recorder(opts, name, decode_at, admin_key, len(prefill_at) or None, admission)
            codec = Codec(tokenizer, special_tokens_in_content=opts.special_tokens_in_content)
            served = opts.served_model_names or (name,)
            app = create_app(
                backend,
                codec,
                model_name=served[0],
                aliases=served[1:],
                page_size=page,
                api_keys=keys,
                recorder=recorder,
                admission=admission,
                health=health,
                shared_open_cache=opts.shared_open_cache,
                limits=limits,
                stream_stall_timeout_s=opts.stream_stall_timeout_s,
                rate=None if tpm is None else TokenRate(tpm),
            )
            if keys is None:
                log.warning(
                    "no --api-keys: any client that reaches %s:%s may generate, flush the cache and "
                    "record traces; %s",
                    opts.host,
                    opts.port,
                    "all callers share one cache namespace (--shared-open-cache)"
                    if opts.shared_open_cache
                    else "each caller's cache is its own (by bearer token, else address)",
                )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(supervisor.run)
                _check_attached(opts, nursery, health, each, prefill_at)
                trigger = None if stopping is None else stopping.wait

                async def http(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
                    await serve_http(
                        app,
                        opts.host,
                        opts.port,
                        shutdown_trigger=trigger,
                        graceful_timeout_s=GRACE_S,
                        unread_timeout_s=opts.stream_stall_timeout_s,
                        task_status=task_status,
                    )
                    nursery.cancel_scope.cancel()  # stopped (`stopping`): the supervisor and checks too

                port = await nursery.start(http)
                host = f"[{opts.host}]" if ":" in opts.host else opts.host
                log.info(
                    "serving %s: context %d tokens; %d requests and %d tokens at once, %d queued "
                    "before a 503",
                    name,
                    limit,
                    running,
                    pool,
                    queued,
                )
                ready = {
                    "url": f"http://{host}:{port}",
                    "model": name,
                    "decode": ",".join(f"{h}:{p}" for h, p in decode_at),
                    "prefill": ",".join(f"{h}:{p}" for h, p in prefill_at) or None,
                    "router": opts.router if len(each) > 1 else None,
                    "context_length": limit,
                    "max_running_requests": running,
                    "max_queued_requests": queued,
                    "max_requests_per_tenant": per_tenant,
                    "pids": {n.name: n.process.pid for n in supervisor.nodes},  # the nodes started here
                }
                task_status.started(ready)
        finally:
            if recorder is not None:
                recorder.stop()
            supervisor.stop_all()


def _moved(backend: NodeBackend, process: NodeProcess) -> None:
    backend.moved("127.0.0.1", process.port)


def _check_attached(
    opts: ServeOptions,
    nursery: trio.Nursery,
    health: Health,
    each: list[NodeBackend],
    prefill_at: list[tuple[str, int]],
) -> None:
    """Health checks of the nodes this front door did not start (`--decode`, `--prefill`)."""
    every = opts.health_check_interval_s
    if opts.decode:
        for node in each:
            name = f"decode node at {node.host}:{node.port}"
            nursery.start_soon(check_attached, name, health, node.stats, every)
    if opts.prefill:
        for host, port in prefill_at:
            probe = functools.partial(tcp_probe, host, port)
            nursery.start_soon(check_attached, f"prefill node at {host}:{port}", health, probe, every)


async def _recorder(
    opts: ServeOptions,
    name: str,
    decode_at: list[tuple[str, int]],
    key: str | None,
    prefill: int | None,
    admission: Admission,
) -> TraceRecorder | None:
    """The trace recorder `--record-trace`/`--record-trace-dir` ask for, its header holding what
    each decode node says it runs with and the front door's admission; recording from the start
    with `--record-trace`."""
    if opts.record_trace is None and opts.record_trace_dir is None:
        return None
    configs = [await _node_config(host, port, key) for host, port in decode_at]
    router = opts.router if len(decode_at) > 1 else None
    prefill_cache = None  # prefill nodes started elsewhere: their cache is theirs to say
    if not opts.decode and not opts.prefill:  # started here, with the prefill cache's default
        from hicache.runtime.prefill.prefill_cache import DEFAULT_CACHE_BYTES  # torch: only when recording

        prefill_cache = DEFAULT_CACHE_BYTES
    header = config_header(configs, prefill_nodes=prefill, router=router, prefill_cache_bytes=prefill_cache)
    header["front_door"] = {
        "max_running": admission.max_running,
        "max_tokens": admission.slots.max_tokens,
        "reserve_tokens": admission.reserve_tokens,
    }
    allowed = opts.record_trace_dir or (opts.record_trace.parent if opts.record_trace else None)
    if opts.record_trace_dir is not None:
        try:
            opts.record_trace_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ServeError(f"--record-trace-dir {opts.record_trace_dir}: {exc.strerror or exc}") from exc
    page = header.get("page_size")
    recorder = TraceRecorder(
        name,
        directory=allowed,
        header=header,
        block_size=opts.record_block_size,
        page_size=page if isinstance(page, int) and page > 0 else None,
    )
    if opts.record_trace is not None:
        try:
            recorder.start(opts.record_trace)
        except RecordingError as exc:
            raise ServeError(f"--record-trace: {exc}") from exc
    return recorder


async def _node_config(host: str, port: int, key: str | None) -> dict | None:
    """A decode node's answer to `config`; None (logged) from one that gives none."""
    try:
        client = await DecodeClient.connect(host, port, api_key=key)
        try:
            return await client.config()
        finally:
            await client.aclose()
    except (OSError, protocol.ProtocolError) as exc:
        log.warning(
            "the decode node at %s:%d did not give its configuration for the trace: %s", host, port, exc
        )
        return None


async def _start_nodes(
    opts: ServeOptions, work: Path, logs: Path, supervisor: Supervisor, context: int
) -> tuple[list[tuple[str, int]], str | None, list[tuple[str, int]]]:
    """(the decode nodes' addresses, the admin key to use there, the prefill nodes' addresses).
    Each node started here is handed to `supervisor` as soon as it is ready. A prefill node
    started here writes its address to a file its decode nodes read at every reconnection
    (`--prefill-file`), so that when it is restarted on another port, they find it."""
    if opts.decode:
        return list(opts.decode), opts.decode_api_key, []
    prefill_at = list(opts.prefill)
    where = [f"{host}:{port}" for host, port in prefill_at]  # each decode node's --prefill or --prefill-file
    for i in range(0 if opts.prefill else opts.prefill_nodes):
        name = "prefill" if opts.prefill_nodes == 1 else f"prefill{i}"
        address = work / f"{name}.address"
        args = prefill_args(opts, address)
        try:
            prefill = await start_node(args, logs, name)
        except NodeFailed as exc:
            raise ServeError(f"the {name} node did not start: {exc.reason}") from exc
        supervisor.add(name, args, prefill)
        prefill_at.append(("127.0.0.1", prefill.port))
        where.append(f"@{address}")
    admin_key = secrets.token_urlsafe(32)
    keys = work / "decode-keys.toml"
    keys.write_text(f'[[key]]\nkey = "{admin_key}"\nadmin = true\n')
    keys.chmod(0o600)
    decode_at = []
    for i in range(opts.decode_nodes):
        name = "decode" if opts.decode_nodes == 1 else f"decode{i}"
        prefill = where[i % len(where)]
        link = ["--prefill-file", prefill[1:]] if prefill.startswith("@") else ["--prefill", prefill]
        args = ["decode", *_node_args(opts), *link]
        args += ["--api-keys", str(keys), "--max-tokens", str(context)]
        args += ["--transfer-retries", str(SUPERVISED_TRANSFER_RETRIES)]
        args += list(
            opts.extra_decode_args
        )  # the cache, storage and transfer flags (`cache_flags`); last wins
        try:
            decode = await start_node(args, logs, name)
        except NodeFailed as exc:
            raise ServeError(f"the {name} node did not start: {exc.reason}") from exc
        supervisor.add(name, args, decode)
        decode_at.append(("127.0.0.1", decode.port))
    return decode_at, admin_key, prefill_at


def main(opts: ServeOptions) -> int:
    """Run until SIGINT/SIGTERM; print the ready line once the front door listens."""

    async def run() -> None:
        stopping, stopped = trio.Event(), trio.Event()

        async def serving(task_status: trio.TaskStatus[dict]) -> None:
            try:
                await serve(opts, stopping, task_status=task_status)
            finally:
                stopped.set()

        async with trio.open_nursery() as nursery:
            ready = await nursery.start(serving)
            print(json.dumps(ready), flush=True)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    # Requests in flight are told the server is stopping before it stops.
                    stopping.set()
                    with trio.move_on_after(GRACE_S + 2.0):
                        await stopped.wait()
                    nursery.cancel_scope.cancel()
                    break

    trio.run(run)
    return 0

"""`hicache serve`: a prefill node, a decode node and the HTTP front door, ready for real clients.

By default the two nodes are started here as processes on loopback (each loads the model), and
the front door runs in this process with the model's tokenizer and chat template. `--decode
HOST:PORT` attaches the front door to a decode node already running elsewhere (and starts
nothing); `--prefill HOST:PORT` starts only a decode node, attached to that prefill node.

The decode node started here gets an API-key file holding one admin key, which only this front
door knows: clients reach the node through the front door, which authenticates them itself
(`--api-keys`) and passes each client's tenant on. One JSON line on stdout says the front door is
ready: `{"url": "http://HOST:PORT", "model": ..., "decode": ..., "prefill": ...}`.
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

import attrs
import trio

from hicache.core.router import Router
from hicache.runtime.launch import NodeFailed, NodeProcess, start_node
from hicache.runtime.model.tokenizer import ChatTokenizer
from hicache.runtime.security.api_keys import ApiKeys
from hicache.runtime.serving.app import create_app
from hicache.runtime.serving.backend import ModelInfo
from hicache.runtime.serving.node_backend import NodeBackend
from hicache.runtime.serving.routed_backend import RoutedBackend
from hicache.runtime.serving.server import serve_http
from hicache.runtime.serving.trace_recorder import RecordingError, TraceRecorder, config_header
from hicache.runtime.wire import protocol
from hicache.runtime.wire.client import DecodeClient

log = logging.getLogger("hicache.runtime.serve")
GRACE_S = 3.0  # after SIGTERM: for the responses in flight to say so and be sent


class ServeError(Exception):
    """`hicache serve` could not start; one line naming the flag and the reason."""


@attrs.frozen
class ServeOptions:
    model: str = "default"  # "default", a GGUF file or a Hugging Face folder
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
    log_dir: Path | None = None
    log_level: str = "info"
    extra_decode_args: tuple[str, ...] = ()  # passed on to the decode node started here
    record_trace: Path | None = None  # record the requests served into this new file from the start
    record_trace_dir: Path | None = None  # where /start_trace_recording may write (default: its folder)
    record_block_size: int = 512  # tokens per hash id in a recorded trace (Mooncake's 512)
    shared_open_cache: bool = False  # without --api-keys: every caller in one cache namespace
    special_tokens_in_content: bool = False  # special tokens typed in chat messages stay special


class Codec:
    """The model's tokenizer as the front door's `TextCodec`."""

    def __init__(self, tokenizer: ChatTokenizer, *, special_tokens_in_content: bool = False) -> None:
        self.tokenizer = tokenizer
        self.special_tokens_in_content = special_tokens_in_content

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.tokenizer.encode_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens_in_content=self.special_tokens_in_content,
        )


def load_tokenizer(model: str) -> tuple[ChatTokenizer, str]:
    """The tokenizer (and chat template) of `model`, read without loading its weights."""
    from hicache.runtime.model.loader import default_model_path

    path = default_model_path() if model == "default" else Path(model)
    if path.is_dir():
        return ChatTokenizer.from_dir(path), path.name
    import gguf

    from hicache.runtime.model.gguf_file import read_metadata

    meta = read_metadata(gguf.GGUFReader(path))
    # The file's name without its quantisation ("SmolLM2-135M-Instruct.Q4_1.gguf"): what users
    # call the model, unlike GGUF's free-text general.name.
    return ChatTokenizer.from_gguf_metadata(meta, source=str(path)), path.name.split(".")[0]


def _node_args(opts: ServeOptions) -> list[str]:
    args = ["--engine", opts.engine, "--page-size", str(opts.page_size), "--model", opts.model]
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
    returns; reports the ready line's dict."""
    try:
        tokenizer, name = load_tokenizer(opts.model)
    except (OSError, ValueError) as exc:
        raise ServeError(f"--model {opts.model}: cannot read its tokenizer ({exc})") from exc
    keys = ApiKeys.load(opts.api_keys) if opts.api_keys is not None else None
    nodes: list[NodeProcess] = []
    with tempfile.TemporaryDirectory(prefix="hicache-serve-") as tmp:
        work = Path(tmp)
        logs = opts.log_dir or work / "logs"
        recorder: TraceRecorder | None = None
        try:
            decode_at, admin_key, prefill_at = await _start_nodes(opts, work, logs, nodes)
            each = [NodeBackend(h, p, None, api_key=admin_key) for h, p in decode_at]  # type: ignore[arg-type]
            limit = opts.max_tokens
            for node in each:
                try:
                    stats = await node.stats()
                except (OSError, protocol.ProtocolError) as exc:
                    raise ServeError(f"the decode node at {node.host}:{node.port}: {exc}") from exc
                # A request the node can never hold is the client's error (400), not the node's.
                limit = min(limit, int(stats.get("max_prompt_tokens", opts.max_tokens)))
            info = ModelInfo(
                name=name,
                max_context_tokens=limit,
                eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
                vocab_size=tokenizer.vocab_size,
            )
            for node in each:
                node.info = info
            backend: NodeBackend | RoutedBackend = each[0]
            if len(each) > 1:
                backend = RoutedBackend(each, Router(opts.router, len(each)))
            recorder = await _recorder(opts, name, decode_at, admin_key, len(prefill_at) or None)
            codec = Codec(tokenizer, special_tokens_in_content=opts.special_tokens_in_content)
            app = create_app(
                backend,
                codec,
                model_name=name,
                api_keys=keys,
                recorder=recorder,
                shared_open_cache=opts.shared_open_cache,
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
                trigger = None if stopping is None else stopping.wait
                port = await nursery.start(
                    functools.partial(serve_http, shutdown_trigger=trigger, graceful_timeout_s=GRACE_S),
                    app,
                    opts.host,
                    opts.port,
                )
                host = f"[{opts.host}]" if ":" in opts.host else opts.host
                ready = {
                    "url": f"http://{host}:{port}",
                    "model": name,
                    "decode": ",".join(f"{h}:{p}" for h, p in decode_at),
                    "prefill": ",".join(f"{h}:{p}" for h, p in prefill_at) or None,
                    "router": opts.router if len(each) > 1 else None,
                }
                task_status.started(ready)
        finally:
            if recorder is not None:
                recorder.stop()
            for node in reversed(nodes):
                node.stop()


async def _recorder(
    opts: ServeOptions, name: str, decode_at: list[tuple[str, int]], key: str | None, prefill: int | None
) -> TraceRecorder | None:
    """The trace recorder `--record-trace`/`--record-trace-dir` ask for, its header holding what
    each decode node says it runs with; recording from the start with `--record-trace`."""
    if opts.record_trace is None and opts.record_trace_dir is None:
        return None
    configs = [await _node_config(host, port, key) for host, port in decode_at]
    router = opts.router if len(decode_at) > 1 else None
    prefill_cache = None  # prefill nodes started elsewhere: their cache is theirs to say
    if not opts.decode and not opts.prefill:  # started here, with the prefill cache's default
        from hicache.runtime.prefill.prefill_cache import DEFAULT_CACHE_BYTES  # torch: only when recording

        prefill_cache = DEFAULT_CACHE_BYTES
    header = config_header(configs, prefill_nodes=prefill, router=router, prefill_cache_bytes=prefill_cache)
    allowed = opts.record_trace_dir or (opts.record_trace.parent if opts.record_trace else None)
    if opts.record_trace_dir is not None:
        try:
            opts.record_trace_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ServeError(f"--record-trace-dir {opts.record_trace_dir}: {exc.strerror or exc}") from exc
    recorder = TraceRecorder(name, directory=allowed, header=header, block_size=opts.record_block_size)
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
    opts: ServeOptions, work: Path, logs: Path, nodes: list[NodeProcess]
) -> tuple[list[tuple[str, int]], str | None, list[tuple[str, int]]]:
    """(the decode nodes' addresses, the admin key to use there, the prefill nodes' addresses)."""
    if opts.decode:
        return list(opts.decode), opts.decode_api_key, []
    prefill_at = list(opts.prefill)
    for i in range(0 if opts.prefill else opts.prefill_nodes):
        name = "prefill" if opts.prefill_nodes == 1 else f"prefill{i}"
        try:
            prefill = await start_node(["prefill", *_node_args(opts)], logs, name)
        except NodeFailed as exc:
            raise ServeError(f"the {name} node did not start: {exc.reason}") from exc
        nodes.append(prefill)
        prefill_at.append(("127.0.0.1", prefill.port))
    admin_key = secrets.token_urlsafe(32)
    keys = work / "decode-keys.toml"
    keys.write_text(f'[[key]]\nkey = "{admin_key}"\nadmin = true\n')
    keys.chmod(0o600)
    decode_at = []
    for i in range(opts.decode_nodes):
        name = "decode" if opts.decode_nodes == 1 else f"decode{i}"
        host, port = prefill_at[i % len(prefill_at)]
        args = ["decode", *_node_args(opts), "--prefill", f"{host}:{port}"]
        args += ["--api-keys", str(keys), "--max-tokens", str(opts.max_tokens)]
        args += list(opts.extra_decode_args)  # the cache, storage and transfer flags (`cache_flags`)
        try:
            decode = await start_node(args, logs, name)
        except NodeFailed as exc:
            raise ServeError(f"the {name} node did not start: {exc.reason}") from exc
        nodes.append(decode)
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

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

from hicache.runtime import protocol
from hicache.runtime.api_keys import ApiKeys
from hicache.runtime.launch import NodeFailed, NodeProcess, start_node
from hicache.runtime.llm.tokenizer import ChatTokenizer
from hicache.runtime.serving.app import create_app
from hicache.runtime.serving.backend import ModelInfo
from hicache.runtime.serving.node_backend import NodeBackend
from hicache.runtime.serving.server import serve_http

log = logging.getLogger("hicache.runtime.serve")


class ServeError(Exception):
    """`hicache serve` could not start; one line naming the flag and the reason."""


@attrs.frozen
class ServeOptions:
    model: str = "default"  # "default", a GGUF file or a Hugging Face folder
    host: str = "127.0.0.1"
    port: int = 0
    engine: str = "tcp"
    page_size: int = 16
    l1_pages: int = 1024
    l2_pages: int = 2048
    storage_dir: Path | None = None
    decode: tuple[str, int] | None = None  # attach to this decode node, start nothing
    prefill: tuple[str, int] | None = None  # start a decode node attached to this prefill node
    decode_api_key: str | None = None  # the key the front door uses at an attached decode node
    api_keys: Path | None = None  # the front door's clients
    max_tokens: int = 32768
    log_dir: Path | None = None
    log_level: str = "info"
    extra_decode_args: tuple[str, ...] = ()


class Codec:
    """The model's tokenizer as the front door's `TextCodec`."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)


def load_tokenizer(model: str) -> tuple[ChatTokenizer, str]:
    """The tokenizer (and chat template) of `model`, read without loading its weights."""
    from hicache.runtime.llm.loader import default_model_path

    path = default_model_path() if model == "default" else Path(model)
    if path.is_dir():
        return ChatTokenizer.from_dir(path), path.name
    import gguf

    from hicache.runtime.llm.gguf_file import read_metadata

    meta = read_metadata(gguf.GGUFReader(path))
    # The file's name without its quantisation ("SmolLM2-135M-Instruct.Q4_1.gguf"): what users
    # call the model, unlike GGUF's free-text general.name.
    return ChatTokenizer.from_gguf_metadata(meta, source=str(path)), path.name.split(".")[0]


def _node_args(opts: ServeOptions) -> list[str]:
    args = ["--engine", opts.engine, "--page-size", str(opts.page_size), "--model", opts.model]
    # The two nodes share this machine's cores: a thread of one waiting on a core the other keeps
    # busy would stall every step of its model at the next barrier.
    threads = max(1, (os.cpu_count() or 2) // 2)
    return [*args, "--log-level", opts.log_level, "--threads", str(threads)]


async def serve(opts: ServeOptions, task_status: trio.TaskStatus[dict] = trio.TASK_STATUS_IGNORED) -> None:
    """Start what `opts` asks for and serve until cancelled; reports the ready line's dict."""
    try:
        tokenizer, name = load_tokenizer(opts.model)
    except (OSError, ValueError) as exc:
        raise ServeError(f"--model {opts.model}: cannot read its tokenizer ({exc})") from exc
    keys = ApiKeys.load(opts.api_keys) if opts.api_keys is not None else None
    nodes: list[NodeProcess] = []
    with tempfile.TemporaryDirectory(prefix="hicache-serve-") as tmp:
        work = Path(tmp)
        logs = opts.log_dir or work / "logs"
        try:
            decode_at, admin_key, prefill_at = await _start_nodes(opts, work, logs, nodes)
            backend = NodeBackend(decode_at[0], decode_at[1], None, api_key=admin_key)  # type: ignore[arg-type]
            try:
                stats = await backend.stats()
            except (OSError, protocol.ProtocolError) as exc:
                raise ServeError(f"the decode node at {decode_at[0]}:{decode_at[1]}: {exc}") from exc
            # A request the node can never hold is the client's error (400), not the node's.
            limit = min(opts.max_tokens, int(stats.get("max_prompt_tokens", opts.max_tokens)))
            backend.info = ModelInfo(
                name=name,
                max_context_tokens=limit,
                eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
                vocab_size=tokenizer.vocab_size,
            )
            app = create_app(backend, Codec(tokenizer), model_name=name, api_keys=keys)
            async with trio.open_nursery() as nursery:
                port = await nursery.start(serve_http, app, opts.host, opts.port)
                host = f"[{opts.host}]" if ":" in opts.host else opts.host
                ready = {
                    "url": f"http://{host}:{port}",
                    "model": name,
                    "decode": f"{decode_at[0]}:{decode_at[1]}",
                    "prefill": prefill_at,
                }
                task_status.started(ready)
        finally:
            for node in reversed(nodes):
                node.stop()


async def _start_nodes(
    opts: ServeOptions, work: Path, logs: Path, nodes: list[NodeProcess]
) -> tuple[tuple[str, int], str | None, str | None]:
    """(the decode node's address, the admin key to use there, the prefill node's address)."""
    if opts.decode is not None:
        return opts.decode, opts.decode_api_key, None
    if opts.prefill is not None:
        prefill_at = opts.prefill
    else:
        try:
            prefill = await start_node(["prefill", *_node_args(opts)], logs, "prefill")
        except NodeFailed as exc:
            raise ServeError(f"the prefill node did not start: {exc.reason}") from exc
        nodes.append(prefill)
        prefill_at = ("127.0.0.1", prefill.port)
    admin_key = secrets.token_urlsafe(32)
    keys = work / "decode-keys.toml"
    keys.write_text(f'[[key]]\nkey = "{admin_key}"\nadmin = true\n')
    keys.chmod(0o600)
    args = ["decode", *_node_args(opts), "--prefill", f"{prefill_at[0]}:{prefill_at[1]}"]
    args += ["--l1-pages", str(opts.l1_pages), "--l2-pages", str(opts.l2_pages), "--api-keys", str(keys)]
    args += ["--max-tokens", str(opts.max_tokens)]
    if opts.storage_dir is not None:
        args += ["--storage-dir", str(opts.storage_dir)]
    args += list(opts.extra_decode_args)
    try:
        decode = await start_node(args, logs, "decode")
    except NodeFailed as exc:
        raise ServeError(f"the decode node did not start: {exc.reason}") from exc
    nodes.append(decode)
    return ("127.0.0.1", decode.port), admin_key, f"{prefill_at[0]}:{prefill_at[1]}"


def main(opts: ServeOptions) -> int:
    """Run until SIGINT/SIGTERM; print the ready line once the front door listens."""

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            ready = await nursery.start(serve, opts)
            print(json.dumps(ready), flush=True)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    trio.run(run)
    return 0

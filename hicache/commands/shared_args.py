"""Arguments more than one command takes: the port, log levels and engines, the model's dtypes
and the prefill scheduler's flags (the nodes' and `serve`'s)."""

from __future__ import annotations

from hicache.arg_types import int_in
from hicache.commands.parser import Group, arg

PORT = int_in(0, 65535)  # 0: the system picks a free port (the node prints it when ready)
LOG_LEVELS = ("debug", "info", "warning", "error")
ENGINES = ["nixl", "tcp"]

# What the model computes in and keeps K/V in (SGLang's flags and spellings; `runtime/model/`).
MODEL_DTYPES = ("auto", "bfloat16", "float16", "float32")
DTYPE = arg(
    "--dtype",
    choices=MODEL_DTYPES,
    default="auto",
    help="what the model computes in (SGLang's name); auto: the checkpoint's own (bfloat16 for the default "
    "model; the tiny model's float64) (default auto)",
)
KV_CACHE_DTYPE = arg(
    "--kv-cache-dtype",
    choices=MODEL_DTYPES,
    default="auto",
    help="what K/V is kept in, in every tier, on the wire and in L3 (SGLang's name); auto: the model's "
    "dtype; prefill and decode nodes must agree (default auto)",
)
# Where the model computes (SGLang's flags; `runtime/model/device.py`).
DEVICE = arg(
    "--device",
    choices=("cpu", "cuda"),
    default="cpu",
    help="where the model's weights, its forward, L1 and sampling live (SGLang's name); with cuda, "
    "L2 is pinned host memory and copies between them run on their own CUDA streams (default cpu)",
)
BASE_GPU_ID = arg(
    "--base-gpu-id",
    type=int_in(0),
    default=0,
    metavar="N",
    help="the GPU of --device cuda; rank r of --tp-size uses GPU N + r (SGLang's name) (default 0)",
)
# How a prefill node schedules its prompts (`hicache.core.prefill_sched`); serve passes them on.
PREFILL_SCHEDULER = Group(
    "the prefill scheduler (prompts compute in chunks, shortest remaining work first)",
    (
        arg(
            "--chunked-prefill-size",
            type=int_in(1),
            default=512,
            metavar="TOKENS",
            help="most tokens of one prompt computed in one step (SGLang's name), rounded down "
            "to whole pages: a long prompt is computed in chunks, interleaved with other prompts, "
            "so a short prompt waits about one chunk, not the whole long prompt (default 512)",
        ),
        arg(
            "--max-prefill-tokens",
            type=int_in(1),
            default=1024,
            metavar="TOKENS",
            help="most tokens of all the chunks of one step (SGLang's name) (default 1024)",
        ),
    ),
)

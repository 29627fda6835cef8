"""The HTTP front door of a decode node: SGLang's native API and OpenAI's, over a `Backend`.

    app = create_app(backend, codec, model_name="smollm2")
    port = await nursery.start(serve_http, app, "127.0.0.1", 0)

`backend.py` holds the contract a decode node implements; the rest is the front door's. It may
import `wire` (it reaches decode nodes as their client) and `security` (API keys), never a node,
the model, storage, transfer or tp: it talks to nodes only over the wire.
"""

from hicache.runtime.serving.app import create_app
from hicache.runtime.serving.backend import (
    Backend,
    Finished,
    GenerateEvent,
    GenerateRequest,
    ModelInfo,
    Sampling,
    TextCodec,
    Tokens,
)
from hicache.runtime.serving.server import serve_http

__all__ = [
    "Backend",
    "Finished",
    "GenerateEvent",
    "GenerateRequest",
    "ModelInfo",
    "Sampling",
    "TextCodec",
    "Tokens",
    "create_app",
    "serve_http",
]

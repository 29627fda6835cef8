"""Refusals as OpenAI shapes them, used by every route so clients see one error format."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response


class ApiError(Exception):
    """A request the app answers with `status` and OpenAI's `{"error": {...}}` body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers: dict[str, str] = {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def unavailable(message: str, code: str = "unavailable") -> ApiError:
    """The one 5xx the app sends on purpose: the backend could not serve the request."""
    return ApiError(503, message, type="server_error", code=code)


def dumps(obj: Any) -> str:
    """JSON with non-ASCII escaped: error messages may quote a client's lone surrogates, which
    UTF-8 cannot carry, and escaped JSON is valid whatever the text."""
    return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


class JSON(Response):
    """Starlette's JSONResponse encodes with ensure_ascii=False; see `dumps` for why not here."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("ascii")


def error_response(err: ApiError) -> JSON:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else {}
    return JSON(err.body(), status_code=err.status, headers={**headers, **err.headers})


def show(value: object, limit: int = 60) -> str:
    """A client's value quoted in a message, cut short: a message never echoes a whole body."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""One generation as the front door runs it, whichever API asked: drive the backend, turn
tokens into final text, apply stop strings, time it, count it and log it once.

Both APIs render the same `Generation`; only the JSON around it differs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import attrs
import trio

from hicache.runtime.serving.admission import Admission
from hicache.runtime.serving.backend import (
    TIERS,
    Backend,
    Finished,
    GenerateEvent,
    GenerateRequest,
    TextCodec,
    Tokens,
)
from hicache.runtime.serving.detokenize import IncrementalDetokenizer
from hicache.runtime.serving.errors import ApiError, unavailable
from hicache.runtime.serving.metrics import Metrics
from hicache.runtime.serving.stops import StopStrings
from hicache.runtime.serving.token_rate import TokenRate

log = logging.getLogger("hicache.runtime.serving")

ABORT_GRACE_S = 5.0  # how long a backend may take to abort a request it is told to drop


@attrs.frozen
class Job:
    """A checked request: `api` labels metrics and logs, `stop` holds the stop strings, and
    `public_id` is the id the client sees (SGLang lets a client name it; the backend's `rid`
    is always the front door's own, so two clients cannot collide). The text ends before the
    stop string or stop token that ended it, as SGLang's does, unless `no_stop_trim`."""

    api: str
    request: GenerateRequest
    stop: tuple[str, ...] = ()
    public_id: str | None = None
    no_stop_trim: bool = False  # SGLang's: keep the matched stop string or stop token in the text
    # SGLang's `meta_info.input_token_logprobs` start here (-1: none); the node computes those
    # past the first (`sampling.prompt_logprobs_from`), which is always None.
    input_logprobs_from: int = -1


@attrs.frozen
class Finish:
    """How a generation ended. `reason` adds "disconnect" to the backend's reasons (the client
    left); `matched` is the stop string or stop token id that ended it, if one did."""

    reason: str
    matched: str | int | None = None
    message: str = ""
    refused: bool = False  # the backend refused the request as it is: a 400, not a 503


async def aclose_shielded(agen: AsyncGenerator[object, None], grace_s: float = ABORT_GRACE_S) -> None:
    """Close a generator even from a cancelled scope (a client that left), so its cleanup —
    the backend's abort — may still await, but never for longer than `grace_s`."""
    with trio.move_on_after(grace_s) as scope:
        scope.shield = True
        await agen.aclose()
    if scope.cancelled_caught:
        log.warning("closing %r took over %.1fs; left behind", agen, grace_s)


REASONS = frozenset({"stop", "length", "abort", "error"})


def _count(value: object) -> int:
    """A token count from the backend as a non-negative int (a counter cannot go down)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return max(0, int(value)) if ok else 0  # type: ignore[arg-type]


class Generation:
    def __init__(
        self,
        backend: Backend,
        codec: TextCodec,
        metrics: Metrics,
        job: Job,
        eos: tuple[int, ...],
        arrived: float | None = None,
        on_end: Callable[[Generation], None] | None = None,
        admission: Admission | None = None,
        rate: TokenRate | None = None,
        caller: str = "",
    ):
        """`arrived`: the request's arrival (time.monotonic()), so TTFT includes reading and
        tokenizing it; now if not given. `on_end` sees the generation once it ended and was
        counted (a trace recorder); what it raises is logged, never the request's. `admission`:
        the front door's bounded queue, which the request waits in before it reaches the backend
        (`Overloaded`, a 503, out of `run` when it is full). `rate`: the callers' tokens per
        minute, charged to `caller` (`RateLimited`, a 429, out of `run` when spent)."""
        self.backend = backend
        self.job = job
        self._metrics = metrics
        self._eos = frozenset(eos)
        self._detok = IncrementalDetokenizer(codec)
        self._stops = StopStrings(job.stop, keep=job.no_stop_trim)
        # A client's stop token id ends the request (the node stops on it), so it is the last id.
        self._trim_ids = frozenset(() if job.no_stop_trim else job.request.sampling.stop_token_ids)
        self.started = time.monotonic() if arrived is None else arrived
        self.output_ids: list[int] = []
        self.logprobs: list[Any] = []  # per output id when the sampling asks for them (else empty)
        # Per prompt token from `prompt_logprobs_from` when asked for (`prompt_scores`).
        self.prompt_logprobs: list[Any] = []
        self.prompt_tokens = len(job.request.input_ids)
        self.cached: dict[str, int] = dict.fromkeys(TIERS, 0)
        self.ttft_s: float | None = None
        self.backend_ttft_s: float | None = None
        self.finish: Finish | None = None
        self.prefill_cached_tokens: int | None = None  # when the backend reports them
        self.transferred_tokens: int | None = None
        self.phases: dict[str, float] | None = None  # where the time to its KV went, if known
        self._on_end = on_end
        self._admission = admission
        self._rate = rate
        self._caller = caller
        self.queued_s = 0.0
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None

    @property
    def rid(self) -> str:
        return self.job.request.rid

    @property
    def text(self) -> str:
        """The output text shown so far (final text only, stop strings cut off)."""
        return self._stops.text

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per output token after the first (None with fewer than two)."""
        n = len(self.output_ids)
        if self._first_token_at is None or self._last_token_at is None or n < 2:
            return None
        return (self._last_token_at - self._first_token_at) / (n - 1)

    @property
    def failed(self) -> bool:
        return self.finish is not None and self.finish.reason in ("abort", "error")

    async def run(self) -> AsyncGenerator[str, None]:
        """Yields each piece of newly shown text ("" when tokens came but no text is final yet);
        when it ends, `finish` says why. Closing it early aborts the backend's request. With an
        admission queue, the request holds one of its slots from before it reaches the backend
        until it ended there; a full queue raises `Overloaded` before anything started."""
        async with contextlib.AsyncExitStack() as held:
            if self._rate is not None:
                req = self.job.request
                charged = self._rate.charge(self._caller, len(req.input_ids) + req.max_new_tokens)
                held.callback(self._refund, self._rate, charged)
            if self._admission is not None:
                req = self.job.request
                need = self._admission.need(len(req.input_ids), req.max_new_tokens)
                self.queued_s = await held.enter_async_context(self._admission.slot(need))
                self._metrics.observe_queue_wait(self.queued_s)
            pieces = await held.enter_async_context(contextlib.aclosing(self._run()))
            async for piece in pieces:
                yield piece

    def _refund(self, rate: TokenRate, charged: int) -> None:
        """Give the caller back the output charged but not generated."""
        unused = self.job.request.max_new_tokens - len(self.output_ids)
        rate.refund(self._caller, min(charged, unused))

    async def _run(self) -> AsyncGenerator[str, None]:
        events = self.backend.generate(self.job.request)
        try:
            async for event in events:
                delta = self._take(event)
                if delta or isinstance(event, Tokens):
                    yield delta
                if self.finish is not None:
                    break
            else:
                self._end("error", message="the backend ended the request without a Finished event")
        except Exception as exc:  # a backend fault; trio.Cancelled is a BaseException and passes
            log.exception("rid=%s: the backend failed", self.rid)
            self._end("error", message=f"backend failure: {type(exc).__name__}: {exc}")
        finally:
            await aclose_shielded(events)
            if self.finish is None:
                self._end("disconnect", message="the client went away")
            self._account()

    def _take(self, event: GenerateEvent) -> str:
        if isinstance(event, Tokens):
            return self._take_tokens(event)
        if isinstance(event, Finished):
            return self._take_finished(event)
        raise TypeError(f"the backend yielded {event!r}, not Tokens or Finished")

    def _take_tokens(self, event: Tokens) -> str:
        now = time.monotonic()
        if self._last_token_at is None:
            self._first_token_at = now
            self.ttft_s = now - self.started
            self._metrics.first_token(self.ttft_s)
        elif event.ids:
            self._metrics.inter_token(now - self._last_token_at, len(event.ids))
        self._last_token_at = now
        if event.cached_tokens is not None:
            self._set_cached(event.cached_tokens)
        if event.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = list(event.prompt_logprobs)
        self.output_ids.extend(event.ids)
        if self.job.request.sampling.logprobs:
            lps = list(event.logprobs or ())
            self.logprobs.extend(lps[: len(event.ids)] + [None] * (len(event.ids) - len(lps)))
        shown = event.ids[:-1] if event.ids and event.ids[-1] in self._trim_ids else event.ids
        delta = self._stops.feed(self._detok.push(shown))
        if self._stops.matched is not None:
            self._end("stop", matched=self._stops.matched)  # `run` breaks, which aborts the backend
        return delta

    def _take_finished(self, event: Finished) -> str:
        if _count(event.prompt_tokens):
            self.prompt_tokens = _count(event.prompt_tokens)
        self._set_cached(event.cached_tokens)
        self.backend_ttft_s = event.ttft_s
        for name in ("prefill_cached_tokens", "transferred_tokens"):  # a backend that knows them
            value = getattr(event, name, None)
            if value is not None:
                setattr(self, name, _count(value))
        if event.phases is not None:
            self.phases = dict(event.phases)
        delta = self._stops.feed(self._detok.flush(), final=True)
        if self._stops.matched is not None:
            self._end("stop", matched=self._stops.matched)
        elif event.reason == "stop":
            last = self.output_ids[-1] if self.output_ids else None
            stop_ids = self._eos | set(self.job.request.sampling.stop_token_ids)
            self._end("stop", matched=last if last in stop_ids else None, message=event.message)
        elif event.reason in REASONS:
            self._end(event.reason, message=event.message, refused=event.refused)
        else:
            self._end("error", message=f"the backend finished with reason {event.reason!r}: {event.message}")
        return delta

    def _set_cached(self, cached: Mapping[str, int]) -> None:
        for tier in TIERS:
            self.cached[tier] = _count(cached.get(tier, 0))

    def prompt_scores(self) -> list[Any]:
        """The prompt's log-probabilities from `prompt_logprobs_from` on (the first None), one per
        token; None for any the backend did not bring. Empty when not asked for."""
        start = self.job.request.sampling.prompt_logprobs_from
        if start < 0:
            return []
        n = len(self.job.request.input_ids) - start
        got = self.prompt_logprobs[:n]
        return got + [None] * (n - len(got))

    def error(self) -> ApiError:
        """What a failed generation answers: a 400 when the backend refused the request as it
        is (a prompt over a limit of the node's: asking again fails again), else a 503."""
        assert self.finish is not None
        message = self.finish.message or "the backend gave up on the request"
        if self.finish.refused:
            return ApiError(400, message, code="request_refused")
        return unavailable(message, code=self.finish.reason)

    def abort(self, message: str) -> None:
        """Finish as an abort for `message` (the server stopping); the backend's request is
        aborted once `run` is closed or cancelled. No effect on a generation that has ended."""
        self._end("abort", message=message)

    def _end(
        self, reason: str, *, matched: str | int | None = None, message: str = "", refused: bool = False
    ) -> None:
        if self.finish is None:
            self.finish = Finish(reason, matched, message, refused)

    def _account(self) -> None:
        """Metrics and the one log line of a finished request (a warning if it failed)."""
        assert self.finish is not None
        e2e = self.elapsed_s
        self._metrics.finished(
            self.job.api, self.finish.reason, self.prompt_tokens, len(self.output_ids), self.cached, e2e
        )
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s:.3f}s"
        line = (
            f"rid={self.rid} api={self.job.api} tenant={self.job.request.tenant} "
            f"outcome={self.finish.reason} "
            f"prompt={self.prompt_tokens} cached l1={self.cached['l1']} l2={self.cached['l2']} "
            f"l3={self.cached['l3']} output={len(self.output_ids)} ttft={ttft} e2e={e2e:.3f}s"
        )
        if self.finish.reason in ("stop", "length"):
            log.info(line)
        else:
            log.warning("%s: %s", line, self.finish.message or "no reason given")
        if self._on_end is not None:
            try:
                self._on_end(self)
            except Exception:
                log.exception("rid=%s: recording the request's outcome failed", self.rid)

    def usage(self) -> dict[str, object]:
        """OpenAI's usage block; cached_tokens counts every tier."""
        completion = len(self.output_ids)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
        }

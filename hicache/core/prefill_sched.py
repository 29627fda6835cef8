"""The prefill node's scheduler: which prompts compute next, in which chunks, and which staging
pages each holds while its KV leaves for a decode node.

A prompt waits in a FIFO queue until the staging pages its transfer needs are free (`admit`);
a prompt needing more than the pool holds is refused at once (`Refused`: deterministic, never
worth a retry). Once the driver knows the range it must compute (after its prefix cache),
the prompt runs (`start`), and every `step` hands out the next chunks:

- a chunk is at most `chunk_tokens` long (SGLang's `--chunked-prefill-size`) and a step at most
  `step_tokens` (`--max-prefill-tokens`); a chunk that stops before its prompt's end stops on a
  page boundary, so a page is complete when the chunk that writes it ends;
- shortest remaining work first, so a short prompt is served in the step after it starts,
  whatever long prompt is in progress; a prompt passed over `starve_steps` steps in a row goes
  first, so a stream of short prompts never stalls a long one.

`cancel` stops a prompt wherever it is: waiting, it leaves the queue; running, no later step
gives it a chunk (one in the step being computed finishes and is ignored). Its staging pages
stay held until `release` (the driver's WRITE has settled), then the prompt is forgotten. Every
prompt that arrived ends exactly once, by `release` or by a cancel while it waited.

Pure and deterministic: no clock, no I/O; the driver feeds what happened and carries out the
steps.
"""

from __future__ import annotations

import enum
from collections import deque

import attrs


class Phase(enum.Enum):
    WAITING = "waiting"  # in the queue: no staging pages yet
    ADMITTED = "admitted"  # staging pages held; the range to compute not yet known
    RUNNING = "running"  # chunks to compute
    COMPUTED = "computed"  # every chunk done: the driver finishes the transfer
    CANCELLED = "cancelled"  # dropped: no more chunks; staging held until `release`


class SchedulerError(Exception):
    """An event the scheduler cannot take in the prompt's phase (a driver bug)."""


class Refused(Exception):
    """A prompt no amount of waiting lets this node serve (deterministic: never retried)."""


@attrs.frozen(slots=True)
class Chunk:
    """Compute positions [lo, hi) of prompt `key`; `last`: the prompt's final chunk."""

    key: str
    lo: int
    hi: int
    last: bool


@attrs.define(slots=True)
class Job:
    key: str
    pages: int  # staging pages its transfer needs
    seq: int  # arrival order
    phase: Phase = Phase.WAITING
    slots: list[int] = attrs.Factory(list)
    done: int = 0  # positions computed (absolute)
    end: int = 0
    passed: int = 0  # steps in a row it could have run and did not
    chunks: int = 0  # chunks handed out

    @property
    def remaining(self) -> int:
        return self.end - self.done


class PrefillScheduler:
    """The queue, the running prompts and the staging pool of one prefill node."""

    def __init__(
        self,
        staging_pages: int,
        page_size: int,
        chunk_tokens: int,
        step_tokens: int,
        *,
        starve_steps: int = 2,
    ) -> None:
        if staging_pages < 1 or page_size < 1:
            raise ValueError(f"staging_pages and page_size must be >= 1, got {staging_pages}, {page_size}")
        if chunk_tokens < page_size:
            raise ValueError(f"chunk_tokens: expected at least a page ({page_size}), got {chunk_tokens}")
        if step_tokens < chunk_tokens:
            raise ValueError(f"step_tokens ({step_tokens}) must be at least chunk_tokens ({chunk_tokens})")
        if starve_steps < 1:
            raise ValueError(f"starve_steps: expected >= 1, got {starve_steps}")
        self.page_size = page_size
        self.chunk_tokens = chunk_tokens - chunk_tokens % page_size  # whole pages
        self.step_tokens = step_tokens
        self.starve_steps = starve_steps
        self.capacity = staging_pages
        self.free: list[int] = list(range(staging_pages - 1, -1, -1))
        self.jobs: dict[str, Job] = {}
        self.queue: deque[str] = deque()
        self.steps = 0  # steps handed out
        self._seq = 0
        # Counters a node reports.
        self.refused = 0
        self.cancelled_waiting = 0  # dropped from the queue before computing anything
        self.cancelled_running = 0  # dropped between chunks
        self.ended = 0

    # ------------------------------------------------------------------------------ events

    def _job(self, key: str, event: str, *phases: Phase) -> Job:
        job = self.jobs.get(key)
        if job is None:
            raise SchedulerError(f"{event}: no prompt {key!r} is scheduled")
        if phases and job.phase not in phases:
            raise SchedulerError(f"{event}: prompt {key!r} is {job.phase.value}")
        return job

    def arrive(self, key: str, pages: int) -> None:
        """Queue prompt `key`, whose transfer needs `pages` staging pages."""
        if key in self.jobs:
            raise SchedulerError(f"arrive: prompt {key!r} is already {self.jobs[key].phase.value}")
        if pages < 0:
            raise SchedulerError(f"arrive: prompt {key!r} needs {pages} pages")
        if pages > self.capacity:
            self.refused += 1
            raise Refused(
                f"the prompt needs {pages} staging pages to send, more than this prefill node's "
                f"{self.capacity} (--staging-pages)"
            )
        self.jobs[key] = Job(key, pages, self._seq)
        self._seq += 1
        self.queue.append(key)

    def admit(self) -> list[Job]:
        """Prompts leaving the queue, in arrival order, with their staging pages; a prompt
        whose pages are not free yet holds the ones behind it (no overtaking, so none waits
        forever)."""
        out = []
        while self.queue:
            job = self.jobs[self.queue[0]]
            if job.pages > len(self.free):
                break
            self.queue.popleft()
            job.slots = self.free[len(self.free) - job.pages :] if job.pages else []
            del self.free[len(self.free) - job.pages :]
            job.phase = Phase.ADMITTED
            out.append(job)
        return out

    def start(self, key: str, lo: int, hi: int) -> None:
        """Admitted prompt `key` computes positions [lo, hi) (lo: what its cache held)."""
        job = self._job(key, "start", Phase.ADMITTED)
        if not 0 <= lo < hi:
            raise SchedulerError(f"start: prompt {key!r}: bad range [{lo}, {hi})")
        job.done, job.end = lo, hi
        job.phase = Phase.RUNNING

    def step(self) -> list[Chunk]:
        """The next step's chunks: at most one per running prompt, `step_tokens` in all."""
        running = [j for j in self.jobs.values() if j.phase is Phase.RUNNING and j.remaining > 0]
        if not running:
            return []
        starved = sorted((j for j in running if j.passed >= self.starve_steps), key=lambda j: j.seq)
        rest = sorted(
            (j for j in running if j.passed < self.starve_steps), key=lambda j: (j.remaining, j.seq)
        )
        budget, out = self.step_tokens, []
        for job in starved + rest:
            take = min(job.remaining, self.chunk_tokens, budget)
            hi = job.done + take
            if hi < job.end:
                hi -= hi % self.page_size  # a chunk that stops early stops on a page boundary
            if hi <= job.done:
                job.passed += 1
                continue
            out.append(Chunk(job.key, job.done, hi, hi == job.end))
            budget -= hi - job.done
            job.passed = 0
            job.chunks += 1
        self.steps += 1
        return out

    def computed(self, chunk: Chunk) -> None:
        """`chunk` was computed (ignored if its prompt was cancelled meanwhile)."""
        job = self.jobs.get(chunk.key)
        if job is None or job.phase is Phase.CANCELLED:
            return
        if job.phase is not Phase.RUNNING or chunk.lo != job.done or chunk.hi > job.end:
            raise SchedulerError(f"computed: prompt {chunk.key!r} is {job.phase.value} at {job.done}")
        job.done = chunk.hi
        if job.done == job.end:
            job.phase = Phase.COMPUTED

    def cancel(self, key: str) -> bool:
        """Drop prompt `key`'s queued or remaining work; True if there was any to drop."""
        job = self.jobs.get(key)
        if job is None or job.phase is Phase.CANCELLED:
            return False
        if job.phase is Phase.WAITING:
            self.queue.remove(key)
            del self.jobs[key]
            self.cancelled_waiting += 1
            self.ended += 1
            return True
        dropped = job.phase is not Phase.COMPUTED
        if dropped:
            self.cancelled_running += 1
        job.phase = Phase.CANCELLED
        return dropped

    def release(self, key: str) -> None:
        """Prompt `key` is over and its staging pages are free again (its WRITEs settled)."""
        job = self._job(key, "release", Phase.ADMITTED, Phase.RUNNING, Phase.COMPUTED, Phase.CANCELLED)
        self.free.extend(job.slots)
        job.slots = []
        del self.jobs[key]
        self.ended += 1

    # ------------------------------------------------------------------------------ reading

    def phase(self, key: str) -> Phase | None:
        job = self.jobs.get(key)
        return None if job is None else job.phase

    def position(self, key: str) -> int:
        """Prompts ahead of `key` in the queue (0 once it left the queue)."""
        try:
            return self.queue.index(key)
        except ValueError:
            return 0

    def busy(self) -> bool:
        """Whether a step would hand out work."""
        return any(j.phase is Phase.RUNNING and j.remaining > 0 for j in self.jobs.values())

    def check(self) -> None:
        """Every staging page free or held by exactly one prompt; the queue is the waiting prompts."""
        held = [s for j in self.jobs.values() for s in j.slots]
        every = held + self.free
        if sorted(every) != list(range(self.capacity)):
            raise AssertionError(f"staging pages lost or doubled: {sorted(every)[:16]}")
        waiting = [k for k, j in self.jobs.items() if j.phase is Phase.WAITING]
        if sorted(waiting) != sorted(self.queue):
            raise AssertionError(f"queue {list(self.queue)} != waiting prompts {waiting}")
        for j in self.jobs.values():
            if j.phase is Phase.WAITING and j.slots:
                raise AssertionError(f"{j.key!r} holds pages while waiting")
            if j.phase is not Phase.WAITING and len(j.slots) != j.pages:
                raise AssertionError(f"{j.key!r} holds {len(j.slots)} pages, needs {j.pages}")

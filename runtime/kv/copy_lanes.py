"""Where `CopyEngine` issues the copies that touch device memory: a lane is one side stream.

A copy between a host pool and a device pool (or two device pools) is issued on the lane of the
device, after the lane has waited for the caller's stream (so it reads what the caller's kernels
wrote), and completes when the event recorded after it fires; `CopyEngine` waits for that event
from trio, never for the whole device. `CudaLane` is a CUDA side stream. `ImmediateLane` is the
same structure where a "stream" runs each operation as it is issued and every event has already
fired: with it the engine's ordering (issue, started, wait, host scatter after the event, staging
buffers held until then) runs on any machine, and tests can hand the engine lanes whose events
fire only when the test says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch


class Completion(Protocol):
    """An event recorded on a lane: `query()` says, without blocking, whether it has fired."""

    def query(self) -> bool: ...


class Lane(Protocol):
    """One side stream of one device."""

    device: torch.device
    pinned: bool
    """Whether the engine's host staging for this lane is pinned (asynchronous DMA needs it)."""

    def caller(self) -> object:
        """The caller's current stream, taken on the trio thread before issuing elsewhere."""
        ...

    def issuing(self, caller: object) -> contextlib.AbstractContextManager[None]:
        """Within it, work is enqueued on the lane, after everything `caller` had enqueued."""
        ...

    def record(self) -> Completion:
        """An event that fires once everything enqueued on the lane so far has completed."""
        ...


class CudaLane:
    """A CUDA side stream of `device`."""

    pinned = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def caller(self) -> object:
        return torch.cuda.current_stream(self.device)

    @contextlib.contextmanager
    def issuing(self, caller: object) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_stream(caller)  # type: ignore[arg-type]
            yield

    def record(self) -> Completion:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


class Fired:
    """An event that has already fired."""

    def query(self) -> bool:
        return True


class ImmediateLane:
    """A lane on which every operation has run by the time it is issued (host memory)."""

    pinned = False

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def caller(self) -> object:
        return None

    @contextlib.contextmanager
    def issuing(self, caller: object) -> Iterator[None]:
        yield

    def record(self) -> Completion:
        return Fired()

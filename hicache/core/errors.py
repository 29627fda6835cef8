"""Errors raised by the core: each names what was wrong and where, so a driver can report it."""


class CoreError(Exception):
    """Base class of every error the core raises."""


class PoolError(CoreError):
    """A slot was used against the pool's ownership rules (double free, wrong owner, unknown slot)."""


class LockError(CoreError):
    """A lock or pin receipt was released twice or does not belong to this tree."""


class PolicyError(CoreError, ValueError):
    """An unknown policy name or an invalid policy parameter."""


class TransitionError(CoreError):
    """An event that a request's state (or an operation's phase) does not accept; names the
    request or operation, its state and the event."""

    def __init__(self, req: str, state: str, event: str, *, subject: str | None = None) -> None:
        super().__init__(f"{subject or f'request {req!r}'} in state {state} cannot take {event}")
        self.req = req
        self.state = state
        self.event = event

"""The one error an exception group stands for: trio's nurseries wrap even a lone error in
groups, and an operator wants that error's sentence, not the groups around it. Torch-free, so
the front door (which starts the nodes but runs no model) can use it."""

from __future__ import annotations


def sole(exc: BaseException) -> BaseException:
    """`exc`, unwrapped from every group that holds only it."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc

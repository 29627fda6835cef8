"""What the model tests share: one intra-op thread, and a relative error."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """The tensors in these tests are small: handing them to intra-op threads costs more than it
    saves, much more on a busy machine. Restored afterwards, so other modules keep their setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference, relative to the largest magnitude of the reference `b`."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max() / b.abs().max())

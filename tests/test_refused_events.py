"""An event the core refuses does not stop the decode node.

The core leaves itself exactly as it was when it refuses an event (`tests/test_refusals.py`),
so the runtime logs the refusal and goes on: a late, doubled or confused completion that a
peer's behaviour makes the driver feed costs at most that event, never the node.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
from node_pair import node_pair, prompt, turn

from hicache.core import events as ev


async def test_refused_events_are_logged_and_the_node_serves_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="hicache.runtime.decode")
    async with node_pair(tmp_path) as pair:
        assert (await turn(pair.client, pair.ledger, "before", prompt(1)))["outcome"] == "finished"
        now = trio.current_time()
        for event in (
            ev.KVArrived(now, "nobody", 10**6),  # a transfer nobody asked for
            ev.LoadDone(now, 10**6),  # a load-back that is not in flight
            ev.Finished(now, "before"),  # a second end of a request that ended
        ):
            pair.service.feed.put(event)
        assert pair.service.audit()["refused_events"] == 3
        assert sum("the core refused" in r.getMessage() for r in caplog.records) == 3
        assert (await turn(pair.client, pair.ledger, "after", prompt(2)))["outcome"] == "finished"
        assert pair.service.audit()["check"] == "ok"

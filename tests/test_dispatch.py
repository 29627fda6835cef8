"""One dispatch shape: every executor of the core's commands handles every command.

A `Dispatcher` (`hicache/core/dispatch.py`) refuses a table that misses a member of the
`Command` union; the simulator's decode driver, the runtime's decode service and the test world
each build one, so a new command that any of them cannot execute fails here, not silently at run
time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from builders import decode_config
from kvworld import World
from test_sim_cluster import scenario

from hicache.core.decode_node import DecodeNodeCore
from hicache.core.dispatch import COMMAND_TYPES, Dispatcher, MissingHandler
from hicache.sim.cluster import Cluster
from hicache.sim.setup import setups

ROOT = Path(__file__).resolve().parent.parent


def test_a_table_missing_a_command_is_refused_by_name() -> None:
    core = DecodeNodeCore(decode_config())
    table = {t: (lambda c: None) for t in COMMAND_TYPES}
    Dispatcher(core, table, "complete")
    for t in COMMAND_TYPES:
        partial = {k: v for k, v in table.items() if k is not t}
        with pytest.raises(MissingHandler, match=f"incomplete: no handler for {t.__name__}"):
            Dispatcher(core, partial, "incomplete")
    with pytest.raises(MissingHandler, match="non-commands int"):
        Dispatcher(core, {**table, int: lambda c: None}, "extra")


def test_the_test_world_handles_every_command() -> None:
    assert set(World(decode_config()).dispatcher.handlers) == set(COMMAND_TYPES)


def test_the_simulators_decode_driver_handles_every_command() -> None:
    s = scenario(cluster={"decode_nodes": 1, "prefill_nodes": 1})
    for label, setup in setups(s).items():
        for driver in Cluster(setup).decode:
            assert set(driver.dispatcher.handlers) == set(COMMAND_TYPES), label


def test_the_runtimes_decode_service_handles_every_command() -> None:
    """Read from the source (building a service needs a model, storage and a transfer engine;
    the runtime's end-to-end tests build one, and its `Dispatcher` checks the table there too)."""
    tree = ast.parse((ROOT / "runtime" / "decode" / "decode_node.py").read_text(encoding="utf-8"))
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_handlers"]
    (table,) = [n for n in ast.walk(fn) if isinstance(n, ast.Dict)]
    named = {ast.unparse(k).split(".")[-1] for k in table.keys if k is not None}
    assert named == {t.__name__ for t in COMMAND_TYPES}

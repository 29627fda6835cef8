"""Tenants come from API keys; admin operations need an admin key; tenants cannot time each other.

Before: the tenant was whatever a client declared (another tenant's name included), any client
could read node-wide `stats` and `evict` every tenant's L1 and L2, and the prefill node's memo
of recent prompts answered another tenant's prompt in 38 ms against 130 ms for a new one.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from node_pair import GUARD_S, PAGE, prompt, small_core

from hicache.runtime.decode.decode_node import DecodeService
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.nodes import layout_for
from hicache.runtime.prefill.prefill_node import PrefillNode
from hicache.runtime.security.api_keys import ApiKeyError, ApiKeys, Principal, digest
from hicache.runtime.storage.memory_store import MemoryStore
from hicache.runtime.transfer.tcp import TcpEngine
from hicache.runtime.verify import KVLedger
from hicache.runtime.wire import protocol
from hicache.runtime.wire.client import DecodeClient

ACME = "sk-acme-0123456789abcdef"
GLOBEX = "sk-globex-0123456789abcdef"
ROOT = "sk-root-0123456789abcdef"
KEYS = ApiKeys.parse(
    {
        "key": [
            {"key": ACME, "tenant": "acme"},
            {"key_sha256": digest(GLOBEX), "tenant": "globex"},
            {"key": ROOT, "admin": True},
        ]
    },
    "keys.toml",
)

# ============================================================================ the file


def test_keys_map_to_principals_by_digest() -> None:
    assert KEYS.lookup(ACME) == Principal("acme", False)
    assert KEYS.lookup(GLOBEX) == Principal("globex", False)
    assert KEYS.lookup(ROOT) == Principal(None, True)
    for wrong in (ACME[:-1], ACME + "x", "", None, 5, ["x"], "\udc00" * 20, "x" * 10_000):
        assert KEYS.lookup(wrong) is None


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("", "expected at least one [[key]] entry"),
        ("[keys]\nx = 1", "unknown table 'keys'"),
        ('[[key]]\ntenant = "a"', "expected exactly one of 'key' and 'key_sha256'"),
        ('[[key]]\nkey = "short"\ntenant = "a"', "field 'key' must be a string of at least 16"),
        ('[[key]]\nkey_sha256 = "abc"\ntenant = "a"', "field 'key_sha256' must be 64 hex digits"),
        ('[[key]]\nkey = "0123456789abcdef"', "field 'tenant' is required"),
        ('[[key]]\nkey = "0123456789abcdef"\ntenant = 5', "field 'tenant' must be a string"),
        ('[[key]]\nkey = "0123456789abcdef"\nadmin = "yes"', "field 'admin' must be true or false"),
        ('[[key]]\nkey = "0123456789abcdef"\ntenant = "a"\nrole = "x"', "unknown field 'role'"),
        (
            '[[key]]\nkey = "0123456789abcdef"\ntenant = "a"\n'
            '[[key]]\nkey = "0123456789abcdef"\ntenant = "b"',
            "[[key]] #2: the same key appears twice",
        ),
        ("[[key]\n", "not TOML"),
    ],
)
def test_a_bad_key_file_names_the_entry_and_field(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ApiKeyError) as err:
        ApiKeys.load(path)
    assert str(err.value).startswith(str(path)) and named in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("mode", "digests_only", "refused"),
    [
        (0o600, False, None),
        (0o400, False, None),
        (0o644, False, "mode 0644 lets others read the API keys in it; chmod 600 it"),
        (0o640, False, "mode 0640 lets others read the API keys in it"),
        (0o644, True, None),  # digests: nothing a reader could present
        (0o664, True, "mode 0664 lets others change it (and add an admin key)"),
        (0o602, False, "mode 0602 lets others change it"),
    ],
)
def test_a_key_file_others_can_read_or_change_is_refused_as_ssh_would(
    tmp_path: Path, mode: int, digests_only: bool, refused: str | None
) -> None:
    """Issue 30, finding 10: a 0644 --api-keys file was taken silently."""
    path = tmp_path / "keys.toml"
    entry = f'key_sha256 = "{digest(ACME)}"' if digests_only else f'key = "{ACME}"'
    path.write_text(f'[[key]]\n{entry}\ntenant = "acme"\n')
    path.chmod(mode)
    if refused is None:
        assert ApiKeys.load(path).lookup(ACME) == Principal("acme", False)
        return
    with pytest.raises(ApiKeyError) as err:
        ApiKeys.load(path)
    assert str(err.value).startswith(f"{path}: ") and refused in str(err.value), str(err.value)


# ============================================================================ at the node


@contextlib.asynccontextmanager
async def keyed_node(keys: ApiKeys | None) -> AsyncIterator[tuple[int, KVLedger, PrefillNode]]:
    model = TinyModel(TinyConfig())
    layout = layout_for(model.config, PAGE)
    async with (
        TcpEngine(name="prefill") as p_engine,
        TcpEngine(name="decode") as d_engine,
        trio.open_nursery() as nursery,
    ):
        prefill = PrefillNode(model, layout, p_engine, staging_pages=64)
        prefill_port = (await nursery.start(prefill.serve, 0))[0].socket.getsockname()[1]
        service = DecodeService(
            small_core(storage=False), model, layout, MemoryStore(layout), d_engine, api_keys=keys
        )
        port = await nursery.start(service.run, 0, ("127.0.0.1", prefill_port))
        yield port, KVLedger(model, PAGE), prefill
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_node_with_keys_serves_only_authenticated_clients() -> None:
    async with keyed_node(KEYS) as (port, _, _):
        anonymous = await DecodeClient.connect("127.0.0.1", port)
        with pytest.raises(protocol.ProtocolError, match="this node needs an API key"):
            await anonymous.generate("x", prompt(1), 1)
        with pytest.raises(protocol.ProtocolError, match="needs an API key"):
            await anonymous.stats()
        await anonymous.aclose()
        with pytest.raises(protocol.ProtocolError, match="refused the connection: .*unknown API key"):
            await DecodeClient.connect("127.0.0.1", port, api_key=ACME[:-1] + "?")


@pytest.mark.slow
async def test_the_tenant_is_the_keys_and_admin_operations_need_an_admin_key() -> None:
    async with keyed_node(KEYS) as (port, ledger, prefill):
        acme = await DecodeClient.connect("127.0.0.1", port, api_key=ACME)
        globex = await DecodeClient.connect("127.0.0.1", port, api_key=GLOBEX)
        root = await DecodeClient.connect("127.0.0.1", port, api_key=ROOT)
        assert acme.principal == {"op": "auth", "ok": True, "tenant": "acme", "admin": False}
        tokens = prompt(7, 4 * PAGE + 3)
        with trio.fail_after(GUARD_S):
            first, kv = await acme.generate("a0", tokens, 2, verify=True)
            assert ledger.check(tokens, 2, first, kv, tenant="acme") == []
            # globex claims to be acme: refused; asking as itself, it shares nothing with acme
            with pytest.raises(protocol.ProtocolError, match="differs from the tenant of this connection"):
                await globex.generate("g0", tokens, 2, tenant="acme")
            theirs, kv = await globex.generate("g1", tokens, 2, verify=True)
            assert ledger.check(tokens, 2, theirs, kv, tenant="globex") == []
            assert theirs["account"]["transferred"] == len(tokens)
            assert prefill.requests == 2  # computed again for globex
            again, _ = await acme.generate("a1", tokens, 2)
            assert again["account"]["l1"] == 4 * PAGE  # acme's own pages
            for op in ("stats", "evict", "idle", "audit"):
                with pytest.raises(protocol.ProtocolError, match=f"message '{op}': needs an admin API key"):
                    await acme.call({"op": op})
            assert (await root.stats())["finished"] == 3
            await root.evict()
            await root.idle()
        for c in (acme, globex, root):
            await c.aclose()


# ============================================================================ timing


@pytest.mark.slow
async def test_another_tenants_prompt_is_no_faster_than_a_new_one() -> None:
    """The side channel, measured: tenant A sends a prompt; tenant B then sends the same prompt
    (`cross`) or a new one of the same length (`fresh`), in random order, eight of each. If the
    prefill node's memo (or any cache) served B from A's work, every `cross` would beat every
    `fresh`, as all 8 of 8 did before the memo was salted. The test fails only on that complete
    separation, which two samples of one distribution show with probability 1/12870."""
    async with keyed_node(KEYS) as (port, _, _):
        acme = await DecodeClient.connect("127.0.0.1", port, api_key=ACME)
        globex = await DecodeClient.connect("127.0.0.1", port, api_key=GLOBEX)
        n, length = 8, 12 * PAGE
        times: dict[str, list[float]] = {"cross": [], "fresh": []}
        order = ["cross"] * n + ["fresh"] * n
        random.Random(5).shuffle(order)
        with trio.fail_after(10 * GUARD_S):
            for i in range(3):  # warm up: first calls pay for lazy set-up
                await globex.generate(f"warm{i}", prompt(900 + i, length), 1)
            for i, kind in enumerate(order):
                tokens = prompt(1000 + i, length)
                await acme.generate(f"a{i}", tokens, 1)
                asked = tokens if kind == "cross" else prompt(5000 + i, length)
                start = trio.current_time()
                reply, _ = await globex.generate(f"g{i}", asked, 1)
                times[kind].append(trio.current_time() - start)
                assert reply["outcome"] == "finished"
                assert reply["account"]["transferred"] == length  # nothing reused, in any case
        assert max(times["cross"]) >= min(times["fresh"]), times

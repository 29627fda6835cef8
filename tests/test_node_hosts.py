"""Nodes on their own addresses: each node binds its `--host` for clients, control and KV
transfers alike, and tells its peers that address, so prefill and decode can run on two
machines. Here two loopback addresses (127.0.0.2 and 127.0.0.3) stand in for two machines:
nothing of either node listens on 127.0.0.1, and a request still goes through."""

from __future__ import annotations

import psutil
import pytest
import trio
from helpers import running

from hicache.runtime.nodes import make_engine
from hicache.runtime.wire.client import DecodeClient
from hicache.runtime.wire.prefill_address import advertised

COMMON = ["--engine", "tcp", "--page-size", "4"]


def listening(pid: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}


@pytest.mark.process
def test_prefill_and_decode_on_two_addresses_serve_a_request() -> None:
    decode_args = ["--host", "127.0.0.3", "--l1-pages", "256", "--num-reserved-decode-tokens", "8"]
    prefill_args = [*COMMON, "--host", "127.0.0.2"]
    with (
        running("prefill", *prefill_args) as prefill,
        running("decode", *COMMON, *decode_args, "--prefill", f"127.0.0.2:{prefill.port}") as decode,
    ):

        async def ask() -> dict:
            client = await DecodeClient.connect("127.0.0.3", decode.port)
            try:
                reply, _ = await client.generate("r1", list(range(1, 11)), 3)
                return reply
            finally:
                await client.aclose()

        reply = trio.run(ask)
        assert reply["outcome"] == "finished", reply
        assert len(reply["tokens"]) == 3
        assert listening(prefill.pid) == {"127.0.0.2"}  # control port and transfer engine
        assert listening(decode.pid) == {"127.0.0.3"}  # client port and transfer engine


@pytest.mark.parametrize("host", ["127.0.0.2", "0.0.0.0"])
def test_the_transfer_engine_advertises_an_address_peers_can_dial(host: str) -> None:
    async def info() -> bytes:
        from hicache.runtime.security.cluster_secret import ClusterSecret
        from hicache.runtime.transfer.base import PeerInfo

        async with make_engine("tcp", "t", ClusterSecret.of("s3cret"), host) as engine:
            return PeerInfo.decode(engine.local_info()).fields["host"]

    assert trio.run(info).decode() == advertised(host)
    assert advertised("0.0.0.0") not in ("0.0.0.0", "")

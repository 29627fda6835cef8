"""Moving KV pages between nodes: a NIXL-shaped engine interface and its implementations.

`TcpEngine` needs nothing but trio; `NixlEngine` wraps NIXL's UCX backend and imports `nixl` only
when constructed. It may import `security` (the TCP engine's handshake proves the cluster secret),
never kv, storage, tp, a node or serving.
"""

from hicache.runtime.transfer.base import (
    MAX_NOTIF_BYTES,
    Desc,
    DescList,
    MemoryRegion,
    Op,
    PeerInfo,
    TransferEngine,
    TransferTimeout,
    XferHandle,
    XferState,
)
from hicache.runtime.transfer.nixl_engine import NixlEngine
from hicache.runtime.transfer.tcp import TcpEngine

__all__ = [
    "MAX_NOTIF_BYTES",
    "Desc",
    "DescList",
    "MemoryRegion",
    "NixlEngine",
    "Op",
    "PeerInfo",
    "TcpEngine",
    "TransferEngine",
    "TransferTimeout",
    "XferHandle",
    "XferState",
]

"""The page file of the file store (`file_store.py`): a fixed-size header, then the page's raw
bytes:

    offset size  field
    0      8     magic b"HICKVPG\\0"
    8      2     format version (2)
    10     2     header size (128)
    12     2     shard rank (0 when unsharded)
    14     2     shard count (0 when unsharded, else the tensor-parallel size)
    16     8     page key
    24     20    page shape, 5 x uint32 (layers, 2, page_size, kv_heads, head_dim)
    44     16    dtype name, ASCII, NUL-padded
    60     8     payload length in bytes
    68     28    reserved (0)
    96     32    MAC: keyed BLAKE2b-256 of bytes [0, 96) and the payload

all little-endian. The MAC key comes from a cluster secret (`FileStore(secret=...)`, else the
environment variable HICACHE_CLUSTER_SECRET, else a random secret the first store writes to
`ROOT/.hicache-secret` with mode 0600), so a page nobody with the secret wrote — forged by
whoever can write the directory, damaged, or in version 1's unkeyed CRC-32 format — reads as a
miss. The MAC covers the key and layout fields too: a valid page copied under another key's
name is a miss as well.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from hicache.runtime.kv.kv_layout import KVLayout

MAGIC = b"HICKVPG\0"
VERSION = 2
MAC_SIZE = 32
SIGNED = struct.Struct("<8sHHHHQ5I16sQ28x")  # the header fields the MAC follows
HEADER = struct.Struct(SIGNED.format + f"{MAC_SIZE}s")
HEADER_SIZE = HEADER.size
SUFFIX = ".kvpage"
_KEY_PERSON = b"hicache-l3-key"
_PAGE_PERSON = b"hicache-l3-page"

assert HEADER_SIZE == 128 and SIGNED.size == HEADER_SIZE - MAC_SIZE, HEADER_SIZE


def mac_key(secret: bytes) -> bytes:
    """The BLAKE2b key of page MACs for a cluster secret of any length."""
    return hashlib.blake2b(secret, digest_size=32, person=_KEY_PERSON).digest()


def page_mac(key: bytes, signed: bytes, payload: bytes | memoryview | np.ndarray) -> bytes:
    """The MAC of a page file: keyed BLAKE2b over its header fields and its payload."""
    h = hashlib.blake2b(signed, key=key, digest_size=MAC_SIZE, person=_PAGE_PERSON)
    h.update(payload)
    return h.digest()


def pack_header(
    key: int,
    layout: KVLayout,
    payload: bytes | memoryview | np.ndarray,
    mac: bytes,
    shard: tuple[int, int] = (0, 0),
) -> bytes:
    """The header of a page file holding `payload` under `key`, signed with MAC key `mac`;
    `shard` is (rank, tensor-parallel size) of a sharded store, (0, 0) otherwise."""
    signed = SIGNED.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        *shard,
        key,
        *layout.page_shape,
        layout.dtype.encode("ascii"),
        layout.page_bytes,
    )
    return signed + page_mac(mac, signed, payload)


def header_matches(header: bytes, key: int, layout: KVLayout, shard: tuple[int, int]) -> bool:
    """Whether `header` (HEADER_SIZE bytes) is that of a page of `key` in `layout` and `shard`;
    its MAC is checked with the payload (`page_mac`)."""
    magic, version, header_size, rank, count, stored_key, *rest = HEADER.unpack(header)
    shape, dtype, length = tuple(rest[:5]), rest[5], rest[6]
    return (
        magic == MAGIC
        and version == VERSION
        and header_size == HEADER_SIZE
        and (rank, count) == shard
        and stored_key == key
        and shape == layout.page_shape
        and dtype.rstrip(b"\0") == layout.dtype.encode("ascii")
        and length == layout.page_bytes
    )

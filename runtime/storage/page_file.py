"""The page file of the file store (`file_store.py`): a fixed-size header, then the page's bytes
encrypted with AES-256-GCM:

    offset size  field
    0      8     magic b"HICKVPG\\0"
    8      2     format version (3)
    10     2     header size (128)
    12     2     shard rank (0 when unsharded)
    14     2     shard count (0 when unsharded, else the tensor-parallel size)
    16     8     page key
    24     20    page shape, 5 x uint32 (layers, 2, page_size, kv_heads, head_dim)
    44     16    dtype name, ASCII, NUL-padded
    60     8     payload length in bytes
    68     12    nonce, random per write
    80     16    reserved (0)
    96     16    AES-GCM tag
    112    16    reserved (0)

all little-endian; the payload (ciphertext, as long as the page) follows at 128.

Why encrypted: the KV of a page is a function of its tokens (layer 0's V of a token depends on
that token alone), so a readable page gives its prompt back to whoever can match it against
the model. With the payload sealed, a stolen disk, a backup or a mount shared with other users
reveals nothing, and the files are 0600 in 0700 folders besides (`file_store.py`).

The AEAD also does what the MAC of version 2 did: bytes [0, 96) of the header are its associated
data, so a page nobody with the secret wrote — forged, damaged, or in an older format — and a
valid page moved under another key's name, another shard or another layout all fail to open and
read as a miss. The reserved fields must be zero, so every bit of the file is checked.

Keys: HKDF-SHA256 turns the cluster secret into a root key once; each page's AES key is
HKDF-Expand of the root with the page key and shard. A page key is the chained hash of the page's
tokens seeded by its tenant's namespace (`hicache.core.pages.namespace_seed`), so no two tenants
share a key (and no two pages do): a page moved to another tenant's or another page's name fails
its tag. Every key is derived from the cluster secret, which nodes share and disks never hold
unless the operator puts it there.
"""

from __future__ import annotations

import os
import struct

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from hicache.runtime.kv.kv_layout import KVLayout

MAGIC = b"HICKVPG\0"
VERSION = 3
NONCE_SIZE = 12
TAG_SIZE = 16
AAD = struct.Struct("<8sHHHHQ5I16sQ12s16x")  # what the tag authenticates
HEADER = struct.Struct(AAD.format + f"{TAG_SIZE}s16x")
HEADER_SIZE = HEADER.size
SUFFIX = ".kvpage"
_ROOT_SALT = b"hicache-l3-pages"
_ROOT_INFO = b"hicache l3 page encryption v3"
_PAGE_INFO = b"hicache-l3-page"

assert HEADER_SIZE == 128 and AAD.size == 96, HEADER_SIZE


class PageCipher:
    """Seals and opens page payloads with keys derived from one cluster secret."""

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("PageCipher: an empty secret protects nothing")
        hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=_ROOT_SALT, info=_ROOT_INFO)
        self._root = hkdf.derive(secret)

    def _aead(self, key: int, shard: tuple[int, int]) -> AESGCM:
        info = _PAGE_INFO + struct.pack("<QHH", key, *shard)
        return AESGCM(HKDFExpand(algorithm=hashes.SHA256(), length=32, info=info).derive(self._root))

    def seal(
        self,
        key: int,
        layout: KVLayout,
        payload: np.ndarray | memoryview | bytes,
        sealed: np.ndarray,
        shard: tuple[int, int] = (0, 0),
    ) -> bytes:
        """Encrypt `payload` into `sealed` (ciphertext, then the tag: `len(payload) + TAG_SIZE`
        bytes); return the page file's header. `shard` is (rank, tensor-parallel size) of a
        sharded store, (0, 0) otherwise."""
        nonce = os.urandom(NONCE_SIZE)
        aad = _aad(key, layout, shard, nonce)
        self._aead(key, shard).encrypt_into(nonce, payload, aad, sealed)
        return HEADER.pack(*AAD.unpack(aad), bytes(sealed[-TAG_SIZE:]))

    def open_into(
        self,
        header: bytes,
        key: int,
        layout: KVLayout,
        sealed: np.ndarray,
        out: np.ndarray | memoryview,
        shard: tuple[int, int] = (0, 0),
    ) -> bool:
        """Decrypt a page of `key` into `out`: `sealed` holds its ciphertext, followed by room
        for the tag, which is copied there from `header`. False (and `out` must not be used) when
        the header is not that of a page of `key` in `layout` and `shard`, or the tag fails."""
        if len(header) != HEADER_SIZE or header[-16:] != bytes(16):
            return False
        fields = HEADER.unpack(header)
        magic, version, header_size, rank, count, stored_key, *rest = fields
        shape, dtype, length, nonce, tag = tuple(rest[:5]), rest[5], rest[6], rest[7], rest[8]
        if not (
            magic == MAGIC
            and version == VERSION
            and header_size == HEADER_SIZE
            and (rank, count) == shard
            and stored_key == key
            and shape == layout.page_shape
            and dtype.rstrip(b"\0") == layout.dtype.encode("ascii")
            and length == layout.page_bytes
            and header[80:96] == bytes(16)
        ):
            return False
        sealed[-TAG_SIZE:] = np.frombuffer(tag, dtype=np.uint8)
        try:
            self._aead(key, shard).decrypt_into(nonce, sealed, header[: AAD.size], out)
        except InvalidTag:
            return False
        return True


def _aad(key: int, layout: KVLayout, shard: tuple[int, int], nonce: bytes) -> bytes:
    return AAD.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        *shard,
        key,
        *layout.page_shape,
        layout.dtype.encode("ascii"),
        layout.page_bytes,
        nonce,
    )


def page_version(header: bytes) -> int | None:
    """The format version a page file's first bytes announce (None: not a page file)."""
    if len(header) < 10 or header[:8] != MAGIC:
        return None
    return int.from_bytes(header[8:10], "little")

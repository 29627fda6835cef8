"""L3 page stores (installed as `hicache.runtime.storage`): a directory of page files (bounded
or not, sharded per tensor-parallel rank or not) and an in-memory store, behind one
`StorageBackend` protocol. `nixl_store.NixlFileStore`, the file store moving its payloads with
NIXL, is imported from its module only, since it needs the optional nixl package. It may import
`kv` (pages are laid out and copied as pools hold them) and `security` (the cluster secret keys
the page files' encryption), never transfer, tp, a node or serving."""

from hicache.runtime.storage.base import StorageBackend, StoreStats, key_name, key_value
from hicache.runtime.storage.file_store import FileStore
from hicache.runtime.storage.memory_store import MemoryStore

__all__ = ["FileStore", "MemoryStore", "StorageBackend", "StoreStats", "key_name", "key_value"]

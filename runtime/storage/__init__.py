"""L3 page stores (installed as `hicache.runtime.storage`): a directory of page files and an
in-memory store, behind one `StorageBackend` protocol."""

from hicache.runtime.storage.base import StorageBackend, StoreStats, key_name, key_value
from hicache.runtime.storage.file_store import FileStore
from hicache.runtime.storage.memory_store import MemoryStore

__all__ = ["FileStore", "MemoryStore", "StorageBackend", "StoreStats", "key_name", "key_value"]

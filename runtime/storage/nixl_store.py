"""L3 page files whose payloads move through NIXL's POSIX storage backend (DRAM <-> FILE).

The same directory, format, encryption, shards and capacity as `FileStore`, which this subclasses:
only the sealed bytes after each header go through a NIXL transfer (`pip install nixl==1.5.1`, the
`nixl` extra) instead of `read`/`write`, so a deployment whose storage NIXL drives (its POSIX
backend here; GDS or object stores where NIXL has them) keeps one page format, and a page
written by either store reads with the other. Headers, temporaries, renames and eviction stay
plain file-system calls; pages are sealed and opened on the CPU, in a buffer of the worker
thread that NIXL moves.

Each page registers its pool row and its file region, transfers and deregisters them: simple
and safe for pools that come and go, at a fixed cost per page (see BENCHMARKS.md). Transfers of
one store run one at a time (the agent is shared by the store's worker threads), polled to
completion in the worker thread, so the trio loop never waits on NIXL. A NIXL failure is an OS
error to the store: the page reads as a miss or is reported not written.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
from typing import Any

import numpy as np

from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.storage.file_store import FileStore
from hicache.runtime.storage.page_file import HEADER_SIZE

NIXL_REQUIREMENT = "nixl==1.5.1"
_names = itertools.count()


def import_nixl() -> Any:
    """`nixl._api`, or ImportError saying what to install."""
    try:
        import nixl._api as api
    except ImportError as e:
        raise ImportError(
            f"NixlFileStore needs the nixl package (pip install {NIXL_REQUIREMENT}); importing it failed: {e}"
        ) from e
    logging.getLogger("nixl").setLevel(logging.ERROR)  # INFO per backend, warnings per plugin
    return api


class NixlFileStore(FileStore):
    """A `FileStore` (same arguments) moving page payloads with NIXL's POSIX backend."""

    def __init__(self, root: str | os.PathLike[str], layout: KVLayout, **kw: Any) -> None:
        api = import_nixl()
        self._nixl_name = f"hicache-l3-{os.getpid()}-{next(_names)}"
        self._agent = api.nixl_agent(self._nixl_name, api.nixl_agent_config(False, False, 0, backends=[]))
        self._agent.create_backend("POSIX", self._agent.get_plugin_params("POSIX"))
        self._nixl_lock = threading.Lock()
        super().__init__(root, layout, **kw)

    def _read_payload(self, fd: int, out: np.ndarray) -> int:
        self._move("READ", fd, out)
        return out.nbytes

    def _write_payload(self, fd: int, payload: np.ndarray) -> None:
        self._move("WRITE", fd, payload)

    def _move(self, op: str, fd: int, buf: np.ndarray) -> None:
        """One transfer between `buf` (contiguous host memory) and the payload region of `fd`."""
        agent, n, addr = self._agent, buf.nbytes, buf.ctypes.data
        with self._nixl_lock:
            try:
                mem = agent.register_memory([(addr, n, 0, "")], "DRAM")
                try:
                    region = agent.register_memory([(HEADER_SIZE, n, fd, "")], "FILE")
                    try:
                        handle = agent.initialize_xfer(
                            op,
                            agent.get_xfer_descs([(addr, n, 0)], "DRAM"),
                            agent.get_xfer_descs([(HEADER_SIZE, n, fd)], "FILE"),
                            self._nixl_name,
                        )
                        try:
                            state = agent.transfer(handle)
                            while state == "PROC":
                                state = agent.check_xfer_state(handle)
                        finally:
                            agent.release_xfer_handle(handle)
                    finally:
                        agent.deregister_memory(region)
                finally:
                    agent.deregister_memory(mem)
            except Exception as exc:  # NIXL raises its own types (nixlBackendError, ...)
                raise OSError(errno.EIO, f"NIXL POSIX {op} failed: {exc}") from exc
        if state != "DONE":
            raise OSError(errno.EIO, f"NIXL POSIX {op} ended in state {state}")

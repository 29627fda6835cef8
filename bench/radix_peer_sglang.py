"""The SGLang side of bench/radix_bench.py: SGLang's own radix caches on the same workload file.

Run by bench/radix_bench.py in SGLang's virtualenv (``--python``/``--hi-python`` there); it can also
run by hand on a workload file that radix_bench.py wrote (``--keep-workloads DIR`` keeps them)::

    /tmp/sglang-venv/bin/python bench/radix_peer_sglang.py WORKLOAD.npz --impl radix \\
        --page-size 64 --phases offline,online --capacity-tokens 1000000 --out result.json
    /tmp/sglang20-venv/bin/python bench/radix_peer_sglang.py WORKLOAD.npz --impl hiradix \\
        --page-size 64 --phases online --capacity-tokens 1000000 --host-ratio 2 --out hi.json

``--impl radix`` drives ``RadixCache`` (any recent sglang; measured with 0.5.23), ``--impl hiradix``
drives ``HiRadixCache`` (sglang 0.5.20, the last release that ships it) with write-through to a
host pool of ``--host-ratio`` times the device pool.

Why stubs: importing ``sglang.srt.mem_cache.radix_cache`` the normal way pulls in most of SGLang
(transformers, triton, torchvision, CUDA kernels), none of which is on the tree's path. So the
``sglang`` package is registered without running its ``__init__``, and a handful of subpackages
(allocator, memory pool, metrics, server-args context, utils, KV-event classes, kernels; plus
layers, distributed, platforms and sgl_kernel for ``HiRadixCache``) resolve to inert modules. The
tree code itself - ``radix_cache.py``, ``hiradix_cache.py``, ``cache_controller.py``, the host pool,
eviction strategies - is SGLang's, unmodified. For ``HiRadixCache`` a few CPU shims stand in for
CUDA: a 1-layer/1-head/head_dim-1 device pool, plain ``torch.zeros`` for the host buffer instead of
``cudaHostRegister``, ``torch.cpu`` streams and events, an index copy for ``transfer_kv_direct``
and a 1-rank gloo group. What is timed is the tree's bookkeeping plus these tiny copies
(4 bytes per token). torch runs with one intra-op thread: the tree's index operations are
small, and on a busy 2-core machine OpenMP's threads made each one a hundred times slower.

This file needs only the standard library, numpy, torch and sglang (installed ``--no-deps``), so
its helpers are stdlib dataclasses rather than attrs. radix_bench.py imports the workload file
format and the timers from it, so both sides share them; torch and sglang load only when it runs.
"""

from __future__ import annotations

import argparse
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import resource
import sys
import time
import types
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

WORKLOAD_FORMAT = 1
"""Version of the .npz layout below; both sides refuse a file of another version."""

WORKLOAD_FIELDS = (
    "tokens",
    "seg_start",
    "seg_len",
    "req_seg",
    "prompt_len",
    "full_len",
    "arrival",
    "match_order",
)


# ---------------------------------------------------------------------------------------------
# The workload file, shared with radix_bench.py
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Requests as token ids, stored once: request i's sequence is the concatenation of its
    segments of `tokens`, cut to `full_len[i]` (what gets inserted); its prompt is the first
    `prompt_len[i]` tokens. A chat request is one prefix of its conversation; a trace request
    is a list of block rows (so equal block ids give equal tokens on both sides)."""

    name: str
    tokens: np.ndarray  # int32
    seg_start: np.ndarray  # int64, one per segment
    seg_len: np.ndarray  # int64
    req_seg: np.ndarray  # int64, n + 1 offsets into the segments
    prompt_len: np.ndarray  # int64
    full_len: np.ndarray  # int64
    arrival: np.ndarray  # float64 seconds, non-decreasing
    match_order: np.ndarray  # int64 permutation of the requests for the match phase

    @property
    def n(self) -> int:
        return int(self.prompt_len.shape[0])

    def sequence(self, i: int) -> np.ndarray:
        """The `full_len[i]` tokens of request i (a view when it is one segment)."""
        a, b = int(self.req_seg[i]), int(self.req_seg[i + 1])
        end = int(self.full_len[i])
        if b - a == 1:
            start = int(self.seg_start[a])
            return self.tokens[start : start + end]
        parts = [self.tokens[s : s + n] for s, n in zip(self.seg_start[a:b], self.seg_len[a:b], strict=True)]
        return np.concatenate(parts)[:end]

    def save(self, path: Path) -> None:
        arrays = {f: getattr(self, f) for f in WORKLOAD_FIELDS}
        np.savez(path, format=np.int64(WORKLOAD_FORMAT), name=np.str_(self.name), **arrays)

    @classmethod
    def load(cls, path: Path) -> Workload:
        """Read a workload file, naming the file and field of anything missing or malformed."""
        with np.load(path, allow_pickle=False) as data:
            missing = [f for f in ("format", "name", *WORKLOAD_FIELDS) if f not in data.files]
            if missing:
                raise ValueError(f"{path}: not a radix-bench workload, missing fields {missing}")
            if int(data["format"]) != WORKLOAD_FORMAT:
                raise ValueError(
                    f"{path}: field 'format' is {int(data['format'])}, expected {WORKLOAD_FORMAT}"
                )
            w = cls(str(data["name"]), *(data[f] for f in WORKLOAD_FIELDS))
        n = w.n
        for f, size in (("full_len", n), ("arrival", n), ("match_order", n), ("req_seg", n + 1)):
            if getattr(w, f).shape != (size,):
                raise ValueError(f"{path}: field {f!r} has shape {getattr(w, f).shape}, expected ({size},)")
        if np.any(w.prompt_len > w.full_len) or np.any(w.prompt_len < 1):
            raise ValueError(f"{path}: field 'prompt_len' must be in 1..full_len for every request")
        return w


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


_wall = time.perf_counter
_cpu = time.thread_time  # the work of this thread only: other load on the machine does not count


def _clock_overhead(samples: int = 2001) -> float:
    """CPU seconds that one start/stop pair itself adds to a measurement (subtracted)."""
    d = []
    for _ in range(samples):
        c0 = _cpu()
        _wall()
        _wall()
        d.append(_cpu() - c0)
    return float(np.median(d))


CLOCK_OVERHEAD = _clock_overhead()


@dataclass
class Timer:
    """Time spent in one kind of call: CPU seconds of this thread (the figure reported: on a
    shared machine, wall time also counts whoever else ran), wall seconds, count, tokens
    offered, and each call's CPU time. ``cpu=False`` measures wall time only, for a breakdown
    inside a measured stretch (a CPU clock read costs about a microsecond)."""

    cpu: bool = True
    seconds: float = 0.0  # CPU seconds (wall seconds when cpu is False)
    wall_seconds: float = 0.0
    tokens: int = 0
    durations: list[float] = field(default_factory=list)
    _c0: float = 0.0
    _w0: float = 0.0

    def start(self) -> None:
        if self.cpu:
            self._c0 = _cpu()
        self._w0 = _wall()

    def stop(self, tokens: int = 0) -> None:
        w = _wall() - self._w0
        c = max(0.0, _cpu() - self._c0 - CLOCK_OVERHEAD) if self.cpu else w
        self.seconds += c
        self.wall_seconds += w
        self.tokens += tokens
        self.durations.append(c)

    def summary(self) -> dict[str, Any]:
        d = np.asarray(self.durations) if self.durations else np.zeros(1)
        s, calls = self.seconds, len(self.durations)
        return {
            "clock": "cpu" if self.cpu else "wall",
            "calls": calls,
            "seconds": s,
            "wall_seconds": self.wall_seconds,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / s if s else 0.0,
            "wall_tokens_per_s": self.tokens / self.wall_seconds if self.wall_seconds else 0.0,
            "calls_per_s": calls / s if s else 0.0,
            "p50_us": float(np.percentile(d, 50) * 1e6),
            "p99_us": float(np.percentile(d, 99) * 1e6),
            "max_us": float(d.max() * 1e6),
        }


def rss_bytes() -> int:
    """Resident set size now (Linux /proc)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process image (VmHWM: unlike ru_maxrss, it does not
    carry over the parent's peak across fork and exec)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def as_key_array(tokens: np.ndarray) -> array:
    """Tokens as the ``array('q')`` that SGLang's ``RadixKey`` holds (one memcpy)."""
    out = array("q")
    out.frombytes(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    return out


# ---------------------------------------------------------------------------------------------
# Importing SGLang's tree without the rest of SGLang
# ---------------------------------------------------------------------------------------------

RADIX_STUBS = (
    "sglang.srt.mem_cache.allocator",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.observability",
    "sglang.srt.runtime_context",
    "sglang.srt.utils",
    "sglang.srt.disaggregation.kv_events",
    "sglang.kernels",
)
HIRADIX_STUBS = RADIX_STUBS + (
    "sglang.srt.layers",
    "sglang.srt.distributed",
    "sglang.srt.platforms",
    "sgl_kernel",
    "sgl_kernel_npu",
)


class _Inert:
    """Whatever a stubbed module is asked for: callable, subclassable, falsy, and inert."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Inert:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Inert(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> _Inert:
        return _Inert(f"{self._name}()")

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Inert:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Inert(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves the listed subpackages to stub modules, with a few real attributes set."""

    def __init__(self, prefixes: tuple[str, ...], overrides: dict[str, dict[str, Any]]) -> None:
        self.prefixes = prefixes
        self.overrides = overrides

    def find_spec(
        self, name: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if any(name == p or name.startswith(p + ".") for p in self.prefixes):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        for attr, value in self.overrides.get(module.__name__, {}).items():
            setattr(module, attr, value)


def install_stubs(prefixes: tuple[str, ...], overrides: dict[str, dict[str, Any]]) -> None:
    """Register the ``sglang`` package without running its __init__, then the stub finder."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.submodule_search_locations is None:
        raise SystemExit("sglang is not installed in this interpreter; see the module docstring")
    pkg = types.ModuleType("sglang")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    sys.modules["sglang"] = pkg
    sys.meta_path.insert(0, _StubFinder(prefixes, overrides))
    logging.getLogger("sglang").setLevel(logging.ERROR)


# ---------------------------------------------------------------------------------------------
# Device slot allocators (the tree frees into them; they are not the object of the measurement)
# ---------------------------------------------------------------------------------------------


class NullAllocator:
    """For the offline phases: values are views of one index tensor, and nothing is reused."""

    device = "cpu"

    def free(self, indices: Any) -> None:
        pass

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        pass


class SlotAllocator:
    """A device allocator with a capacity, as SGLang's token allocator but with frees batched
    lazily (like its host pool), so that the replay measures the tree rather than a
    ``torch.cat`` of the whole free list on every free."""

    def __init__(self, torch: Any, size: int, kvcache: Any = None) -> None:
        self.torch = torch
        self.size = size
        self.device = "cpu"
        self.page_size = 1
        self._kvcache = kvcache
        self.free_pages = torch.arange(1, size + 1, dtype=torch.int64)
        self.released: list[Any] = []
        self.num_released = 0

    def get_kvcache(self) -> Any:
        return self._kvcache

    def available_size(self) -> int:
        return len(self.free_pages) + self.num_released

    def alloc(self, need: int) -> Any:
        if need > len(self.free_pages) and self.released:
            self.free_pages = self.torch.cat([self.free_pages, *self.released])
            self.released = []
            self.num_released = 0
        if need > len(self.free_pages):
            return None
        out = self.free_pages[:need]
        self.free_pages = self.free_pages[need:]
        return out

    def free(self, indices: Any) -> None:
        if indices.numel():
            self.released.append(indices)
            self.num_released += len(indices)

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        self.free(indices)


# ---------------------------------------------------------------------------------------------
# The two trees
# ---------------------------------------------------------------------------------------------


@dataclass
class Sglang:
    """The imported SGLang names one run needs."""

    torch: Any
    RadixKey: Any
    MatchPrefixParams: Any
    InsertParams: Any
    EvictParams: Any
    CacheInitParams: Any
    RadixCache: Any
    version: str
    HiRadixCache: Any = None
    InitLoadBackParams: Any = None
    fake_pool: Callable[[int], Any] | None = None


def _import_torch() -> Any:
    """torch with one intra-op thread: the tree's index ops are tiny, and on a small shared
    machine OpenMP's spinning threads turned a 0.1 ms index into 15 ms."""
    import torch

    torch.set_num_threads(1)
    return torch


def import_radix() -> Sglang:
    torch = _import_torch()
    install_stubs(RADIX_STUBS, {})
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    return Sglang(
        torch, RadixKey, MatchPrefixParams, InsertParams, EvictParams, CacheInitParams, RadixCache, _version()
    )


def _version() -> str:
    from importlib.metadata import version

    return version("sglang")


def import_hiradix(host_ratio: float) -> Sglang:
    """Import ``HiRadixCache`` with the CPU shims described in the module docstring."""
    torch = _import_torch()

    class FakeMHAPool:
        """The device KV pool HiRadixCache checks for: 1 layer, 1 head, head_dim 1, bf16."""

        def __init__(self, size: int) -> None:
            self.size = size
            self.page_size = 1
            self.device = "cpu"
            self.dtype = self.store_dtype = torch.bfloat16
            self.head_num = self.head_dim = self.v_head_dim = self.layer_num = 1
            self.start_layer, self.end_layer = 0, 1
            self.layer_shard_enabled = False
            self.k_buffer = [torch.zeros(size + 1, 1, 1, dtype=self.dtype)]
            self.v_buffer = [torch.zeros(size + 1, 1, 1, dtype=self.dtype)]
            self.k_data_ptrs = self.v_data_ptrs = None

        def register_layer_transfer_counter(self, counter: object) -> None:
            self.layer_transfer_counter = counter

    def other_pool(name: str) -> type:
        return type(name, (), {})

    memory = SimpleNamespace(
        hicache_ratio=host_ratio,
        hicache_size=0,
        hicache_mem_layout="layer_first",
        hicache_write_policy="write_through",
        hicache_io_backend="direct",
        hicache_storage_backend=None,
        hicache_storage_backend_extra_config=None,
        hicache_storage_prefetch_policy="best_effort",
    )
    pools = {
        n: other_pool(n)
        for n in (
            "MHATokenToKOnlyPool",
            "DSATokenToKVPool",
            "MiniMaxSparseKVPool",
            "MLATokenToKVPool",
            "HybridLinearKVPool",
            "MambaPool",
        )
    }
    overrides: dict[str, dict[str, Any]] = {
        "sglang.srt.utils": {"get_device_module": lambda: torch.cpu},
        "sglang.srt.mem_cache.memory_pool": {
            "MHATokenToKVPool": FakeMHAPool,
            "KVCache": FakeMHAPool,
            **pools,
        },
        "sglang.srt.runtime_context": {
            "get_memory": lambda: memory,
            "get_parallel": lambda: SimpleNamespace(nnodes=1, attn_dcp_size=1, attn_dcp_rank=0),
            "get_serving": lambda: SimpleNamespace(served_model_name="radix-bench"),
            "get_observability": lambda: SimpleNamespace(extra_metric_labels=None, enable_metrics=False),
        },
        "sglang.srt.distributed.parallel_state": {"get_world_group": lambda: SimpleNamespace(world_size=1)},
    }
    install_stubs(HIRADIX_STUBS, overrides)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
        )

    import sglang.srt.mem_cache.pool_host.common as host_common
    import sglang.srt.mem_cache.pool_host.mha as host_mha

    def host_buffer(dims: tuple[int, ...], dtype: Any, device: str, **_: object) -> Any:
        return torch.zeros(dims, dtype=dtype, device=device)

    def transfer_kv_direct(
        src_layers: list[Any], dst_layers: list[Any], src_indices: Any, dst_indices: Any, page_size: int
    ) -> None:
        for src, dst in zip(src_layers, dst_layers, strict=True):
            dst[dst_indices] = src[src_indices]

    host_common.ALLOC_MEMORY_FUNCS.default_factory = lambda: host_buffer
    host_mha.ALLOC_MEMORY_FUNCS.default_factory = lambda: host_buffer
    host_mha.transfer_kv_direct = transfer_kv_direct

    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    return Sglang(
        torch,
        RadixKey,
        MatchPrefixParams,
        InsertParams,
        EvictParams,
        CacheInitParams,
        RadixCache,
        _version(),
        HiRadixCache=HiRadixCache,
        InitLoadBackParams=InitLoadBackParams,
        fake_pool=FakeMHAPool,
    )


def make_radix(sg: Sglang, allocator: Any, page_size: int) -> Any:
    params = sg.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=page_size
    )
    return sg.RadixCache(params)


def device_prefix(cache: Any, match: Any) -> Any:
    """The matched prefix's device indices: 0.5.20 returns them, 0.5.23 builds them on demand."""
    indices = getattr(match, "device_indices", None)
    if indices is not None:
        return indices
    return cache.path_device_indices(match.last_device_node)


def matched_len(match: Any) -> int:
    n = getattr(match, "device_prefix_len", None)
    return int(n) if n is not None else len(match.device_indices)


# ---------------------------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------------------------


def keys(sg: Sglang, w: Workload, order: Iterator[int] | range, prompt: bool) -> Iterator[tuple[Any, int]]:
    """(RadixKey, tokens offered) of each request in `order`; built outside the timing."""
    for i in order:
        seq = w.sequence(i)
        n = int(w.prompt_len[i]) if prompt else len(seq)
        yield sg.RadixKey(as_key_array(seq[:n])), n


def run_offline(sg: Sglang, w: Workload, page_size: int, evict_chunk: int) -> dict[str, Any]:
    """Insert every sequence, match every prompt, then evict everything; and the tree's memory."""
    torch = sg.torch
    values = torch.arange(int(w.full_len.max()) + 1, dtype=torch.int64)
    gc.collect()
    rss0 = rss_bytes()
    cache = make_radix(sg, NullAllocator(), page_size)
    insert = Timer()
    for key, n in keys(sg, w, range(w.n), prompt=False):
        params = sg.InsertParams(key=key, value=values[:n])
        insert.start()
        cache.insert(params)
        insert.stop(n)
    gc.collect()
    held = int(cache.total_size())
    rss_delta = rss_bytes() - rss0

    match = Timer()
    hit = 0
    for key, n in keys(sg, w, (int(i) for i in w.match_order), prompt=True):
        params = sg.MatchPrefixParams(key=key)
        match.start()
        m = cache.match_prefix(params)
        match.stop(n)
        hit += matched_len(m)

    evict = Timer()
    params = sg.EvictParams(num_tokens=evict_chunk)
    while cache.evictable_size() > 0:
        evict.start()
        r = cache.evict(params)
        evict.stop(r.num_tokens_evicted)
        if r.num_tokens_evicted == 0:
            break
    return {
        "insert": insert.summary(),
        "match": {**match.summary(), "hit_tokens": hit},
        "evict": {**evict.summary(), "left_tokens": int(cache.total_size())},
        "memory": {
            "tokens_held": held,
            "rss_delta_bytes": rss_delta,
            "bytes_per_token": rss_delta / held if held else 0.0,
        },
    }


def run_online(
    sg: Sglang, w: Workload, page_size: int, capacity: int, hierarchical: bool, host_ratio: float
) -> dict[str, Any]:
    """Requests in arrival order: match, (load back from host), lock, evict to fit, insert, unlock."""
    torch = sg.torch
    empty = torch.empty((0,), dtype=torch.int64)
    if hierarchical:
        assert sg.fake_pool is not None
        allocator = SlotAllocator(torch, capacity, sg.fake_pool(capacity))
        params = sg.CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
            tp_cache_group=torch.distributed.group.WORLD,
        )
        cache = sg.HiRadixCache(params, server_args=None)
        host_tokens = int(cache.token_to_kv_pool_host.size)
    else:
        allocator = SlotAllocator(torch, capacity)
        cache = make_radix(sg, allocator, page_size)
        host_tokens = 0
    # A breakdown of each request's time (wall clock; the request's total is CPU time).
    ops = ("match", "load_back", "lock", "evict", "alloc", "insert", "events")
    t = {k: Timer(cpu=False) for k in ops}
    total = Timer()
    prompt_tokens = device_hit = host_hit = rejected = 0
    for i in range(w.n):
        seq = w.sequence(i)
        n_prompt = int(w.prompt_len[i])
        n_full = len(seq) // page_size * page_size
        prompt_key = sg.RadixKey(as_key_array(seq[:n_prompt]))
        full_key = sg.RadixKey(as_key_array(seq[:n_full]))
        prompt_tokens += n_prompt
        total.start()
        t["match"].start()
        m = cache.match_prefix(sg.MatchPrefixParams(key=prompt_key))
        prefix = device_prefix(cache, m)
        node = m.last_device_node
        t["match"].stop(n_prompt)
        device_hit += len(prefix)
        loaded = empty
        if hierarchical and m.host_hit_length > 0:
            t["load_back"].start()
            got = cache.init_load_back(
                sg.InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length)
            )
            if got is not None and len(got[0]) > 0:
                loaded, node = got
                cache.ready_to_load_host_cache()
            t["load_back"].stop(len(loaded))
            host_hit += len(loaded)
        t["lock"].start()
        cache.inc_lock_ref(node)
        t["lock"].stop()
        have = len(prefix) + len(loaded)
        need = n_full - have
        if need > allocator.available_size():
            t["evict"].start()
            r = cache.evict(sg.EvictParams(num_tokens=need - allocator.available_size()))
            t["evict"].stop(r.num_tokens_evicted)
        t["alloc"].start()
        new = allocator.alloc(need)
        t["alloc"].stop()
        t["insert"].start()
        if new is not None:
            value = torch.cat([prefix, loaded, new])
            r = cache.insert(sg.InsertParams(key=full_key, value=value))
            if r.prefix_len > have:  # pages someone else cached meanwhile: ours are duplicates
                allocator.free(value[have : r.prefix_len])
        t["insert"].stop(n_full)
        if hierarchical:
            t["events"].start()
            cache.check_hicache_events()  # acks the write-through backups and the load-back
            t["events"].stop()
        t["lock"].start()
        cache.dec_lock_ref(node)
        t["lock"].stop()
        total.stop()
        if new is None:
            rejected += 1
    return {
        "requests": w.n,
        "seconds": total.seconds,
        "wall_seconds": total.wall_seconds,
        "req_per_s": w.n / total.seconds if total.seconds else 0.0,
        "wall_req_per_s": w.n / total.wall_seconds if total.wall_seconds else 0.0,
        "request_p50_us": total.summary()["p50_us"],
        "request_p99_us": total.summary()["p99_us"],
        "prompt_tokens": prompt_tokens,
        "device_hit_tokens": device_hit,
        "host_hit_tokens": host_hit,
        "hit_ratio": (device_hit + host_hit) / prompt_tokens if prompt_tokens else 0.0,
        "rejected": rejected,
        "device_tokens": capacity,
        "host_tokens": host_tokens,
        "ops": {k: v.summary() for k, v in t.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", type=Path, help="a .npz written by radix_bench.py")
    parser.add_argument("--impl", choices=("radix", "hiradix"), default="radix")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--phases", default="offline,online", help="comma list of offline, online")
    parser.add_argument("--capacity-tokens", type=int, default=1_000_000, help="device tokens (online)")
    parser.add_argument("--host-ratio", type=float, default=2.0, help="host pool / device pool (hiradix)")
    parser.add_argument("--evict-chunk", type=int, default=4096, help="tokens per evict call (offline)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON (default: stdout)")
    args = parser.parse_args(argv)
    phases = set(args.phases.split(","))
    if not phases <= {"offline", "online"} or args.page_size < 1 or args.capacity_tokens < 1:
        parser.error("--phases takes offline and/or online; --page-size and --capacity-tokens must be >= 1")
    if args.impl == "hiradix" and "offline" in phases:
        parser.error("--impl hiradix runs the online phase only")

    w = Workload.load(args.workload)
    sg = import_hiradix(args.host_ratio) if args.impl == "hiradix" else import_radix()
    label = "HiRadixCache" if args.impl == "hiradix" else "RadixCache"
    result: dict[str, Any] = {
        "impl": f"{label} {sg.version}",
        "workload": w.name,
        "page_size": args.page_size,
        "requests": w.n,
    }
    if "offline" in phases:
        result["offline"] = run_offline(sg, w, args.page_size, args.evict_chunk)
    if "online" in phases:
        result["online"] = run_online(
            sg, w, args.page_size, args.capacity_tokens, args.impl == "hiradix", args.host_ratio
        )
    result["peak_rss_bytes"] = peak_rss_bytes()
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Every setting of a decode node's cache, storage and transfers as one table of flags.

`hicache node decode`, `hicache serve` and `hicache run --runtime` all take their decode node's
settings from here: the node parses the flags (`add_flags`, `decode_config`), `serve` passes on
the ones its user gave (`forwarded`), and a scenario becomes the same flags (`scenario_flags`), so
a setting a scenario can state cannot be dropped on its way to a real node. Each flag has our name
and, where SGLang has one, SGLang's (`--hicache-ratio`, `--hicache-write-policy`,
`--radix-eviction-policy`, ...), so a command line written for SGLang's decode server works here.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from hicache.arg_types import directory, float_above, int_in
from hicache.core.config import PREFETCH_POLICIES, PROMISE_POLICIES, RETRACT_POLICIES, DecodeConfig
from hicache.core.eviction import EVICTION_POLICIES
from hicache.core.write_policy import WritePolicy
from hicache.scenarios.scenario import CacheSpec, Scenario

WRITE_POLICIES = tuple(p.value for p in WritePolicy)
STORAGE_BACKENDS = ("file", "nixl", "memory", "none")
# SGLang's file backend keeps its pages here unless told otherwise.
SGLANG_FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
SGLANG_FILE_DIR_DEFAULT = Path("/tmp/hicache")
# The keys of SGLang's --hicache-storage-backend-extra-config that are settings of ours.
EXTRA_CONFIG_KEYS = {
    "prefetch_threshold": "prefetch_threshold_tokens",
    "prefetch_timeout_base": "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token": "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max": "prefetch_timeout_max",
}
_CORE = DecodeConfig(l1_pages=1, l2_pages=0)  # the core's defaults
MAX_LAYER_GROUPS = 4096  # a prefill node's --layer-groups for "one group per layer"


@attrs.frozen
class Flag:
    """One setting: our flag, SGLang's names for it, how it parses and what it sets.

    `dest` is the `DecodeConfig` field it sets (or, for the few that are not core fields, the
    name `decode_config` and the node read it by); `scenario` is where a scenario states it
    (`CacheSpec` field, or "section.key")."""

    flag: str
    dest: str
    kind: Callable[[str], Any]
    default: Any
    help: str
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    scenario: str | None = None
    default_text: str | None = None  # how --help states the default, when not by its value

    def add_to(self, group: argparse._ActionsContainer) -> None:
        default = self.default_text or (
            f"{self.default:g}" if isinstance(self.default, float) else self.default
        )
        group.add_argument(
            self.flag,
            *self.aliases,
            dest=self.dest,
            type=self.kind,
            default=self.default,
            choices=self.choices,
            metavar=self.metavar,
            help=f"{self.help} (default: {default})" if self.help else None,
        )


def _core(field: str, kind: Callable[[str], Any], help: str, **kw: Any) -> Flag:
    """A flag that sets the core field `field`, defaulting to the core's own default."""
    flag = "--" + field.replace("_", "-")
    return Flag(flag, field, kind, getattr(_CORE, field), help, **{"scenario": field, **kw})


def _policy(field: str, names: tuple[str, ...], help: str, **kw: Any) -> Flag:
    default = getattr(_CORE, field)
    return Flag(
        kw.pop("flag", "--" + field.replace("_", "-")),
        field,
        str,
        str(getattr(default, "value", default)),
        help,
        choices=names,
        scenario=field,
        **kw,
    )


def gigabytes(text: str) -> float:
    """SGLang's --hicache-size: GB of host memory per rank, 0 for none (then the ratio rules)."""
    return float_above(0, inclusive=True)(text)


CACHE_FLAGS: tuple[Flag, ...] = (
    Flag("--l1-pages", "l1_pages", int_in(1), 1024, "GPU (L1) pool pages", metavar="N"),
    Flag(
        "--l2-pages",
        "l2_pages",
        int_in(0),
        None,
        "host-memory (L2) pool pages; overrides --hicache-ratio and --hicache-size",
        metavar="N",
        default_text="--hicache-ratio x --l1-pages",
    ),
    Flag(
        "--hicache-ratio",
        "hicache_ratio",
        float_above(0, inclusive=True),
        2.0,
        "L2 pages as a multiple of L1 pages (SGLang's name)",
        metavar="X",
        scenario="hicache_ratio",
    ),
    Flag(
        "--hicache-size",
        "hicache_size_gb",
        gigabytes,
        0.0,
        "L2 in GB of host memory, per rank; overrides --hicache-ratio when > 0 (SGLang's name)",
        metavar="GB",
    ),
    _policy(
        "eviction",
        tuple(EVICTION_POLICIES),
        "which tree leaves go first",
        aliases=("--radix-eviction-policy",),
    ),
    _policy(
        "write_policy",
        WRITE_POLICIES,
        "when L1 pages are backed up to L2 (and on to L3)",
        aliases=("--hicache-write-policy",),
    ),
    _policy("promise", PROMISE_POLICIES, "which cached tiers a request is promised to restore locally"),
    _policy(
        "prefetch_policy",
        PREFETCH_POLICIES,
        "when an L3 prefetch stops",
        aliases=("--hicache-storage-prefetch-policy",),
    ),
    _core(
        "prefetch_threshold_tokens",
        int_in(0),
        "fewer L3 hit tokens than this are not prefetched",
        metavar="N",
    ),
    _core(
        "prefetch_timeout_base",
        float_above(0, inclusive=True),
        "a timeout prefetch's base seconds",
        metavar="S",
    ),
    _core(
        "prefetch_timeout_per_ki_token",
        float_above(0, inclusive=True),
        "seconds added per 1,024 tokens",
        metavar="S",
    ),
    _core("prefetch_timeout_max", float_above(0, inclusive=True), "a timeout prefetch's cap", metavar="S"),
    _core("load_batches_in_flight", int_in(1), "L2 -> L1 load-back batches at once", metavar="N"),
    _core(
        "decode_reserve_tokens",
        int_in(0),
        "L1 tokens held back per request for its output",
        aliases=("--num-reserved-decode-tokens",),
        metavar="N",
    ),
    _policy("retract_policy", RETRACT_POLICIES, "which running request leaves L1 when it is full"),
    Flag(
        "--max-running",
        "max_running",
        int_in(0),
        0,
        "requests in the decode batch at once, 0: no limit",
        aliases=("--max-running-requests",),
        metavar="N",
        scenario="cluster.max_running",
    ),
    Flag(
        "--tick-interval",
        "tick_interval",
        float_above(0),
        0.002,
        "seconds between the core's ticks",
        metavar="S",
        scenario="cluster.tick_interval",
    ),
)

TRANSFER_FLAGS: tuple[Flag, ...] = (
    Flag(
        "--transfer-retries",
        "transfer_retries",
        int_in(0),
        6,
        "retries of a failed prefill transfer (with the backoff, about 6-11 s: a prefill restart)",
        metavar="N",
        scenario="transfer_retries",
    ),
    Flag(
        "--transfer-backoff",
        "transfer_backoff_s",
        float_above(0, inclusive=True),
        0.2,
        "delay before the first retry, doubling per retry, jittered to 50-100%%",
        metavar="SECONDS",
        scenario="transfer_backoff_s",
    ),
    Flag(
        "--transfer-backoff-max",
        "transfer_backoff_max_s",
        float_above(0, inclusive=True),
        5.0,
        "longest delay between two retries",
        metavar="SECONDS",
        scenario="transfer_backoff_max_s",
    ),
)

# What the `adaptive` promise weighs a restore with: estimates of this machine's speeds.
ESTIMATE_FLAGS: tuple[Flag, ...] = (
    _core("l3_bandwidth", float_above(0), "L3 read bytes/s", metavar="B/S", scenario="storage.bandwidth"),
    _core(
        "l3_latency",
        float_above(0, inclusive=True),
        "L3 seconds per operation",
        metavar="S",
        scenario="storage.latency",
    ),
    _core(
        "host_to_device_bandwidth",
        float_above(0),
        "L2 -> L1 bytes/s",
        metavar="B/S",
        aliases=("--host-bandwidth",),
        scenario="hardware.host_bandwidth",
    ),
    _core(
        "network_bandwidth",
        float_above(0),
        "P->D bytes/s",
        metavar="B/S",
        scenario="hardware.network_bandwidth",
    ),
    _core(
        "network_latency",
        float_above(0, inclusive=True),
        "P->D seconds per transfer",
        metavar="S",
        scenario="hardware.network_latency",
    ),
    _core(
        "transfer_groups",
        int_in(0),
        "layer groups the prefill node streams KV in (its --layer-groups); 0: sent after prefill",
        metavar="G",
        scenario="cluster.layerwise_transfer",
    ),
    _core("prefill_tokens_per_s", float_above(0), "prefill's tokens/s", metavar="N", scenario=None),
    _core(
        "prefill_attention_seconds",
        float_above(0, inclusive=True),
        "prefill seconds per (new, earlier) token pair",
        metavar="S",
        scenario=None,
    ),
)

ALL_FLAGS = CACHE_FLAGS + TRANSFER_FLAGS + ESTIMATE_FLAGS


def extra_config(text: str) -> dict[str, Any]:
    """SGLang's --hicache-storage-backend-extra-config: a JSON object, or @FILE holding one."""
    source = text
    if text.startswith("@"):
        try:
            source = Path(text[1:]).read_text()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]!r}: {exc.strerror}") from None
    try:
        doc = json.loads(source)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object: {exc}") from None
    if not isinstance(doc, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(doc).__name__}")
    return doc


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The decode node's cache, storage, transfer and estimate flags, in groups for --help."""
    cache = parser.add_argument_group("the decode cache (a scenario's [cache] section)")
    for f in CACHE_FLAGS:
        f.add_to(cache)
    cache.add_argument(
        "--no-decode-cache",
        "--disable-radix-cache",
        dest="no_decode_cache",
        action="store_true",
        help="no decode-side cache at all: every prompt's KV comes from prefill (the baseline); "
        "implies --no-storage and no L2",
    )
    storage = parser.add_argument_group("L3 storage (a scenario's [storage] section)")
    storage.add_argument(
        "--hicache-storage-backend",
        dest="storage_backend",
        choices=STORAGE_BACKENDS,
        default=None,
        help="file: pages in --storage-dir (else $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else "
        "/tmp/hicache, as SGLang); nixl: the same files, moved by NIXL's POSIX backend; memory: "
        "this process only; none: no L3 (default: file with --storage-dir, else memory)",
    )
    storage.add_argument(
        "--storage-dir", type=directory, default=None, metavar="DIR", help="the L3 file store's folder"
    )
    storage.add_argument(
        "--storage-capacity",
        type=byte_size,
        default=0,
        metavar="SIZE",
        help="most bytes of L3 pages, e.g. 64GiB; past it the least used are evicted (one budget for "
        "every node on the same --storage-dir) (default 0: unbounded)",
    )
    storage.add_argument(
        "--no-storage", action="store_true", help="no L3 at all (--hicache-storage-backend none)"
    )
    storage.add_argument(
        "--hicache-storage-backend-extra-config",
        dest="extra_config",
        type=extra_config,
        default=None,
        metavar="JSON|@FILE",
        help="SGLang's storage options; of its keys, "
        + ", ".join(EXTRA_CONFIG_KEYS)
        + " set the prefetch flags above (an explicit flag wins)",
    )
    transfer = parser.add_argument_group("P->D transfers")
    for f in TRANSFER_FLAGS:
        f.add_to(transfer)
    estimates = parser.add_argument_group("what the adaptive promise estimates a restore with")
    for f in ESTIMATE_FLAGS:
        f.add_to(estimates)


def byte_size(text: str) -> int:
    """An argparse `type` for sizes in bytes: 4096, 512MiB, 64GiB."""
    from hicache.runtime.storage.sizes import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class SettingsError(ValueError):
    """Flags that cannot go together, or a bad key in the extra config; names the flag."""


def _defaults() -> dict[str, Any]:
    return {f.dest: f.default for f in ALL_FLAGS}


def storage_kind(args: argparse.Namespace) -> tuple[str, Path | None]:
    """("file" or "nixl", folder), ("memory", None) or ("none", None), from the storage flags."""
    backend = args.storage_backend
    if args.no_storage or args.no_decode_cache:
        if backend not in (None, "none"):
            flag = "--no-storage" if args.no_storage else "--no-decode-cache"
            raise SettingsError(f"--hicache-storage-backend {backend}: contradicts {flag}")
        return "none", None
    if backend == "none":
        return "none", None
    if backend == "memory":
        if args.storage_dir is not None:
            raise SettingsError("--storage-dir: not used by --hicache-storage-backend memory")
        return "memory", None
    if backend in ("file", "nixl") or args.storage_dir is not None:
        folder = args.storage_dir
        if folder is None:
            folder = Path(os.environ.get(SGLANG_FILE_DIR_ENV) or SGLANG_FILE_DIR_DEFAULT)
        return backend or "file", folder
    return "memory", None


def decode_config(args: argparse.Namespace, page_bytes: int | None = None) -> DecodeConfig:
    """The core's configuration from parsed flags. --hicache-size needs `page_bytes` (bytes of
    one KV page, known once the model is loaded): without it L2 follows the ratio, and the node
    sizes it again (`l2_gigabytes`)."""
    values = {f.dest: getattr(args, f.dest) for f in ALL_FLAGS}
    if args.extra_config:
        # Its backend-specific keys (a Mooncake master's address, ...) are not ours: ignored.
        for key, dest in EXTRA_CONFIG_KEYS.items():
            if key in args.extra_config and values[dest] == _defaults()[dest]:
                kind = next(f.kind for f in ALL_FLAGS if f.dest == dest)
                try:
                    values[dest] = kind(str(args.extra_config[key]))
                except argparse.ArgumentTypeError as exc:
                    raise SettingsError(f"--hicache-storage-backend-extra-config {key}: {exc}") from None
    off = args.no_decode_cache
    kind, _ = storage_kind(args)
    l1 = values.pop("l1_pages")
    l2 = values.pop("l2_pages")
    ratio = values.pop("hicache_ratio")
    size_gb = values.pop("hicache_size_gb")
    if l2 is None:
        if size_gb > 0 and page_bytes is not None:
            l2 = int(size_gb * 1e9 // page_bytes)
        else:
            l2 = int(ratio * l1)
    values.pop("tick_interval")  # the node's, not the core's
    return DecodeConfig(
        l1_pages=l1,
        l2_pages=0 if off else l2,
        page_size=args.page_size,
        storage=kind != "none",
        radix=not off,
        **values,
    )


def l2_gigabytes(args: argparse.Namespace) -> float:
    """GB of L2 the node sizes its pool to once it knows a page's bytes (0: as configured)."""
    return 0.0 if args.l2_pages is not None or args.no_decode_cache else args.hicache_size_gb


def forwarded(args: argparse.Namespace) -> list[str]:
    """The flags of this table that differ from their defaults, as a command line again (what
    `hicache serve` passes on to the decode node it starts)."""
    out: list[str] = []
    for f in ALL_FLAGS:
        value = getattr(args, f.dest)
        if value != f.default and value is not None:
            out += [f.flag, _text(value)]
    if args.no_decode_cache:
        out.append("--no-decode-cache")
    if args.no_storage:
        out.append("--no-storage")
    if args.storage_backend is not None:
        out += ["--hicache-storage-backend", args.storage_backend]
    if args.storage_dir is not None:
        out += ["--storage-dir", str(args.storage_dir)]
    if args.storage_capacity:
        out += ["--storage-capacity", str(args.storage_capacity)]
    if args.extra_config:
        out += ["--hicache-storage-backend-extra-config", json.dumps(args.extra_config)]
    return out


def _text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def scenario_flags(scenario: Scenario, l1_tokens: int, token_bytes: int = 0) -> list[str]:
    """A scenario's cache, storage and transfer settings as decode-node flags (L1 given in
    tokens: the runtime's L1 is not the scenario's modelled GPU; `token_bytes`, the runtime
    model's KV bytes per token, sizes `storage.capacity_tokens`). Every `CacheSpec` field and
    every flag with a `scenario` source is carried; `tests/test_cache_flags.py` checks that none
    is dropped."""
    c = scenario.cache
    page = c.page_size
    l1 = max(1, l1_tokens // page)
    out = [
        "--page-size",
        str(page),
        "--l1-pages",
        str(l1),
        "--l2-pages",
        str(c.l2_tokens_for(l1 * page) // page),
    ]
    for f in ALL_FLAGS:
        if f.scenario is None or f.dest in ("l1_pages", "l2_pages", "hicache_ratio"):
            continue
        value = _scenario_value(scenario, f.scenario)
        if value is None:  # a hardware figure left to the preset: the core's estimate stands
            continue
        out += [f.flag, _text(getattr(value, "value", value))]
    if scenario.storage.capacity_tokens and token_bytes:
        out += ["--storage-capacity", str(scenario.storage.capacity_tokens * token_bytes)]
    return out


def layer_groups(scenario: Scenario) -> int:
    """The layer groups a scenario's prefill node streams KV in (`cluster.layerwise_transfer`;
    `transfer_groups` 0: one per layer), which the decode node's estimates must assume too."""
    cl = scenario.cluster
    return (cl.transfer_groups or MAX_LAYER_GROUPS) if cl.layerwise_transfer else 0


def _scenario_value(scenario: Scenario, where: str) -> Any:
    if where == "cluster.layerwise_transfer":
        return layer_groups(scenario)
    if where == "hardware.network_bandwidth" and scenario.hardware.transfer_rate is not None:
        return scenario.hardware.transfer_rate  # one transfer's rate is what a restore competes with
    if "." in where:
        section, key = where.split(".")
        return getattr(getattr(scenario, section), key)
    return getattr(scenario.cache, where)


def cache_spec_fields_without_flag() -> list[str]:
    """`CacheSpec` fields no flag carries (`tests/test_cache_flags.py` wants none)."""
    carried = {f.scenario for f in ALL_FLAGS} | {"l1_tokens", "l2_tokens", "page_size"}
    return [a.name for a in attrs.fields(CacheSpec) if a.name not in carried]

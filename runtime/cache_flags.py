"""Every setting of a decode node's cache, storage and transfers as one table of flags.

`hicache node decode`, `hicache serve` and `hicache run --runtime` all take their decode node's
settings from here: the node parses the flags (`add_flags`, `decode_config`), `serve` passes on
the ones its user gave (`forwarded`), and a scenario becomes the same flags (`scenario_flags`), so
a setting a scenario can state cannot be dropped on its way to a real node. Each flag has our name
and, where SGLang has one, SGLang's (`--hicache-ratio`, `--hicache-write-policy`,
`--radix-eviction-policy`, ...), so a command line written for SGLang's decode server works here.

The flags of the core's settings are not written out here: they are made (`Flag.of`) from each
setting's description in the core (`DecodeConfig`'s field metadata, and `L2_SIZE` for the inputs
of `l2_pages`), which says their names, help, bounds, choices and defaults. What this module
writes out is what is the node's own: --tick-interval, --prefill-silence-timeout, the storage
flags, --no-decode-cache and SGLang's extra config.
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
from hicache.core.config import L2_SIZE, DecodeConfig, decode_settings, l2_pages
from hicache.core.settings import CACHE, ESTIMATE, TRANSFER, Setting
from hicache.core.write_policy import WritePolicy
from hicache.scenarios.scenario import CACHE_SETTINGS, Scenario

WRITE_POLICIES = tuple(p.value for p in WritePolicy)
STORAGE_BACKENDS = ("file", "nixl", "memory", "none")
# SGLang's file backend keeps its pages here unless told otherwise.
SGLANG_FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
SGLANG_FILE_DIR_DEFAULT = Path("/tmp/hicache")
MAX_LAYER_GROUPS = 4096  # a prefill node's --layer-groups for "one group per layer"
# --help's groups of the flags described in the core (`Setting.group`); NODE's flags (--page-size,
# --tp-size) are placed by the CLI beside the node's own.
GROUP_TITLES = {
    CACHE: "the decode cache (a scenario's [cache] section)",
    TRANSFER: "P->D transfers",
    ESTIMATE: "what the adaptive promise estimates a restore with",
}


@attrs.frozen
class Flag:
    """One setting: our flag, SGLang's names for it, how it parses and what it sets.

    `dest` is the `DecodeConfig` field it sets (or, for the few that are not core fields, the
    name `decode_config` and the node read it by); `scenario` is where a scenario states it
    ("section.key")."""

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
    group: str | None = CACHE
    sglang_note: str = ""  # what --help says of SGLang's names for it

    @classmethod
    def of(cls, s: Setting) -> Flag:
        """The flag of a setting described in the core, parsed to what the core accepts."""
        assert s.flag is not None, s.name
        if s.kind is int:
            kind: Callable[[str], Any] = int_in(int(s.low or 0))
        elif s.kind is float:
            kind = float_above(s.low or 0, inclusive=True)
        else:
            kind = str
        sglang = [n for n in s.sglang if n != s.flag]
        note = (
            " (SGLang's name)" if s.flag in s.sglang else f" (SGLang: {', '.join(sglang)})" if sglang else ""
        )
        return cls(
            s.flag,
            s.name,
            kind,
            s.flag_default,
            s.help,
            aliases=s.flags[1:],
            choices=s.choices,
            metavar=s.metavar,
            scenario=s.scenario,
            default_text=s.default_text,
            group=s.group,
            sglang_note=note,
        )

    def add_to(self, group: argparse._ActionsContainer, help: str | None = None) -> None:
        """Add the flag to a parser or group (`help`: other wording for this command's --help)."""
        default = self.default_text or (
            f"{self.default:g}" if isinstance(self.default, float) else self.default
        )
        text = ((help or self.help) + self.sglang_note).replace("%", "%%")  # argparse formats help with %
        group.add_argument(
            self.flag,
            *self.aliases,
            dest=self.dest,
            type=self.kind,
            default=self.default,
            choices=self.choices,
            metavar=self.metavar,
            help=f"{text} (default: {default})",
        )


def _settings() -> dict[str, Setting]:
    """Every setting described in the core that has a flag, in --help's order: the decode
    config's fields, with the other inputs of `l2_pages` (--hicache-ratio, --hicache-size)
    right after --l2-pages."""
    out = {}
    for name, s in decode_settings().items():
        out[name] = s
        if name == "l2_pages":
            out |= L2_SIZE
    return {name: s for name, s in out.items() if s.flag is not None}


SETTINGS: dict[str, Setting] = _settings()
# The node's own flag that is not a core setting: how often its core ticks.
TICK_INTERVAL = Flag(
    "--tick-interval",
    "tick_interval",
    float_above(0),
    0.002,
    "seconds between the core's ticks",
    metavar="S",
    scenario="cluster.tick_interval",
)
# The node's own: how long prefill may say nothing of a transfer. Prefill reports each chunk it
# computes (and a queued prompt's place after every step), so this bounds silence, not the time
# a long prompt or a busy prefill node takes; one step of the default model on a busy 2-core
# machine is seconds, so a minute of silence means prefill is gone or stuck.
PREFILL_SILENCE = Flag(
    "--prefill-silence-timeout",
    "prefill_silence_s",
    float_above(0),
    60.0,
    "seconds prefill may say nothing of a transfer (no progress, no answer) before the node gives "
    "it up, cancels it on prefill and retries; never a bound on how long prefill takes",
    metavar="S",
    group=TRANSFER,
)
# The flags `add_flags` adds and `decode_config` reads, in --help's order.
ALL_FLAGS: tuple[Flag, ...] = (
    *(Flag.of(s) for s in SETTINGS.values() if s.group in GROUP_TITLES),
    TICK_INTERVAL,
    PREFILL_SILENCE,
)
# The keys of SGLang's --hicache-storage-backend-extra-config that are settings of ours.
EXTRA_CONFIG_KEYS = {s.sglang_extra_config: s.name for s in SETTINGS.values() if s.sglang_extra_config}


def flag(name: str) -> Flag:
    """The flag of core setting `name` (the CLI places --page-size and --tp-size with it)."""
    return Flag.of(SETTINGS[name])


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
    cache = _group(parser, CACHE)
    cache.add_argument(
        "--max-total-tokens",
        type=int_in(1),
        default=0,
        metavar="N",
        help="size L1 to hold N tokens of KV instead of --l1-pages (SGLang's name); L2 follows at "
        "--hicache-ratio (default: --l1-pages)",
    )
    cache.add_argument(
        "--mem-fraction-static",
        type=fraction,
        default=0.0,
        metavar="F",
        help="size L1 from memory instead of --l1-pages (SGLang's name): weights and L1 may take this "
        "share of the machine's memory (the GPU's, with one); L1 gets what is available once the model "
        "is loaded, less 1-F of the total; with --max-total-tokens, the smaller (default: --l1-pages)",
    )
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
        "this process only (bounded by --storage-capacity); none: no L3 (default: file with "
        "--storage-dir, else none, as SGLang: an L3 in this process's memory would only hold a "
        "second copy of what L2 holds, and grow)",
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
    _group(parser, TRANSFER)
    _group(parser, ESTIMATE)


def _group(parser: argparse.ArgumentParser, key: str) -> argparse._ArgumentGroup:
    """A --help group holding the flags of `ALL_FLAGS` in group `key`."""
    group = parser.add_argument_group(GROUP_TITLES[key])
    for f in ALL_FLAGS:
        if f.group == key:
            f.add_to(group)
    return group


def fraction(text: str) -> float:
    """An argparse `type` for a share strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return value


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
    return "none", None


def decode_config(args: argparse.Namespace, page_bytes: int | None = None) -> DecodeConfig:
    """The core's configuration from parsed flags (and the node's --page-size and --tp-size).
    --hicache-size needs `page_bytes` (bytes of one KV page, known once the model is loaded):
    without it L2 follows the ratio, and the node sizes it again (`l2_gigabytes`)."""
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
    sized = sized_l1_flag(args)
    if sized is not None and values["l1_pages"] != _defaults()["l1_pages"]:
        raise SettingsError(f"{sized}: sizes L1, and so does --l1-pages; give one of them")
    l1 = values.pop("l1_pages")
    l2 = values.pop("l2_pages")
    ratio = values.pop("hicache_ratio")
    size_gb = values.pop("hicache_size_gb")
    if l2 is None:
        sized = size_gb > 0 and page_bytes is not None
        l2 = l2_pages(
            l1,
            args.page_size,
            hicache_ratio=ratio,
            l2_bytes=size_gb * 1e9 if sized else 0.0,
            page_bytes=page_bytes or 0,
        )
    if values["write_policy"] is None:  # not given: the node's default (`NODE_WRITE_POLICY_WHY`)
        values["write_policy"] = WritePolicy.WRITE_THROUGH if kind != "none" else WritePolicy.WRITE_BACK
    values.pop("tick_interval")  # the node's, not the core's
    values.pop("prefill_silence_s")
    return DecodeConfig(
        l1_pages=l1,
        l2_pages=0 if off else l2,
        page_size=args.page_size,
        storage=kind != "none",
        radix=not off,
        tp_size=getattr(args, "tp_size", SETTINGS["tp_size"].default),
        **values,
    )


def l2_ratio(args: argparse.Namespace) -> float | None:
    """The ratio L2 keeps to an L1 the node sizes from memory (--max-total-tokens,
    --mem-fraction-static); None where L2 is given otherwise (--l2-pages, --hicache-size) or off."""
    if args.l2_pages is not None or args.no_decode_cache or args.hicache_size_gb > 0:
        return None
    return float(args.hicache_ratio)


def sized_l1_flag(args: argparse.Namespace) -> str | None:
    """The flag that sizes L1 from memory, if one was given."""
    if args.max_total_tokens:
        return "--max-total-tokens"
    if args.mem_fraction_static:
        return "--mem-fraction-static"
    return None


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
    if args.max_total_tokens:
        out += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.mem_fraction_static:
        out += ["--mem-fraction-static", repr(args.mem_fraction_static)]
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
    model's KV bytes per token, sizes `storage.capacity_tokens`). Every [cache] key and every
    flag with a `scenario` source is carried; `tests/test_cache_flags.py` checks that none is
    dropped."""
    c = scenario.cache
    page = c.page_size
    l1 = max(1, l1_tokens // page)
    out = [
        "--page-size",
        str(page),
        "--l1-pages",
        str(l1),
        "--l2-pages",
        str(c.l2_pages_for(l1)),
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
    section, key = where.split(".")
    return getattr(getattr(scenario, section), key)


def cache_spec_fields_without_flag() -> list[str]:
    """[cache] keys no flag carries to a node (`tests/test_cache_flags.py` wants none): the tier
    sizes in tokens and the page size become --l1-pages, --l2-pages and --page-size."""
    carried = {f.scenario for f in ALL_FLAGS} | {"cache.l1_tokens", "cache.l2_tokens", "cache.page_size"}
    return [key for key in CACHE_SETTINGS if f"cache.{key}" not in carried]

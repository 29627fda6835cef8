"""How each setting of a decode node is stated, described once, as plain data.

A `Setting` says what a setting means (`help`, `unit`), what values it takes (`kind`, `low`,
`choices`), our flag for it, SGLang's names for it where SGLang has the setting, and its key in a
scenario file. `DecodeConfig`'s fields carry one each in their attrs metadata (under `SETTING`),
and the few sizes that are not fields of their own (`--hicache-ratio`, ...) are `Setting`s beside
`l2_pages`, which takes them. The drivers build from these descriptions rather than restating
them: the runtime its flags (`hicache.runtime.cache_flags`), the scenario file its `[cache]` keys
and their checks (`hicache.scenarios.scenario`), the CLI the node's `--page-size` and `--tp-size`.

One default per setting: the core's (the field's default). A runtime node that starts with
another one on purpose says so in `node_default`, with the reason in `why_node_default`.

Nothing here parses a command line or reads a file; this module only describes.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

SETTING = "hicache.setting"  # the attrs metadata key a field's `Setting` is under

# `Setting.group`: where --help lists a flag (the runtime names the groups).
CACHE = "cache"  # the decode cache: sizes and policies (a scenario's [cache] section)
TRANSFER = "transfer"  # P->D transfers: retries and backoff
ESTIMATE = "estimate"  # what the adaptive promise estimates a restore with
NODE = "node"  # a flag the CLI places beside the node's own (--page-size, --tp-size)


class _Unset(enum.Enum):
    UNSET = "unset"


UNSET = _Unset.UNSET  # a default not given: the driver always states the value


@attrs.frozen
class Setting:
    """One setting as users state it. `name` and `default` are filled in from the field by
    `field_settings`; a `Setting` that is not a field (an input of `l2_pages`) gives both."""

    help: str
    kind: type = float  # int, float, str (a policy's name) or bool
    low: float | None = None  # the least value accepted (inclusive); ints give an int
    choices: tuple[str, ...] | None = None
    flag: str | None = None  # our flag; None: set by other flags or by the driver
    aliases: tuple[str, ...] = ()  # more of our names for the flag
    sglang: tuple[str, ...] = ()  # SGLang's flag(s) for the same setting (ours may be one)
    sglang_extra_config: str | None = None  # its key in SGLang's --hicache-storage-backend-extra-config
    scenario: str | None = None  # "section.key" in a scenario file
    unit: str | None = None  # tokens, pages, seconds, bytes/s, GB
    metavar: str | None = None
    group: str | None = CACHE  # where --help lists the flag
    name: str = ""  # the DecodeConfig field, or the input's name
    default: Any = UNSET  # the core's; UNSET: the driver always gives it
    node_default: Any = UNSET  # a runtime node's own default, where it differs on purpose
    why_node_default: str = ""
    default_text: str | None = None  # how --help states a default that is not a value

    @property
    def flags(self) -> tuple[str, ...]:
        """Every name the flag answers to: ours, then SGLang's where they differ."""
        if self.flag is None:
            return ()
        ours = (self.flag, *self.aliases)
        return ours + tuple(n for n in self.sglang if n not in ours)

    @property
    def flag_default(self) -> Any:
        """What a runtime node takes when the flag is not given."""
        return self.default if self.node_default is UNSET else self.node_default

    def scenario_key(self, section: str) -> str | None:
        """The key in scenario section `section` ("cache"), or None when it is stated elsewhere."""
        if self.scenario is None:
            return None
        where, _, key = self.scenario.partition(".")
        return key if where == section else None


def plain(value: Any) -> Any:
    """A default as plain data: a policy's name rather than its enum member; UNSET for none."""
    if value is attrs.NOTHING:
        return UNSET
    return value.value if isinstance(value, enum.Enum) else value


def field_settings(cls: type) -> dict[str, Setting]:
    """The `Setting` of every field of the attrs class `cls` that has one, by field name, in the
    class's order, with `name` and (plain) `default` filled in from the field."""
    out = {}
    for field in attrs.fields(cls):
        setting = field.metadata.get(SETTING)
        if setting is not None:
            out[field.name] = attrs.evolve(setting, name=field.name, default=plain(field.default))
    return out

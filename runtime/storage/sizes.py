"""Byte sizes as operators write them: `64GiB`, `512 MiB`, `1.5TB`, `4096`."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """A whole number of bytes from a number and an optional unit (B, kB/MB/GB/TB powers of
    1000, KiB/MiB/GiB/TiB powers of 1024; case does not matter). ValueError says what was
    expected."""
    m = _SIZE.fullmatch(text)
    unit = m[2].lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{text!r}: expected a size in bytes such as 4096, 512MiB or 64GiB "
            "(units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return int(float(m[1]) * _UNITS[unit]) if "." in m[1] else int(m[1]) * _UNITS[unit]

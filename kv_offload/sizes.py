"""Byte sizes as users write them ("8GiB", "500MB") and as logs show them."""

from __future__ import annotations

import re
from typing import Any

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

def parse_size(value: Any, *, name: str) -> int:
    """Parse a byte size (an int, or a string like "8GiB", "500MB", "1024") into bytes.

    Raises ValueError naming ``name`` when the value is not a non-negative size.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a size like '8GiB' or an integer, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(
                f"{name}: cannot parse {value!r} as a size; write e.g. '8GiB', '500MB' "
                f"or a number of bytes (units: KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            )
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ValueError(
            f"{name}: expected a size like '8GiB' or an integer, got {type(value).__name__}"
        )
    if size < 0:
        raise ValueError(f"{name}: size must not be negative, got {value!r}")
    return size


def format_size(num_bytes: int) -> str:
    """Human-readable binary size ("1.5 GiB")."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{num_bytes} B"

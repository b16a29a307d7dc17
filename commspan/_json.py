"""JSON for what commspan writes from what it read: orjson, and the standard
library's encoder for the rare document orjson refuses (an int beyond 64 bits,
which the readers keep as it is: older files' resources may hold one).

Example:
    >>> dumps({"bytes": 2**64, "rate": float("nan")})
    b'{"bytes":18446744073709551616,"rate":null}'
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import orjson

__all__ = ["dumps"]


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """``value`` as compact JSON (UTF-8), as ``orjson.dumps`` writes it, big ints too;
    ``default`` turns what JSON has no type for into something it has."""
    try:
        return orjson.dumps(value, default=default)
    except TypeError as exc:
        if "64-bit" not in str(exc):
            raise
        return json.dumps(_finite(value), ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False, default=default).encode("utf-8")


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as ``None``, as orjson writes them (null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value

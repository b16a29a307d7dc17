"""JSON for what commspan writes from what it read: orjson, and the standard
library's encoder for the rare document orjson refuses (an int beyond 64 bits,
which the readers keep as it is: older files' resources may hold one).

Example:
    >>> dumps({"bytes": 2**64})
    b'{"bytes":18446744073709551616}'
"""

from __future__ import annotations

import json
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
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False, default=default).encode("utf-8")

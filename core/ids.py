"""Identifiers: time-ordered, URL-safe, prefixed by kind (``file-…``, ``ftjob-…``) like OpenAI's.

The first 10 characters encode the creation time in milliseconds, so ids sort by creation and serve
as stable pagination cursors; the other 16 are random.
"""

from __future__ import annotations

import secrets
import time

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32, lowercase: no i, l, o, u


def _encode(value: int, length: int) -> str:
    chars = []
    for _ in range(length):
        value, digit = divmod(value, 32)
        chars.append(_ALPHABET[digit])
    return "".join(reversed(chars))


def new_id(prefix: str) -> str:
    """A new id such as ``ftjob-01hx4k…``; later calls sort after earlier ones (to the millisecond)."""
    millis = time.time_ns() // 1_000_000
    return f"{prefix}-{_encode(millis, 10)}{_encode(secrets.randbits(80), 16)}"


def now() -> int:
    """Unix seconds, the timestamp unit of the OpenAI API."""
    return int(time.time())

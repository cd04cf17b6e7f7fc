"""The ``from``/``to`` of a usage report: Unix seconds or ISO 8601 dates and times (UTC unless stated)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from core.errors import InvalidRequest
from core.ids import now

DAY = 86_400
DEFAULT_DAYS = 30


@dataclass(frozen=True)
class Period:
    """Half-open ``[start, end)`` in Unix seconds."""

    start: int
    end: int

    def days(self) -> list[int]:
        """Start (Unix seconds, UTC midnight) of every day the period touches."""
        first = self.start - self.start % DAY
        return list(range(first, self.end, DAY))


def parse_instant(value: str, param: str) -> int:
    """``1717171717``, ``2024-05-31`` or ``2024-05-31T12:00:00Z`` as Unix seconds."""
    text = value.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00")) if "T" in text else None
        if parsed is None:
            day = date.fromisoformat(text)
            parsed = datetime(day.year, day.month, day.day)
    except ValueError:
        raise InvalidRequest(
            f"{param} must be Unix seconds or an ISO 8601 date or time (got {value!r})", param=param
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp())


def parse_period(start: str | None, end: str | None) -> Period:
    """The period asked for; by default the last 30 days up to now."""
    end_s = parse_instant(end, "to") if end else now() + 1
    start_s = parse_instant(start, "from") if start else end_s - DEFAULT_DAYS * DAY
    if start_s >= end_s:
        raise InvalidRequest("from must be before to", param="from")
    if end_s - start_s > 3660 * DAY:
        raise InvalidRequest("a report covers at most ten years; narrow from/to", param="from")
    return Period(start_s, end_s)


def day_label(day_start: int) -> str:
    """``2024-05-31`` for the UTC day starting at ``day_start``."""
    return (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(seconds=day_start)).date().isoformat()

"""The internal token: when configured, every route but ``/health`` needs ``Authorization: Bearer <token>``."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import Request

from core.errors import AuthenticationFailed


def require_token(token: str | None) -> Callable[[Request], None]:
    """A FastAPI dependency checking the bearer token in constant time (a no-op when ``token`` is None)."""
    expected = token.encode() if token else None

    def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise AuthenticationFailed(
                "this inference server needs the internal token: Authorization: Bearer <LORAPLEX_INTERNAL_TOKEN>"
            )

    return check

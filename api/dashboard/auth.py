"""Admin access for browsers: the admin key in ``Authorization`` as everywhere, or a session cookie set by
logging in with the key (a form) or with a short-lived login link.

Cookies and links are HMACs of an expiry under the admin key, so nothing is stored server-side and
changing the admin key logs everyone out.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyCookie, HTTPAuthorizationCredentials, HTTPBearer

from api.deps import Context, require_admin
from core.settings import Settings

COOKIE = "loraplex_admin"
COOKIE_PATH = "/admin"
SESSION_S = 12 * 3600
LOGIN_LINK_S = 15 * 60

_bearer = HTTPBearer(scheme_name="AdminKey", description="The LORAPLEX_ADMIN_KEY.", auto_error=False)
_cookie = APIKeyCookie(name=COOKIE, scheme_name="AdminSession", description="Set by /admin/login.", auto_error=False)


def sign(settings: Settings, purpose: str, lifetime_s: float, *, at: float | None = None) -> str | None:
    """``{expiry}.{hmac}`` for ``purpose`` ("session" or "login"); None when admin routes are disabled."""
    if settings.admin_key is None:
        return None
    expires = int((at if at is not None else time.time()) + lifetime_s)
    return f"{expires}.{_mac(settings, purpose, expires)}"


def verify(settings: Settings, purpose: str, token: str | None, *, at: float | None = None) -> bool:
    """Whether ``token`` is an unexpired ``sign`` of ``purpose`` under the current admin key."""
    if settings.admin_key is None or not token or "." not in token:
        return False
    expires_text, mac = token.split(".", 1)
    if not expires_text.isdigit() or int(expires_text) < (at if at is not None else time.time()):
        return False
    return hmac.compare_digest(mac, _mac(settings, purpose, int(expires_text)))


def _mac(settings: Settings, purpose: str, expires: int) -> str:
    assert settings.admin_key is not None
    key = settings.admin_key.get_secret_value().encode()
    return hmac.new(key, f"loraplex-dashboard:{purpose}:{expires}".encode(), hashlib.sha256).hexdigest()


def has_admin_session(ctx: Context, request: Request) -> bool:
    """The request carries a valid dashboard session cookie."""
    return verify(ctx.settings, "session", request.cookies.get(COOKIE))


def require_admin_or_session(
    ctx: Context,
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    _session: Annotated[str | None, Depends(_cookie)],
) -> None:
    """Admit the admin key or a dashboard session (so the dashboard's links, e.g. CSV exports, work)."""
    if credentials is None and has_admin_session(ctx, request):
        return
    require_admin(ctx, credentials)


AdminOrSession = Depends(require_admin_or_session)

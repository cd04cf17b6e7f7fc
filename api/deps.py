"""FastAPI dependencies: the app context, the calling tenant (Bearer tenant key), admin access (admin key)."""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.context import ApiContext
from core.accounts import KEY_PREFIX, authenticate
from core.errors import AuthenticationFailed, PermissionDenied
from core.models import Tenant
from core.settings import Settings

# auto_error=False: a missing or malformed header reaches us, so the 401 has our error shape and message.
_tenant_bearer = HTTPBearer(
    scheme_name="TenantKey", description="A tenant API key (lpx-...), issued by an admin.", auto_error=False
)
_admin_bearer = HTTPBearer(scheme_name="AdminKey", description="The LORAPLEX_ADMIN_KEY.", auto_error=False)
_Credentials = HTTPAuthorizationCredentials | None


def get_context(request: Request) -> ApiContext:
    """The context :func:`api.app.create_app` built for this app."""
    return request.app.state.context


Context = Annotated[ApiContext, Depends(get_context)]


def is_admin_key(settings: Settings, presented: str) -> bool:
    """Constant-time comparison with the configured admin key (digests, so length leaks nothing either)."""
    if settings.admin_key is None:
        return False
    expected = hashlib.sha256(settings.admin_key.get_secret_value().encode()).digest()
    return hmac.compare_digest(expected, hashlib.sha256(presented.encode()).digest())


def current_tenant(ctx: Context, credentials: Annotated[_Credentials, Depends(_tenant_bearer)]) -> Tenant:
    """The tenant whose active API key is in ``Authorization: Bearer``."""
    if credentials is None:
        raise AuthenticationFailed("missing API key: send 'Authorization: Bearer <tenant key>'", code="missing_api_key")
    key = credentials.credentials
    if is_admin_key(ctx.settings, key):
        raise AuthenticationFailed(
            "the admin key only opens /admin routes; call /v1 routes with a tenant API key", code="admin_key"
        )
    with ctx.reading() as session:
        return authenticate(session, key)


def require_admin(ctx: Context, credentials: Annotated[_Credentials, Depends(_admin_bearer)]) -> None:
    """Admit only the configured admin key."""
    if ctx.settings.admin_key is None:
        raise AuthenticationFailed("admin routes are disabled: set LORAPLEX_ADMIN_KEY", code="admin_disabled")
    if credentials is None:
        raise AuthenticationFailed(
            "missing admin key: send 'Authorization: Bearer <admin key>'", code="missing_api_key"
        )
    if is_admin_key(ctx.settings, credentials.credentials):
        return
    if credentials.credentials.startswith(KEY_PREFIX):
        raise PermissionDenied("tenant API keys cannot use admin routes; use LORAPLEX_ADMIN_KEY", code="admin_only")
    raise AuthenticationFailed("invalid admin key")


CurrentTenant = Annotated[Tenant, Depends(current_tenant)]
AdminAccess = Depends(require_admin)

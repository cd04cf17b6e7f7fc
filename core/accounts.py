"""Tenants and their API keys. A key is shown once at creation; only its sha256 is stored."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from sqlmodel import Session, select

from core.errors import AuthenticationFailed, Conflict, InvalidRequest, NotFound, PermissionDenied
from core.ids import new_id, now
from core.models import ApiKey, Tenant

KEY_PREFIX = "lpx-"
_TENANT_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


def hash_key(key: str) -> str:
    """sha256 hex of an API key (keys are 240-bit random, so a plain hash is enough)."""
    return hashlib.sha256(key.encode()).hexdigest()


def validate_tenant_name(name: str) -> str:
    """Tenant names appear in model names (``ft:base:tenant:...``), so they are short and colon-free."""
    if not _TENANT_NAME_RE.match(name or ""):
        raise InvalidRequest(
            "tenant name must be 1-64 characters: lowercase letters, digits, '-' or '_', starting with a letter "
            "or digit",
            param="name",
        )
    return name


def create_api_key(session: Session, tenant: Tenant, name: str | None = None) -> tuple[ApiKey, str]:
    """A new key for ``tenant``: returns the row and the plaintext key (never retrievable again)."""
    plaintext = KEY_PREFIX + secrets.token_urlsafe(30)
    row = ApiKey(
        id=new_id("key"),
        tenant_id=tenant.id,
        key_hash=hash_key(plaintext),
        prefix=plaintext[:12],
        name=name,
    )
    session.add(row)
    session.flush()
    return row, plaintext


def create_tenant(session: Session, name: str) -> tuple[Tenant, str]:
    """A new tenant with its first API key; returns the tenant and the plaintext key."""
    validate_tenant_name(name)
    if session.exec(select(Tenant).where(Tenant.name == name)).first() is not None:
        raise Conflict(f"a tenant named {name!r} already exists", param="name", code="tenant_exists")
    tenant = Tenant(id=new_id("tenant"), name=name)
    session.add(tenant)
    session.flush()
    _, key = create_api_key(session, tenant, name="default")
    return tenant, key


def get_tenant(session: Session, tenant_ref: str) -> Tenant:
    """A tenant by id or name."""
    tenant = session.get(Tenant, tenant_ref) or session.exec(select(Tenant).where(Tenant.name == tenant_ref)).first()
    if tenant is None:
        raise NotFound(f"no tenant {tenant_ref!r}", param="tenant")
    return tenant


def revoke_api_key(session: Session, key_id: str, tenant_id: str | None = None) -> ApiKey:
    """Mark a key revoked (idempotent). With ``tenant_id``, only that tenant's keys are found."""
    row = session.get(ApiKey, key_id)
    if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
        raise NotFound(f"no API key {key_id!r}", param="key_id")
    if row.revoked_at is None:
        row.revoked_at = now()
        session.add(row)
    return row


def authenticate(session: Session, key: str) -> Tenant:
    """The tenant owning an active ``key``; raises AuthenticationFailed / PermissionDenied otherwise."""
    if not key.startswith(KEY_PREFIX):
        raise AuthenticationFailed("invalid API key: tenant keys start with 'lpx-'")
    digest = hash_key(key)
    row = session.exec(select(ApiKey).where(ApiKey.key_hash == digest)).first()
    # compare_digest keeps the check constant-time even though the lookup is by hash.
    if row is None or not hmac.compare_digest(row.key_hash, digest):
        raise AuthenticationFailed("invalid API key")
    if row.revoked_at is not None:
        raise AuthenticationFailed("this API key was revoked; ask your admin for a new one", code="revoked_api_key")
    tenant = session.get(Tenant, row.tenant_id)
    if tenant is None:
        raise AuthenticationFailed("invalid API key")
    if tenant.disabled:
        raise PermissionDenied(f"tenant {tenant.name!r} is disabled", code="tenant_disabled")
    return tenant

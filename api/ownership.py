"""Finding a tenant's own rows. Another tenant's row answers exactly like a missing one (404, same message),
so ids cannot be probed across tenants."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeVar

from sqlmodel import Session, SQLModel, select

from api.base_model import BaseModelInfo, BaseModels
from core.errors import NotFound
from core.models import Adapter, Tenant

Row = TypeVar("Row", bound=SQLModel)

# Every id we issue matches this; anything else cannot exist, and is not worth a query (some databases
# reject bytes such as NUL in a string parameter outright).
_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def plausible_id(value: str) -> bool:
    """Whether ``value`` could be an id we issued."""
    return _ID_RE.fullmatch(value) is not None


def get_owned(session: Session, model: type[Row], row_id: str, tenant: Tenant, *, noun: str) -> Row:
    """The caller's live ``model`` row with id ``row_id``; ``NotFound`` when absent, deleted or someone else's."""
    row = session.get(model, row_id) if plausible_id(row_id) else None
    if row is None or getattr(row, "tenant_id", None) != tenant.id or getattr(row, "deleted_at", None) is not None:
        raise NotFound(f"no {noun} with id {row_id!r}", code=f"{noun.replace(' ', '_').replace('-', '_')}_not_found")
    return row


def find_owned_adapter(session: Session, tenant: Tenant, name: str) -> Adapter | None:
    """The caller's live adapter whose public model name is ``name``, or None."""
    if not name.isprintable():  # no stored name holds control characters; some databases reject NUL outright
        return None
    return session.exec(
        select(Adapter).where(
            Adapter.name == name,
            Adapter.tenant_id == tenant.id,
            Adapter.deleted_at.is_(None),  # type: ignore[union-attr]
        )
    ).first()


@dataclass(frozen=True)
class ServedModel:
    """What a ``model`` name reaches: the base that answers (or trains), and the caller's adapter on it (None:
    the base alone)."""

    base: BaseModelInfo
    adapter: Adapter | None


def find_served_model(session: Session, tenant: Tenant, model: str, bases: BaseModels) -> ServedModel | None:
    """One of the served bases by name, or the caller's live adapter whose base is served; None otherwise (an
    adapter whose base this API no longer serves reads like a missing one)."""
    base = bases.get(model)
    if base is not None:
        return ServedModel(base, None)
    adapter = find_owned_adapter(session, tenant, model)
    base = bases.get(adapter.base_model) if adapter is not None else None
    return ServedModel(base, adapter) if base is not None else None

"""What a request's ``model`` names: one of the base models, or one of the caller's live adapters (on its base)."""

from __future__ import annotations

from dataclasses import dataclass

from api.base_model import BaseModelInfo
from api.context import ApiContext
from api.ownership import find_owned_adapter
from core.errors import NotFound
from core.models import Adapter, Tenant


@dataclass(frozen=True)
class Target:
    """The base model that answers, and the adapter applied to it (None: the base alone)."""

    base: BaseModelInfo
    adapter: Adapter | None


def find_model(ctx: ApiContext, tenant: Tenant, model: str) -> Target:
    """The request's base and adapter; ``NotFound`` otherwise (another tenant's adapter answers exactly like a
    missing one, and so does an adapter whose base this API no longer serves)."""
    base = ctx.bases.get(model)
    if base is not None:
        return Target(base, None)
    with ctx.reading() as session:
        row = find_owned_adapter(session, tenant, model)
    base = ctx.bases.get(row.base_model) if row is not None else None
    if row is None or base is None:
        raise NotFound(
            f"the model {model!r} does not exist or you do not have access to it; GET /v1/models lists yours",
            param="model",
            code="model_not_found",
        )
    return Target(base, row)

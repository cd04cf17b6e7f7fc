"""What a request's ``model`` names: the base model, or one of the caller's live adapters."""

from __future__ import annotations

from api.context import ApiContext
from api.ownership import find_owned_adapter
from core.errors import NotFound
from core.models import Adapter, Tenant


def find_model(ctx: ApiContext, tenant: Tenant, model: str) -> Adapter | None:
    """None for the base model, the adapter for one of the caller's; ``NotFound`` otherwise (another
    tenant's adapter answers exactly like a missing one)."""
    if model == ctx.base_model.name:
        return None
    with ctx.reading() as session:
        row = find_owned_adapter(session, tenant, model)
    if row is None:
        raise NotFound(
            f"the model {model!r} does not exist or you do not have access to it; GET /v1/models lists yours",
            param="model",
            code="model_not_found",
        )
    return row

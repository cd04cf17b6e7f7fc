"""What a request's ``model`` names: one of the base models, or one of the caller's live adapters (on its base)."""

from __future__ import annotations

from api.context import ApiContext
from api.ownership import ServedModel, find_served_model
from core.errors import NotFound
from core.models import Tenant


def find_model(ctx: ApiContext, tenant: Tenant, model: str) -> ServedModel:
    """The request's base and adapter; ``NotFound`` otherwise (another tenant's adapter answers exactly like a
    missing one, and so does an adapter whose base this API no longer serves)."""
    with ctx.reading() as session:
        target = find_served_model(session, tenant, model, ctx.bases)
    if target is None:
        raise NotFound(
            f"the model {model!r} does not exist or you do not have access to it; GET /v1/models lists yours",
            param="model",
            code="model_not_found",
        )
    return target

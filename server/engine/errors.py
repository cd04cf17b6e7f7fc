"""Errors the engine raises to its callers (the HTTP layer maps them through ``core.errors``)."""

from __future__ import annotations

from core.errors import Conflict, InvalidRequest, NotFound


class AdapterNotLoaded(NotFound):
    """A request names an adapter that is not resident; load it first."""

    default_code = "adapter_not_loaded"


class AdapterAlreadyLoaded(Conflict):
    default_code = "adapter_already_loaded"


class AdapterInUse(Conflict):
    """Unloading an adapter that unfinished requests still use; abort them or wait."""

    default_code = "adapter_in_use"


class PromptTooLong(InvalidRequest):
    default_code = "context_length_exceeded"


class DuplicateRequest(InvalidRequest):
    default_code = "duplicate_request_id"

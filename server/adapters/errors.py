"""Errors of the adapter tiers, each mapped to an HTTP status through ``core.errors``."""

from __future__ import annotations

from core.adapter_format import AdapterFormatError
from core.errors import Conflict, InvalidRequest, NotFound


class ModelNotFound(NotFound):
    """``model`` names neither the base model nor an adapter this server knows or can find."""

    default_code = "model_not_found"


class AdapterPathRefused(InvalidRequest):
    """A local adapter name or path that is absolute, climbs out with ``..``, or resolves outside the root."""

    default_code = "adapter_path_refused"


class AdapterChecksumMismatch(AdapterFormatError):
    """A downloaded file's sha256 differs from the descriptor's: the object changed or the descriptor is wrong."""

    default_code = "adapter_checksum_mismatch"


class AdapterTooLarge(AdapterFormatError):
    """The adapter cannot fit: its files are larger than any servable adapter, or it needs more pages than exist."""

    default_code = "adapter_too_large"


class AdapterBaseMismatch(InvalidRequest):
    """The descriptor names a different base model than the one this server runs."""

    default_code = "adapter_base_mismatch"


class AdapterNameConflict(Conflict):
    """``lora_name`` is already bound to a different adapter; unload it first."""

    default_code = "adapter_name_conflict"

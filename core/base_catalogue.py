"""The base models one deployment serves: ``LORAPLEX_BASE_MODEL`` (the default) and ``LORAPLEX_BASE_MODELS``.

Each base has its own training queue and workers, and its own inference servers (replicas register under
its name); the API fronts them all, so one key and one ``/v1/models`` reach every base. A worker or a server
runs one base, its ``LORAPLEX_BASE_MODEL``; only the API (and ``loraplex up``, which starts a worker and a
server per base) reads the whole catalogue.

``LORAPLEX_BASE_MODELS`` is a comma-separated list of ``NAME=SOURCE`` or ``SOURCE`` entries, a source being
a directory or a hub id ``org/name[@revision]`` and the name defaulting as ``LORAPLEX_BASE_MODEL_NAME`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import ConfigError
from core.model_source import default_model_name
from core.settings import Settings

SETTING = "LORAPLEX_BASE_MODELS"


@dataclass(frozen=True)
class BaseEntry:
    """One base model of the catalogue: its public name (what clients pass as ``model``) and where it is."""

    name: str
    source: str


def parse_base_models(text: str) -> list[BaseEntry]:
    """``NAME=SOURCE`` or ``SOURCE`` entries, comma-separated; ``ConfigError`` naming a malformed one."""
    entries = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, _, source = item.partition("=") if "=" in item else ("", "", item)
        name, source = name.strip(), source.strip()
        if not source or ("=" in item and not name):
            raise ConfigError(f"{SETTING}: {item!r} is not NAME=SOURCE or SOURCE")
        entries.append(BaseEntry(name or default_model_name(source), source))
    return entries


def base_catalogue(settings: Settings) -> list[BaseEntry]:
    """Every base this deployment serves, the default (``LORAPLEX_BASE_MODEL``) first; ``ConfigError`` when
    there is none or two share a name."""
    if settings.base_model is None or settings.model_name is None:
        raise ConfigError("LORAPLEX_BASE_MODEL is not set: point it at the base model directory or hub id")
    entries = [BaseEntry(settings.model_name, settings.base_model)]
    entries += parse_base_models(settings.base_models or "")
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise ConfigError(f"two base models are named {entry.name!r} ({SETTING}); name one NAME=SOURCE")
        seen.add(entry.name)
    return entries

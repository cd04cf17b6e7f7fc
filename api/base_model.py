"""What the API needs to know about each base model it serves (``core.base_catalogue``): its public name and
its ``config.json``."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.adapter_format import BaseShapes
from core.base_catalogue import BaseEntry, base_catalogue
from core.base_fingerprint import BaseFingerprint, fingerprint_base
from core.errors import ConfigError
from core.model_sizes import ModelSizes
from core.model_source import resolve_model_dir
from core.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BaseModelInfo:
    """A base model this deployment fine-tunes and serves."""

    name: str  # what clients pass as `model`
    path: Path
    config: dict[str, Any]  # the model's config.json
    shapes: BaseShapes  # what an uploaded adapter must fit
    created: int  # Unix seconds, shown in /v1/models
    fingerprint: BaseFingerprint | None = None  # None when the API sees the config but not the weights

    def same_weights(self, other: BaseModelInfo) -> bool:
        """Both fingerprints are known and equal: an adapter made on one fits the other exactly."""
        mine, theirs = self.fingerprint, other.fingerprint
        return mine is not None and theirs is not None and mine.digest == theirs.digest

    @property
    def context_length(self) -> int | None:
        """Longest sequence the model was built for, when its config says."""
        value = self.config.get("max_position_embeddings")
        return int(value) if isinstance(value, int) and value > 0 else None


class BaseModels:
    """The catalogue, loaded: each base by name, the default (``LORAPLEX_BASE_MODEL``) first."""

    def __init__(self, bases: list[BaseModelInfo]) -> None:
        self._by_name = {base.name: base for base in bases}
        self.default = bases[0]

    def get(self, name: str) -> BaseModelInfo | None:
        return self._by_name.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[BaseModelInfo]:
        return iter(self._by_name.values())

    def made_on(self, fingerprint: str) -> BaseModelInfo | None:
        """The base whose weights have ``fingerprint``, if one is served."""
        return next((b for b in self if b.fingerprint is not None and b.fingerprint.digest == fingerprint), None)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    @property
    def label(self) -> str:
        """How usage reports name requests made to a base model itself (one row for every base)."""
        return ", ".join(self._by_name)


def load_base_models(settings: Settings) -> BaseModels:
    """Read every base's config once; a missing or unreadable one is a configuration error."""
    entries = base_catalogue(settings)
    settings_of = ["LORAPLEX_BASE_MODEL", *["LORAPLEX_BASE_MODELS"] * (len(entries) - 1)]
    return BaseModels([_load(entry, setting) for entry, setting in zip(entries, settings_of, strict=True)])


def _load(entry: BaseEntry, setting: str) -> BaseModelInfo:
    path = resolve_model_dir(entry.source, setting=setting)
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
        created = int(config_path.stat().st_mtime)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {config_path} ({setting}: {entry.name!r}): {exc}") from exc
    try:
        shapes = ModelSizes.from_hf_config(config).base_shapes()
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{config_path} ({setting}: {entry.name!r}) is not a Llama-family config: {exc!r}") from exc
    try:
        fingerprint = fingerprint_base(path, entry.name)
    except FileNotFoundError:
        log.warning(
            "%s (%s) has no safetensors weights here: uploads for it are checked by shape, and by fingerprint only "
            "on the servers",
            path,
            setting,
        )
        fingerprint = None
    return BaseModelInfo(
        name=entry.name, path=path, config=config, shapes=shapes, created=created, fingerprint=fingerprint
    )

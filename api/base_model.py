"""What the API needs to know about the configured base model: its public name and its ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.adapter_format import BaseShapes
from core.errors import ConfigError
from core.model_sizes import ModelSizes
from core.model_source import resolve_model_dir
from core.settings import Settings


@dataclass(frozen=True)
class BaseModelInfo:
    """The one base model this deployment fine-tunes and serves."""

    name: str  # what clients pass as `model`
    path: Path
    config: dict[str, Any]  # the model's config.json
    shapes: BaseShapes  # what an uploaded adapter must fit
    created: int  # Unix seconds, shown in /v1/models

    @property
    def context_length(self) -> int | None:
        """Longest sequence the model was built for, when its config says."""
        value = self.config.get("max_position_embeddings")
        return int(value) if isinstance(value, int) and value > 0 else None


def load_base_model(settings: Settings) -> BaseModelInfo:
    """Read the base model's config once; a missing or unreadable one is a configuration error."""
    if settings.base_model is None or settings.model_name is None:
        raise ConfigError("LORAPLEX_BASE_MODEL is not set: point it at the base model directory or hub id")
    path = resolve_model_dir(settings.base_model, setting="LORAPLEX_BASE_MODEL")
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
        created = int(config_path.stat().st_mtime)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {config_path} (LORAPLEX_BASE_MODEL): {exc}") from exc
    try:
        shapes = ModelSizes.from_hf_config(config).base_shapes()
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{config_path} (LORAPLEX_BASE_MODEL) is not a Llama-family config: {exc!r}") from exc
    return BaseModelInfo(name=settings.model_name, path=path, config=config, shapes=shapes, created=created)

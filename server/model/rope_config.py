"""Rotary embedding parameters read from a Hugging Face ``config.json``, with transformers 5's defaults.

Pure Python; :mod:`server.model.rope` turns a :class:`RopeConfig` into frequencies and cos/sin tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from core.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Types whose `factor` may be left out: it is then max_position_embeddings / original_max_position_embeddings.
_IMPLIED_FACTOR = ("yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``rope_type`` is one of :data:`SUPPORTED_ROPE_TYPES`."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    partial_rotary_factor: float = 1.0  # only the first int(head_dim * this) dims of each head are rotated
    # The context the unscaled frequencies were trained for (for ``dynamic``: max_position_embeddings).
    original_max_position_embeddings: int = 2048
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    attention_factor: float | None = None  # yarn, longrope: cos/sin multiplier; None derives it from factor
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] = ()  # longrope, for contexts up to original_max_position_embeddings
    long_factor: tuple[float, ...] = ()  # longrope, for longer contexts

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dims of each head are rotated."""
        return int(head_dim * self.partial_rotary_factor)


def rope_config(
    config: dict[str, Any], head_dim: int, params: dict[str, Any] | None = None, field: str = ""
) -> RopeConfig:
    """Parse ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (older files).

    ``params`` (named ``field`` in errors) replaces both: one layer type's parameters (Gemma 3)."""
    if params is None:
        field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
        params = dict(config.get(field) or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if config.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi3Config's names for it in older configs
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{field}.rope_type {rope_type!r} is not served; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    max_positions = int(config.get("max_position_embeddings", 2048))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    partial = 1.0 if partial is None else float(partial)
    rotary_dim = int(head_dim * partial)
    if not 0.0 < partial <= 1.0 or rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(
            f"partial_rotary_factor {partial} gives {rotary_dim} rotated dims of head_dim {head_dim}; "
            "it must be in (0, 1] and give an even number >= 2"
        )
    if rope_type == "dynamic":
        original = max_positions  # transformers scales dynamic NTK against max_position_embeddings
    else:
        # As transformers: a top-level value (Phi-3 style) wins, then the rope dict's, then max_position_embeddings.
        original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        original = int(original or max_positions)
    factor = params.get("factor")
    if factor is None:
        if rope_type in _IMPLIED_FACTOR:
            factor = max_positions / original
        elif rope_type in ("linear", "dynamic", "llama3"):
            raise ConfigError(f"{field}.factor is required for rope_type {rope_type!r}")
        else:
            factor = 1.0
    short_factor = _factors(params, "short_factor", rope_type, rotary_dim, field)
    long_factor = _factors(params, "long_factor", rope_type, rotary_dim, field)
    defaults = RopeConfig()
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(factor),
        partial_rotary_factor=partial,
        original_max_position_embeddings=original,
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        attention_factor=_optional_float(params.get("attention_factor")),
        # transformers treats 0 and null as unset here (`or 32`, `or 1`).
        beta_fast=float(params.get("beta_fast") or defaults.beta_fast),
        beta_slow=float(params.get("beta_slow") or defaults.beta_slow),
        mscale=_optional_float(params.get("mscale")),
        mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
        truncate=bool(params.get("truncate", True)),
        short_factor=short_factor,
        long_factor=long_factor,
    )


def gemma3_rope_configs(config: dict[str, Any], head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's (global, local) ropes: ``rope_parameters`` per layer type, as ``Gemma3TextConfig`` fills them in.

    Full-attention layers: ``rope_parameters.full_attention``, else ``rope_scaling`` with ``rope_theta``
    (default 1e6); sliding layers: ``rope_parameters.sliding_attention``, else ``rope_local_base_freq`` (1e4)."""
    given = config.get("rope_parameters") or {}
    ropes = []
    for layer_type, theta_key, theta in (
        ("full_attention", "rope_theta", 1e6),
        ("sliding_attention", "rope_local_base_freq", 1e4),
    ):
        params = dict(given.get(layer_type) or {"rope_type": "default"})
        if layer_type == "full_attention" and config.get("rope_scaling"):
            params.update(config["rope_scaling"])  # the legacy key scales the global layers only
        params.setdefault("rope_theta", config.get(theta_key, theta))
        ropes.append(rope_config(config, head_dim, params, f"rope_parameters.{layer_type}"))
    return ropes[0], ropes[1]


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _factors(params: dict[str, Any], key: str, rope_type: str, rotary_dim: int, field: str) -> tuple[float, ...]:
    if rope_type != "longrope":
        return ()
    values = params.get(key)
    if not isinstance(values, list) or len(values) != rotary_dim // 2:
        got = len(values) if isinstance(values, list) else repr(values)
        raise ConfigError(f"{field}.{key} must list {rotary_dim // 2} numbers (rotated dims / 2), got {got}")
    factors = tuple(float(v) for v in values)
    if not all(math.isfinite(v) and v > 0 for v in factors):
        raise ConfigError(f"{field}.{key} must hold positive numbers")
    return factors

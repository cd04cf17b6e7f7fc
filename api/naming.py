"""The client-chosen part of adapter model names (``ft:{base}:{tenant}:{suffix}:{id}``, built by
``core.jobs.fine_tuned_model_name``): what a ``suffix`` may hold."""

from __future__ import annotations

import re

SUFFIX_MAX = 64
SUFFIX_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"
_SUFFIX_RE = re.compile(SUFFIX_PATTERN)
SUFFIX_RULE = (
    "suffix may hold only letters, digits, '-' and '_', starting with a letter or digit, at most 64 characters "
    "(it becomes part of the model name)"
)


def check_suffix(suffix: str | None) -> str | None:
    """``suffix`` when it is safe inside a model name; raises ``ValueError`` with the rule otherwise."""
    if suffix is not None and (len(suffix) > SUFFIX_MAX or not _SUFFIX_RE.match(suffix)):
        raise ValueError(SUFFIX_RULE)
    return suffix

"""Which base model an adapter was made on: a fingerprint of the base, recorded with every adapter and checked
before one is accepted or loaded.

Two bases with the same config (and so the same tensor shapes) take each other's adapters without complaint
and answer with garbage, so shapes are not enough. The fingerprint hashes the base's ``config.json`` (less
fields that do not change what the weights compute) and, for every tensor of its safetensors files in name
order, its name, shape and a sample of its values: ``SAMPLE_WINDOWS`` evenly spaced runs of
``WINDOW_ELEMENTS`` elements, rounded to bfloat16 so an fp32 copy and a bf16 copy of the same model agree. It
reads a few hundred KiB from a model of any size, so the API, every worker and every server compute it at
start; a full hash of 16 GB of weights would add tens of seconds to every cold start. A sample catches another
base, a fine-tuned or retrained copy; it does not promise to catch a single edited weight.

Adapters carry it in their safetensors ``__metadata__`` (:data:`FINGERPRINT_KEY`, with the base's public name
under :data:`BASE_NAME_KEY`), which travels with the file however it is copied, and in ``manifest.json``;
the database keeps the fingerprint an adapter was accepted for, and the descriptor hands it to servers.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.adapter_format import AdapterFileError, read_header_json
from core.errors import InvalidRequest

FINGERPRINT_VERSION = "bfp1"
SAMPLE_WINDOWS = 8
WINDOW_ELEMENTS = 256
FINGERPRINT_KEY = "loraplex.base_fingerprint"
BASE_NAME_KEY = "loraplex.base_model"
# Fields that say how a config was saved or how it is run, not what the weights compute.
VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"})
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class BaseModelMismatch(InvalidRequest):
    """An adapter made on another base model than the one it is offered to."""

    default_code = "base_model_mismatch"


@dataclass(frozen=True)
class BaseFingerprint:
    """A base model's public name and the fingerprint of its config and weights."""

    name: str
    digest: str  # "bfp1:<sha256 hex>"

    @property
    def short(self) -> str:
        """Enough of the digest to tell bases apart in a message."""
        return self.digest[:17]


@dataclass(frozen=True)
class AdapterOrigin:
    """What an adapter's weights file says it was made on."""

    base_model: str
    fingerprint: str


def fingerprint_base(model_dir: str | Path, name: str | None = None) -> BaseFingerprint:
    """Fingerprint the model in ``model_dir`` (its ``config.json`` and ``*.safetensors`` files)."""
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no weight files (*.safetensors) in {root}")
    config = json.loads((root / "config.json").read_text())
    digest = hashlib.sha256()
    kept = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    digest.update(json.dumps(kept, sort_keys=True, separators=(",", ":")).encode())
    tensors: dict[str, tuple[Path, int, dict]] = {}
    for path in files:
        header, data_start, _ = read_header_json(path)
        header.pop("__metadata__", None)
        for key, info in header.items():
            tensors[key] = (path, data_start, info)
    for key in sorted(tensors):
        path, data_start, info = tensors[key]
        digest.update(f"\n{key}|{list(info['shape'])}|".encode())
        digest.update(_sample(path, data_start, info))
    return BaseFingerprint(name=name or root.name, digest=f"{FINGERPRINT_VERSION}:{digest.hexdigest()}")


def _sample(path: Path, data_start: int, info: dict) -> bytes:
    """The tensor's sampled elements, floats rounded to bfloat16 bits; other dtypes as stored."""
    dtype = info["dtype"]
    item = _ITEM_BYTES.get(dtype)
    if item is None:
        return dtype.encode()  # nothing we serve has such tensors; their presence and shape are hashed
    count = math.prod(info["shape"])
    width = min(WINDOW_ELEMENTS, count)
    starts = sorted({round(i * (count - width) / max(SAMPLE_WINDOWS - 1, 1)) for i in range(SAMPLE_WINDOWS)})
    begin = data_start + int(info["data_offsets"][0])
    chunks = []
    with path.open("rb") as f:
        for start in starts:
            f.seek(begin + start * item)
            chunks.append(f.read(width * item))
    raw = b"".join(chunks)
    if dtype == "BF16":
        return raw
    if dtype in ("F32", "F16", "F64"):
        values = np.frombuffer(raw, dtype={"F32": "<f4", "F16": "<f2", "F64": "<f8"}[dtype]).astype("<f4")
        return _to_bfloat16_bits(values).tobytes()
    return raw


def _to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest, ties to even), as torch's conversion does; NaN stays NaN."""
    bits = values.view("<u4").astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    nan = np.isnan(values)
    rounded[nan] = ((bits[nan] >> 16) | 0x40).astype("<u2")  # quiet NaN, sign kept
    return rounded


def read_adapter_origin(weights_path: str | Path) -> AdapterOrigin | None:
    """The base an adapter's weights file says it was made on, or None when it records none (adapters
    trained elsewhere). A malformed header is left for ``core.adapter_format`` to describe."""
    try:
        header, _, _ = read_header_json(weights_path)
    except (OSError, AdapterFileError):
        return None
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or not isinstance(metadata.get(FINGERPRINT_KEY), str):
        return None
    name = metadata.get(BASE_NAME_KEY)
    return AdapterOrigin(base_model=name if isinstance(name, str) else "", fingerprint=metadata[FINGERPRINT_KEY])


def origin_metadata(base: BaseFingerprint) -> dict[str, str]:
    """The ``__metadata__`` entries that record ``base`` in an adapter's weights file."""
    return {BASE_NAME_KEY: base.name, FINGERPRINT_KEY: base.digest}


def check_origin(origin: AdapterOrigin | None, base: BaseFingerprint) -> None:
    """Refuse an adapter whose weights file records another base than ``base``."""
    if origin is None or origin.fingerprint == base.digest:
        return
    made_on = f"base model {origin.base_model!r}" if origin.base_model else "another base model"
    raise BaseModelMismatch(
        f"this adapter was made on {made_on} (fingerprint {origin.fingerprint[:17]}), not on {base.name!r} "
        f"(fingerprint {base.short}): the two have the same shapes but other weights, so its answers would be "
        f"wrong; use it with the base it was made for",
        param="model",
    )


def check_recorded(recorded: str | None, base: BaseFingerprint, adapter: str) -> None:
    """Refuse an adapter accepted for a base whose weights have changed since (``recorded`` is the fingerprint
    its database row keeps; None for adapters registered before fingerprints were kept)."""
    if recorded is None or recorded == base.digest:
        return
    raise BaseModelMismatch(
        f"adapter {adapter} was made for base model {base.name!r} with fingerprint {recorded[:17]}, but the base "
        f"served under that name now has fingerprint {base.short}: its weights changed, so the adapter no "
        "longer fits; serve the original base or train the adapter again",
        param="model",
    )

"""PEFT LoRA adapters: parse, validate against a base model, and load their tensors.

Shared by the control plane (validating uploads) and the inference server (before placing weights).
Validation reads ``adapter_config.json`` and the safetensors *header* only; tensors are read later by
:func:`load_adapter_weights`. Nothing here unpickles: pickle files make an adapter invalid.
Anything we cannot serve exactly is refused with an error whose ``param`` names the field or key.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import InvalidRequest
from core.projections import FUSED_MODULES, SEPARATE_MODULES, AdapterModules, adapter_modules

if TYPE_CHECKING:
    import torch

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 100 << 20

DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}

# Config fields we interpret, and fields that only matter at training/init time.
HANDLED_FIELDS = frozenset(
    {
        "peft_type", "r", "lora_alpha", "target_modules", "layers_to_transform", "layers_pattern",
        "rank_pattern", "alpha_pattern", "use_rslora", "exclude_modules", "bias", "modules_to_save",
        "use_dora", "lora_bias", "auto_mapping", "auto_map",
    }
)  # fmt: skip
IGNORED_FIELDS = frozenset(
    {
        "base_model_name_or_path", "revision", "task_type", "inference_mode", "init_lora_weights",
        "lora_dropout", "fan_in_fan_out", "peft_version", "loftq_config", "eva_config", "corda_config",
        "lora_ga_config", "megatron_core", "qalora_group_size", "ensure_weight_tying", "runtime_config",
    }
)  # fmt: skip

_KEY_RE = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\."
    r"(?P<proj>[a-z_]+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$"
)


class AdapterFormatError(InvalidRequest):
    """An adapter we cannot serve exactly; ``param`` names the offending field, file or tensor key."""

    default_code = "invalid_adapter"


class AdapterFileError(AdapterFormatError):
    """A file is missing, unreadable, or in a format we never load (pickle)."""

    default_code = "adapter_file_invalid"


class AdapterConfigError(AdapterFormatError):
    """``adapter_config.json`` holds a value out of range or of the wrong type."""

    default_code = "adapter_config_invalid"


class UnsupportedAdapterError(AdapterFormatError):
    """A valid PEFT feature that would not be reproduced exactly by our kernels."""

    default_code = "adapter_unsupported"


class AdapterShapeError(AdapterFormatError):
    """A tensor's shape or dtype does not fit the base model or the declared rank."""

    default_code = "adapter_shape_mismatch"


class UnexpectedTensorError(AdapterFormatError):
    """The weights file has a key outside the expected set, or lacks one the config implies."""

    default_code = "adapter_tensor_unexpected"


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must fit: the base model's layer count, projection widths and module names.

    Built from the parsed ``config.json`` by :meth:`core.model_sizes.ModelSizes.base_shapes`.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int  # num_heads * head_dim
    kv_size: int  # num_kv_heads * head_dim
    model_type: str = ""  # config.json's; picks the module names adapters use (core.projections.FAMILY_MODULES)

    @property
    def modules(self) -> AdapterModules:
        """The modules this base model's adapters may target."""
        return adapter_modules(self.model_type)

    def in_out(self, projection: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of a projection, or of a fused module (rows of its projections)."""
        h, i = self.hidden_size, self.intermediate_size
        sizes = {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        if projection in sizes:
            return sizes[projection]
        module = self.modules.get(projection)
        if module is None:
            raise KeyError(projection)
        return sizes[module.projections[0]][0], sum(sizes[p][1] for p in module.projections)


@dataclass(frozen=True)
class LoraModule:
    """One adapted module of one layer, as declared by the config and found in the header."""

    layer: int
    projection: str  # the module's name in the family (q_proj, ..., or Phi-3's fused qkv_proj, gate_up_proj)
    rank: int
    alpha: float
    scale: float
    a_key: str
    b_key: str
    slices: tuple[tuple[str, int], ...]  # (projection, rows of B) in B's row order: one entry unless fused


@dataclass(frozen=True)
class AdapterSpec:
    """A validated adapter: every adapted module with its rank and scale; no tensors loaded yet."""

    path: Path
    modules: tuple[LoraModule, ...]
    use_rslora: bool
    dtype: str  # safetensors dtype name(s) of the LoRA tensors, e.g. "F32" or "BF16/F32"

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)

    def parameter_count(self, base: BaseShapes) -> int:
        """Number of LoRA weights (A and B together)."""
        return sum(m.rank * sum(base.in_out(m.projection)) for m in self.modules)


@dataclass
class LoraTensors:
    """PEFT tensors of one module: ``a`` is ``[r, in]``, ``b`` is ``[out, r]``."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass
class AdapterWeights:
    """Tensors of every adapted projection, keyed by ``(layer, projection)`` with our projection names.

    A fused module's LoRA (Phi-3's qkv_proj: A ``[r, hidden]``, B ``[q + 2 kv, r]``) is the LoRAs of its
    projections sharing A, each with its rows of B; it is stored that way, so the pool keeps one copy of A
    per projection (qkv_proj: 3 r hidden elements for A where the file has r hidden; gate_up_proj: 2).
    """

    modules: dict[tuple[int, str], LoraTensors]

    @property
    def max_rank(self) -> int:
        return max((t.a.shape[0] for t in self.modules.values()), default=0)


def module_name(layer: int, projection: str) -> str:
    """The module path PEFT matches patterns against, e.g. ``model.layers.3.self_attn.q_proj``."""
    return f"model.layers.{layer}.{_PARENTS[projection]}.{projection}"


# Every family's module names (fused ones too) and the module they sit under; a name has one parent in all.
_PARENTS = {m.name: m.parent for family in (SEPARATE_MODULES, FUSED_MODULES) for m in family.modules}


def _unknown_module_message(name: str, base: BaseShapes) -> str:
    family = f"a {base.model_type}" if base.model_type else "this"
    names = ", ".join(base.modules.names)
    return f"{name}, which {family} base model does not have; its LoRA target modules are {names}"


def read_adapter_config(adapter_dir: str | Path) -> dict[str, Any]:
    """Parse ``adapter_config.json`` (size-limited) into a dict."""
    path = Path(adapter_dir) / ADAPTER_CONFIG_FILE
    if not path.is_file():
        raise AdapterFileError(f"{ADAPTER_CONFIG_FILE} is missing from {adapter_dir}", param=ADAPTER_CONFIG_FILE)
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterFileError(f"{ADAPTER_CONFIG_FILE} is larger than 1 MiB", param=ADAPTER_CONFIG_FILE)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise AdapterFileError(
            f"{ADAPTER_CONFIG_FILE} is not valid JSON: {_json_problem(exc)}", param=ADAPTER_CONFIG_FILE
        ) from exc
    if not isinstance(config, dict):
        raise AdapterFileError(f"{ADAPTER_CONFIG_FILE} must hold a JSON object", param=ADAPTER_CONFIG_FILE)
    return config


def _json_problem(exc: Exception) -> str:
    # json raises RecursionError, not a decode error, for deeply nested input; say so rather than crash.
    return "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)


@dataclass(frozen=True)
class TensorHeader:
    dtype: str
    shape: tuple[int, ...]


def read_header_json(path: str | Path) -> tuple[dict[str, Any], int, int]:
    """A safetensors file's header as JSON (``__metadata__`` included), where its data starts, and the file's
    size. The length field is checked against the file's size and ``MAX_HEADER_BYTES`` before anything is read,
    so a small file cannot make a reader allocate the gigabytes it claims."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise AdapterFileError(f"{path.name} is too short to be safetensors", param=path.name)
        n = int.from_bytes(prefix, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise AdapterFileError(f"{path.name} has a corrupt safetensors header length", param=path.name)
        try:
            raw = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise AdapterFileError(
                f"{path.name} has an unreadable header: {_json_problem(exc)}", param=path.name
            ) from exc
    if not isinstance(raw, dict):
        raise AdapterFileError(f"{path.name} header is not a JSON object", param=path.name)
    return raw, 8 + n, size


def read_safetensors_header(path: str | Path) -> dict[str, TensorHeader]:
    """Tensor names, dtypes and shapes from a safetensors header, checked for internal consistency."""
    path = Path(path)
    raw, data_start, size = read_header_json(path)
    raw.pop("__metadata__", None)
    data_bytes = size - data_start
    tensors: dict[str, TensorHeader] = {}
    for key, info in raw.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise AdapterFileError(f"{path.name}: malformed header entry for {key!r}", param=key) from exc
        if dtype not in DTYPE_BYTES:
            raise AdapterShapeError(f"tensor {key} has dtype {dtype}; only F32, F16 and BF16 are served", param=key)
        if not (0 <= begin <= end <= data_bytes) or end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise AdapterFileError(f"{path.name}: data offsets of {key} do not match its shape", param=key)
        tensors[key] = TensorHeader(dtype, shape)
    return tensors


def _check_files(adapter_dir: Path) -> Path:
    if not adapter_dir.is_dir():
        raise AdapterFileError(f"adapter directory {adapter_dir} does not exist", param="adapter_dir")
    pickles = sorted(p.name for p in adapter_dir.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise AdapterFileError(
            f"{pickles[0]} is a pickle file, which is never loaded; save the adapter with safetensors "
            "(PEFT save_pretrained(safe_serialization=True)) and remove the pickle files",
            param=pickles[0],
        )
    weights = adapter_dir / ADAPTER_WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterFileError(f"{ADAPTER_WEIGHTS_FILE} is missing from {adapter_dir}", param=ADAPTER_WEIGHTS_FILE)
    return weights


def _is_unset(value: Any) -> bool:
    return value is None or value is False or value == "" or (isinstance(value, dict | list) and not value)


def _check_features(config: dict[str, Any]) -> None:
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise UnsupportedAdapterError(f"peft_type is {peft_type!r}; only 'LORA' adapters are served", param="peft_type")
    if config.get("use_dora"):
        raise UnsupportedAdapterError("DoRA (use_dora=true) adapters are not served", param="use_dora")
    if not _is_unset(config.get("modules_to_save")):
        raise UnsupportedAdapterError(
            "modules_to_save replaces whole base modules per adapter, which is not served", param="modules_to_save"
        )
    if config.get("bias", "none") != "none":
        raise UnsupportedAdapterError(
            f"bias={config.get('bias')!r} trains base biases; only 'none' is served", param="bias"
        )
    if config.get("lora_bias"):
        raise UnsupportedAdapterError("lora_bias=true (a bias on lora_B) is not served", param="lora_bias")
    if "auto_map" in config:
        raise UnsupportedAdapterError("auto_map refers to custom code, which is never run", param="auto_map")
    mapping = config.get("auto_mapping")
    if mapping is not None:
        library = mapping.get("parent_library", "") if isinstance(mapping, dict) else ""
        if not (isinstance(library, str) and library.startswith("transformers.")):
            raise UnsupportedAdapterError(
                "auto_mapping refers to code outside transformers, which is never run", param="auto_mapping"
            )
    for field, value in config.items():
        if field not in HANDLED_FIELDS and field not in IGNORED_FIELDS and not _is_unset(value):
            raise UnsupportedAdapterError(f"{field}={value!r} is a PEFT feature that is not served", param=field)


def _positive_number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise AdapterConfigError(f"{field} must be a number > 0, got {value!r}", param=field)
    return float(value)


def _rank(value: Any, field: str, max_rank: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AdapterConfigError(f"{field} must be an integer, got {value!r}", param=field)
    if not 1 <= value <= max_rank:
        raise AdapterConfigError(f"{field}={value} is outside the served range 1..{max_rank}", param=field)
    return value


def _pattern_dict(config: dict[str, Any], field: str) -> dict[str, Any]:
    value = config.get(field) or {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise AdapterConfigError(f"{field} must map module patterns to numbers", param=field)
    return value


def _pattern_value(patterns: dict[str, Any], key: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the first pattern that matches a suffix of the module name wins."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return patterns[pattern]
    return default


def _matches(spec: str | list[str], key: str) -> bool:
    if isinstance(spec, str):
        return re.fullmatch(spec, key) is not None
    return key in spec or any(key.endswith(f".{name}") for name in spec)


def _targets(config: dict[str, Any], base: BaseShapes) -> set[tuple[int, str]]:
    """The (layer, projection) pairs PEFT would adapt, following its matching rules."""
    names = base.modules.names
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = list(names)
    if not (isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        raise AdapterConfigError(
            "target_modules must be a list of module names or a regex string", param="target_modules"
        )
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as exc:
            raise AdapterConfigError(f"target_modules is not a valid regex: {exc}", param="target_modules") from exc
    for outside in ("lm_head", "model.embed_tokens", "model.norm"):
        if _matches(targets, outside):
            raise UnsupportedAdapterError(
                f"target_modules adapts {outside}; only q/k/v/o/gate/up/down projections are served",
                param="target_modules",
            )
    for target in targets if isinstance(targets, list) else ():
        if target.rsplit(".", 1)[-1] not in names:
            raise AdapterConfigError(
                f"target_modules names {_unknown_module_message(target, base)}", param="target_modules"
            )
    excluded = config.get("exclude_modules")
    if excluded is not None and not (
        isinstance(excluded, str) or (isinstance(excluded, list) and all(isinstance(e, str) for e in excluded))
    ):
        raise AdapterConfigError("exclude_modules must be a list of module names or a regex", param="exclude_modules")
    layers = config.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and not (isinstance(layers, list) and all(isinstance(i, int) for i in layers)):
        raise AdapterConfigError(
            "layers_to_transform must be an integer or a list of integers", param="layers_to_transform"
        )
    found = set()
    for layer in range(base.num_layers):
        for name in names:
            key = module_name(layer, name)
            if excluded and _matches(excluded, key):
                continue
            # PEFT applies layers_to_transform only to list-style target_modules.
            if _matches(targets, key) and (isinstance(targets, str) or not layers or layer in layers):
                found.add((layer, name))
    return found


def _parse_key(key: str, base: BaseShapes) -> tuple[int, str, str]:
    if "lora_embedding_" in key or ".embed_tokens." in key or key.split(".")[2:3] == ["lm_head"]:
        raise UnsupportedAdapterError(f"{key}: embedding and lm_head LoRA are not served", param=key)
    if "lora_magnitude_vector" in key:
        raise UnsupportedAdapterError(f"{key}: DoRA magnitude vectors are not served", param=key)
    m = _KEY_RE.match(key)
    if m is None:
        raise UnexpectedTensorError(
            f"unexpected tensor {key}: only LoRA A/B weights of {', '.join(base.modules.names)}", param=key
        )
    layer, proj = int(m["layer"]), m["proj"]
    module = base.modules.get(proj)
    if module is None:
        raise UnexpectedTensorError(f"unexpected tensor {key}: {_unknown_module_message(proj, base)}", param=key)
    if m["parent"] != module.parent:
        raise UnexpectedTensorError(f"unexpected tensor {key}: {proj} is not under {m['parent']}", param=key)
    if layer >= base.num_layers:
        raise UnexpectedTensorError(f"{key}: the base model has only {base.num_layers} layers", param=key)
    return layer, proj, m["ab"]


def inspect_adapter(adapter_dir: str | Path, base: BaseShapes, max_rank: int) -> AdapterSpec:
    """Validate a PEFT LoRA directory against ``base`` without loading tensors."""
    adapter_dir = Path(adapter_dir)
    weights = _check_files(adapter_dir)
    config = read_adapter_config(adapter_dir)
    _check_features(config)
    default_rank = _rank(config.get("r", 8), "r", max_rank)
    default_alpha = _positive_number(config.get("lora_alpha", 8), "lora_alpha")
    rank_pattern, alpha_pattern = _pattern_dict(config, "rank_pattern"), _pattern_dict(config, "alpha_pattern")
    for value in rank_pattern.values():
        _rank(value, "rank_pattern", max_rank)
    for value in alpha_pattern.values():
        _positive_number(value, "alpha_pattern")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterConfigError("use_rslora must be true or false", param="use_rslora")
    targets = _targets(config, base)

    keys: dict[tuple[int, str], dict[str, str]] = {}
    headers = read_safetensors_header(weights)
    for key in headers:
        layer, proj, ab = _parse_key(key, base)
        pair = keys.setdefault((layer, proj), {})
        if ab in pair:
            raise UnexpectedTensorError(f"{key} duplicates {pair[ab]}", param=key)
        pair[ab] = key
    _check_key_set(keys, targets)

    dtypes = {h.dtype for h in headers.values()}
    order = base.modules.names
    modules = []
    for (layer, proj), pair in sorted(keys.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1]))):
        name = module_name(layer, proj)
        rank = _pattern_value(rank_pattern, name, default_rank)
        alpha = float(_pattern_value(alpha_pattern, name, default_alpha))
        _check_shapes(headers, pair, base.in_out(proj), rank, name)
        scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        slices = tuple((p, base.in_out(p)[1]) for p in base.modules.get(proj).projections)  # type: ignore[union-attr]
        modules.append(LoraModule(layer, proj, rank, alpha, scale, pair["A"], pair["B"], slices))
    if not modules:
        raise UnexpectedTensorError(f"{ADAPTER_WEIGHTS_FILE} holds no LoRA tensors", param=ADAPTER_WEIGHTS_FILE)
    return AdapterSpec(path=adapter_dir, modules=tuple(modules), use_rslora=use_rslora, dtype="/".join(sorted(dtypes)))


def _check_key_set(keys: dict[tuple[int, str], dict[str, str]], targets: Iterable[tuple[int, str]]) -> None:
    targets = set(targets)
    for (layer, proj), pair in sorted(keys.items()):
        if (layer, proj) not in targets:
            key = next(iter(pair.values()))
            raise UnexpectedTensorError(
                f"{key}: {module_name(layer, proj)} is not targeted by target_modules/layers_to_transform", param=key
            )
        for ab in "AB":
            if ab not in pair:
                raise UnexpectedTensorError(f"lora_{ab} of {module_name(layer, proj)} is missing", param=pair.get("A"))
    missing = sorted(targets - set(keys))
    if missing:
        layer, proj = missing[0]
        raise UnexpectedTensorError(
            f"target_modules selects {module_name(layer, proj)} but the weights file has no LoRA tensors for it",
            param="target_modules",
        )


def _check_shapes(
    headers: dict[str, TensorHeader], pair: dict[str, str], in_out: tuple[int, int], rank: int, name: str
) -> None:
    in_features, out_features = in_out
    a, b = headers[pair["A"]].shape, headers[pair["B"]].shape
    if len(a) != 2 or a[1] != in_features:
        raise AdapterShapeError(f"{pair['A']} has shape {list(a)}; the base needs [r, {in_features}]", param=pair["A"])
    if len(b) != 2 or b[0] != out_features:
        raise AdapterShapeError(f"{pair['B']} has shape {list(b)}; the base needs [{out_features}, r]", param=pair["B"])
    if a[0] != rank or b[1] != rank:
        raise AdapterShapeError(
            f"{name} has rank {a[0]} (A) / {b[1]} (B) but r/rank_pattern declares {rank}", param=pair["A"]
        )


def load_adapter_weights(spec: AdapterSpec) -> AdapterWeights:
    """Read the validated tensors (through safetensors, never pickle) in fp32, a fused module's split into
    its projections: one shared A, B cut by rows (see :class:`AdapterWeights`)."""
    import torch
    from safetensors import safe_open

    modules: dict[tuple[int, str], LoraTensors] = {}
    with safe_open(str(spec.path / ADAPTER_WEIGHTS_FILE), framework="pt") as f:
        for m in spec.modules:
            a = f.get_tensor(m.a_key).to(torch.float32)
            b = f.get_tensor(m.b_key).to(torch.float32)
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise AdapterShapeError(f"{module_name(m.layer, m.projection)} holds NaN or inf", param=m.a_key)
            rows = b.split([n for _, n in m.slices])
            for (projection, _), b_rows in zip(m.slices, rows, strict=True):
                modules[(m.layer, projection)] = LoraTensors(a=a, b=b_rows, scale=m.scale)
    return AdapterWeights(modules)

"""Base fingerprints tell same-shaped bases apart, survive a change of dtype, and travel in adapter files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.base_fingerprint import (
    BaseFingerprint,
    BaseModelMismatch,
    _to_bfloat16_bits,
    check_origin,
    check_recorded,
    fingerprint_base,
    read_adapter_origin,
)
from core.tiny_model import TinyModelSpec, make_tiny_model
from trainer.manifest import stamp_origin


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bases")
    return make_tiny_model(root / "a"), make_tiny_model(root / "b", TinyModelSpec(seed=1))


def _weights(model_dir: Path) -> Path:
    [path] = model_dir.glob("*.safetensors")
    return path


def test_same_shapes_other_weights_differ(bases: tuple[Path, Path]) -> None:
    a, b = bases
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    assert fingerprint_base(a).digest != fingerprint_base(b).digest
    assert fingerprint_base(a).digest == fingerprint_base(a, "renamed").digest
    assert fingerprint_base(a).digest.startswith("bfp1:")


def test_a_bf16_copy_and_a_resaved_config_keep_the_fingerprint(bases: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = bases
    copy = Path(shutil.copytree(a, tmp_path / "copy"))
    tensors = load_file(_weights(copy))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(_weights(copy)), metadata={"format": "pt"})
    config = json.loads((copy / "config.json").read_text())
    config.update(transformers_version="9.9.9", torch_dtype="bfloat16", _name_or_path="/elsewhere")
    (copy / "config.json").write_text(json.dumps(config, indent=4))
    assert fingerprint_base(copy).digest == fingerprint_base(a).digest

    config["rms_norm_eps"] = 1e-3  # changes what the weights compute
    (copy / "config.json").write_text(json.dumps(config))
    assert fingerprint_base(copy).digest != fingerprint_base(a).digest


def test_one_sampled_weight_changed_changes_it(bases: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = bases
    copy = Path(shutil.copytree(a, tmp_path / "copy"))
    tensors = load_file(_weights(copy))
    tensors["model.norm.weight"][0] += 1.0  # the first element is always sampled
    save_file(tensors, str(_weights(copy)))
    assert fingerprint_base(copy).digest != fingerprint_base(a).digest


def test_bfloat16_rounding_matches_torch() -> None:
    values = torch.randn(4096) * torch.logspace(-8, 8, 4096)
    values[:3] = torch.tensor([0.0, -0.0, float("inf")])
    ours = _to_bfloat16_bits(values.numpy())
    theirs = values.to(torch.bfloat16).view(torch.int16).numpy().view("<u2")
    assert (ours == theirs).all()


def test_a_stamped_adapter_records_its_base(bases: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = bases
    weights = tmp_path / "adapter_model.safetensors"
    save_file({"x": torch.ones(2, 2)}, str(weights), metadata={"format": "pt"})
    assert read_adapter_origin(weights) is None
    check_origin(None, fingerprint_base(a, "a"))  # adapters made elsewhere record nothing and are not refused

    stamp_origin(weights, fingerprint_base(b, "base-b"))
    origin = read_adapter_origin(weights)
    assert origin is not None and (origin.base_model, origin.fingerprint) == ("base-b", fingerprint_base(b).digest)
    assert torch.equal(load_file(weights)["x"], torch.ones(2, 2))
    check_origin(origin, fingerprint_base(b, "served-name"))
    with pytest.raises(BaseModelMismatch, match=r"made on base model 'base-b'.*not on 'a'") as refused:
        check_origin(origin, fingerprint_base(a, "a"))
    assert (refused.value.code, refused.value.param) == ("base_model_mismatch", "model")


def test_a_recorded_fingerprint_must_match_the_served_base() -> None:
    served = BaseFingerprint("tiny", "bfp1:" + "a" * 64)
    check_recorded(None, served, "ft:tiny:x")
    check_recorded(served.digest, served, "ft:tiny:x")
    with pytest.raises(BaseModelMismatch, match="its weights changed"):
        check_recorded("bfp1:" + "b" * 64, served, "ft:tiny:x")

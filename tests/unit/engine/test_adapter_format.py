"""PEFT adapter parsing: what we accept, and every refusal naming its field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from core.adapter_format import (
    AdapterConfigError,
    AdapterFileError,
    AdapterShapeError,
    BaseShapes,
    UnexpectedTensorError,
    UnsupportedAdapterError,
    inspect_adapter,
    load_adapter_weights,
)
from core.errors import InvalidRequest

BASE = BaseShapes(num_layers=2, hidden_size=16, intermediate_size=24, q_size=16, kv_size=8)
PHI3 = BaseShapes(num_layers=2, hidden_size=16, intermediate_size=24, q_size=16, kv_size=8, model_type="phi3")
PREFIX = "base_model.model.model.layers"


def _key(layer: int, proj: str, ab: str, default: bool = False) -> str:
    parent = "mlp" if proj in ("gate_proj", "up_proj", "gate_up_proj", "down_proj") else "self_attn"
    return f"{PREFIX}.{layer}.{parent}.{proj}.lora_{ab}{'.default' if default else ''}.weight"


def write_adapter(
    path: Path,
    config: dict | None = None,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    rank: int | dict = 4,
    layers: tuple[int, ...] = (0, 1),
    tensors: dict | None = None,
    base: BaseShapes = BASE,
) -> Path:
    """A PEFT-style adapter directory; ``rank`` may map projection -> rank."""
    path.mkdir(parents=True, exist_ok=True)
    base_config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": list(targets), "bias": "none"}
    base_config.update(config or {})
    (path / "adapter_config.json").write_text(json.dumps(base_config))
    if tensors is None:
        tensors = {}
        for layer in layers:
            for proj in targets:
                r = rank[proj] if isinstance(rank, dict) else rank
                in_f, out_f = base.in_out(proj)
                tensors[_key(layer, proj, "A")] = torch.randn(r, in_f)
                tensors[_key(layer, proj, "B")] = torch.randn(out_f, r)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def refused(
    path: Path, error: type, param: str | None = None, max_rank: int = 64, base: BaseShapes = BASE
) -> InvalidRequest:
    with pytest.raises(error) as info:
        inspect_adapter(path, base, max_rank)
    if param is not None:
        assert info.value.param == param, info.value.message
    assert isinstance(info.value, InvalidRequest)  # maps to HTTP 400 in the API
    return info.value


def test_accepts_peft_layout_with_patterns_and_rslora(tmp_path):
    path = write_adapter(
        tmp_path,
        config={"rank_pattern": {"layers.1.self_attn.v_proj": 2}, "alpha_pattern": {"q_proj": 12}, "use_rslora": True},
        tensors={
            _key(0, "q_proj", "A"): torch.randn(4, 16),
            _key(0, "q_proj", "B"): torch.randn(16, 4),
            _key(0, "v_proj", "A"): torch.randn(4, 16),
            _key(0, "v_proj", "B"): torch.randn(8, 4),
            _key(1, "q_proj", "A", default=True): torch.randn(4, 16),
            _key(1, "q_proj", "B", default=True): torch.randn(16, 4),
            _key(1, "v_proj", "A"): torch.randn(2, 16),
            _key(1, "v_proj", "B"): torch.randn(8, 2),
        },
    )
    spec = inspect_adapter(path, BASE, max_rank=8)
    by_key = {(m.layer, m.projection): m for m in spec.modules}
    assert by_key[(1, "v_proj")].rank == 2
    assert by_key[(0, "q_proj")].scale == pytest.approx(12 / 2.0)  # alpha_pattern, rsLoRA: alpha / sqrt(4)
    assert by_key[(1, "v_proj")].scale == pytest.approx(8 / 2**0.5)
    weights = load_adapter_weights(spec)
    assert weights.modules[(1, "v_proj")].b.shape == (8, 2)
    assert weights.max_rank == 4


def test_regex_targets_and_layers_to_transform(tmp_path):
    regex = write_adapter(tmp_path / "regex", config={"target_modules": r".*\.mlp\.(gate_proj|down_proj)"},
                          targets=("gate_proj", "down_proj"))  # fmt: skip
    assert {m.projection for m in inspect_adapter(regex, BASE, 8).modules} == {"gate_proj", "down_proj"}
    layer1 = write_adapter(tmp_path / "layer1", config={"layers_to_transform": [1]}, layers=(1,))
    assert {m.layer for m in inspect_adapter(layer1, BASE, 8).modules} == {1}


@pytest.mark.parametrize(
    ("config", "param"),
    [
        ({"peft_type": "IA3"}, "peft_type"),
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "lora_only"}, "bias"),
        ({"lora_bias": True}, "lora_bias"),
        ({"auto_map": {"AutoModel": "modeling_evil.Evil"}}, "auto_map"),
        ({"auto_mapping": {"base_model_class": "Evil", "parent_library": "evil_pkg.modeling"}}, "auto_mapping"),
        ({"layer_replication": [[0, 2]]}, "layer_replication"),
        ({"trainable_token_indices": [5]}, "trainable_token_indices"),
        ({"target_modules": ["q_proj", "v_proj", "lm_head"]}, "target_modules"),
        ({"target_modules": r".*(embed_tokens|q_proj|v_proj)"}, "target_modules"),
    ],
)
def test_refuses_features_we_cannot_serve_exactly(tmp_path, config, param):
    refused(write_adapter(tmp_path, config=config), UnsupportedAdapterError, param)


def test_accepts_the_auto_mapping_peft_writes_for_stock_models(tmp_path):
    mapping = {"base_model_class": "LlamaForCausalLM", "parent_library": "transformers.models.llama.modeling_llama"}
    assert inspect_adapter(write_adapter(tmp_path, config={"auto_mapping": mapping}), BASE, 8).modules


@pytest.mark.parametrize(
    ("config", "param", "max_rank"),
    [
        ({"r": 0}, "r", 64),
        ({"r": 4}, "r", 2),
        ({"rank_pattern": {"q_proj": 0}}, "rank_pattern", 64),
        ({"rank_pattern": {"q_proj": 128}}, "rank_pattern", 64),
        ({"lora_alpha": 0}, "lora_alpha", 64),
        ({"lora_alpha": -1.5}, "lora_alpha", 64),
        ({"alpha_pattern": {"v_proj": 0}}, "alpha_pattern", 64),
        ({"target_modules": 3}, "target_modules", 64),
        ({"use_rslora": "yes"}, "use_rslora", 64),
    ],
)
def test_refuses_values_out_of_range(tmp_path, config, param, max_rank):
    refused(write_adapter(tmp_path, config=config), AdapterConfigError, param, max_rank=max_rank)


def test_refuses_embedding_and_lm_head_tensors(tmp_path):
    tensors = {
        f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 16),
        f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.randn(16, 4),
        "base_model.model.model.embed_tokens.lora_embedding_A": torch.randn(4, 32),
    }
    error = refused(write_adapter(tmp_path / "emb", targets=("q_proj",), layers=(0,), tensors=tensors),
                    UnsupportedAdapterError)  # fmt: skip
    assert "embed" in error.message
    tensors = {"base_model.model.lm_head.lora_A.weight": torch.randn(4, 16)}
    refused(write_adapter(tmp_path / "head", tensors=tensors), UnsupportedAdapterError)


def test_refuses_dora_magnitude_tensors(tmp_path):
    path = write_adapter(tmp_path, targets=("q_proj",), layers=(0, 1))
    tensors = {
        **{k: torch.randn(*v) for k, v in ((_key(layer, "q_proj", "A"), (4, 16)) for layer in (0, 1))},
        **{k: torch.randn(*v) for k, v in ((_key(layer, "q_proj", "B"), (16, 4)) for layer in (0, 1))},
        f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector": torch.randn(16),
    }
    save_file(tensors, str(path / "adapter_model.safetensors"))
    refused(path, UnsupportedAdapterError, f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector")


def test_refuses_tensors_that_do_not_fit_the_base(tmp_path):
    wrong_in = write_adapter(tmp_path / "in", targets=("q_proj",), tensors={
        _key(layer, "q_proj", ab): torch.randn(*(4, 15) if ab == "A" else (16, 4)) for layer in (0, 1) for ab in "AB"
    })  # fmt: skip
    refused(wrong_in, AdapterShapeError, _key(0, "q_proj", "A"))
    wrong_rank = write_adapter(tmp_path / "rank", targets=("q_proj",), rank=6)  # config says r=4
    assert "rank" in refused(wrong_rank, AdapterShapeError).message
    bad_dtype = write_adapter(tmp_path / "dtype", targets=("q_proj",), tensors={
        _key(layer, "q_proj", ab): torch.ones(*(4, 16) if ab == "A" else (16, 4), dtype=torch.int8)
        for layer in (0, 1) for ab in "AB"
    })  # fmt: skip
    refused(bad_dtype, AdapterShapeError)
    too_deep = write_adapter(tmp_path / "layer", targets=("q_proj",), layers=(0, 1, 2))
    refused(too_deep, UnexpectedTensorError, _key(2, "q_proj", "A"))


def test_refuses_keys_outside_the_expected_set(tmp_path):
    extra = write_adapter(tmp_path / "extra", targets=("q_proj",))
    tensors = {_key(layer, "q_proj", ab): torch.randn(*(4, 16) if ab == "A" else (16, 4))
               for layer in (0, 1) for ab in "AB"}  # fmt: skip
    tensors["base_model.model.model.layers.0.self_attn.rotary_emb.weird"] = torch.randn(2)
    save_file(tensors, str(extra / "adapter_model.safetensors"))
    refused(extra, UnexpectedTensorError, "base_model.model.model.layers.0.self_attn.rotary_emb.weird")

    untargeted = write_adapter(tmp_path / "untargeted", config={"target_modules": ["q_proj"]},
                               targets=("q_proj", "v_proj"))  # fmt: skip
    refused(untargeted, UnexpectedTensorError, _key(0, "v_proj", "A"))

    missing_b = write_adapter(tmp_path / "missing_b", targets=("q_proj",), tensors={
        _key(layer, "q_proj", "A"): torch.randn(4, 16) for layer in (0, 1)
    })  # fmt: skip
    assert "lora_B" in refused(missing_b, UnexpectedTensorError).message

    missing_module = write_adapter(tmp_path / "missing", targets=("q_proj",), layers=(0,))
    refused(missing_module, UnexpectedTensorError, "target_modules")


def test_refuses_missing_pickled_or_corrupt_files(tmp_path):
    refused(tmp_path / "nowhere", AdapterFileError)
    no_config = write_adapter(tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    refused(no_config, AdapterFileError, "adapter_config.json")
    no_weights = write_adapter(tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    refused(no_weights, AdapterFileError, "adapter_model.safetensors")
    pickled = write_adapter(tmp_path / "pickled")
    # Not a valid pickle either: refusal must come from the name, without ever opening it.
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04 never unpickled")
    refused(pickled, AdapterFileError, "adapter_model.bin")
    bad_json = write_adapter(tmp_path / "bad_json")
    (bad_json / "adapter_config.json").write_text("{not json")
    refused(bad_json, AdapterFileError, "adapter_config.json")
    corrupt = write_adapter(tmp_path / "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    refused(corrupt, AdapterFileError)


PHI3_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def test_phi3_fused_modules_load_as_projections_sharing_a(tmp_path):
    """Phi-3's qkv_proj LoRA is the q, k and v LoRAs with one A and B cut by rows; gate_up_proj likewise."""
    path = write_adapter(
        tmp_path,
        config={"rank_pattern": {"gate_up_proj": 2}},
        targets=PHI3_MODULES,
        rank={"qkv_proj": 4, "o_proj": 4, "gate_up_proj": 2, "down_proj": 4},
        base=PHI3,
    )
    spec = inspect_adapter(path, PHI3, max_rank=8)
    assert [m.projection for m in spec.modules if m.layer == 0] == list(PHI3_MODULES)
    assert spec.parameter_count(PHI3) == 2 * (4 * (16 + 32) + 4 * (16 + 16) + 2 * (16 + 48) + 4 * (24 + 16))
    weights = load_adapter_weights(spec)
    assert sorted(p for layer, p in weights.modules if layer == 1) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    q, k, v = (weights.modules[(1, p)] for p in ("q_proj", "k_proj", "v_proj"))
    assert q.a is k.a is v.a and q.a.shape == (4, 16)
    b = torch.cat([q.b, k.b, v.b])
    from safetensors.torch import load_file

    stored = load_file(str(path / "adapter_model.safetensors"))
    assert torch.equal(b, stored[_key(1, "qkv_proj", "B")])
    gate, up = weights.modules[(0, "gate_proj")], weights.modules[(0, "up_proj")]
    assert gate.b.shape == up.b.shape == (24, 2) and gate.scale == up.scale == 8 / 2
    assert torch.equal(torch.cat([gate.b, up.b]), stored[_key(0, "gate_up_proj", "B")])
    all_linear = write_adapter(
        tmp_path / "all", config={"target_modules": "all-linear"}, targets=PHI3_MODULES, base=PHI3
    )
    assert {m.projection for m in inspect_adapter(all_linear, PHI3, 8).modules} == set(PHI3_MODULES)


@pytest.mark.parametrize(
    ("base", "targets", "names"),
    [
        (PHI3, ["q_proj", "v_proj"], "qkv_proj, o_proj, gate_up_proj, down_proj"),
        (PHI3, ["qkv_proj", "model.layers.0.mlp.gate_proj"], "qkv_proj, o_proj, gate_up_proj, down_proj"),
        (BASE, ["qkv_proj"], "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
    ],
)
def test_refuses_modules_the_family_does_not_have(tmp_path, base, targets, names):
    path = write_adapter(tmp_path, config={"target_modules": targets})  # refused from the config alone
    error = refused(path, AdapterConfigError, "target_modules", base=base)
    assert names in error.message
    assert (f"a {base.model_type} base model" if base.model_type else "this base model") in error.message


def test_refuses_tensors_of_modules_the_family_does_not_have(tmp_path):
    """A regex target cannot be checked by name; the tensors are, and the refusal lists the family's modules."""
    path = write_adapter(tmp_path, config={"target_modules": r".*\.(q_proj|qkv_proj)"}, targets=("q_proj",))
    error = refused(path, UnexpectedTensorError, _key(0, "q_proj", "A"), base=PHI3)
    assert "qkv_proj, o_proj, gate_up_proj, down_proj" in error.message

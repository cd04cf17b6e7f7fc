"""Input built to break parsers or slip past checks: deeply nested JSON, UTF-16 text, NaN weights. Each
is reported as the user's mistake (a typed 400), never a crash of the code reading it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from core.adapter_format import AdapterFileError, AdapterShapeError, inspect_adapter
from core.adapter_values import check_finite_weights
from core.base_fingerprint import read_adapter_origin
from core.dataset_format import validate_lines
from tests.unit.engine.test_adapter_format import BASE, write_adapter

NESTED = "[" * 100_000 + "]" * 100_000
GOOD_LINE = json.dumps({"prompt": "p", "completion": "c"})


def test_a_deeply_nested_line_is_a_problem_of_its_line() -> None:
    report = validate_lines([GOOD_LINE, '{"prompt": ' + NESTED + "}"])
    assert [str(p) for p in report.problems] == ["line 2: invalid JSON: nested too deeply"]


def test_utf16_lines_are_named_as_such() -> None:
    lines = (GOOD_LINE + "\n" + GOOD_LINE).encode("utf-16-le").split(b"\n\x00")
    report = validate_lines(lines)
    assert [p.line for p in report.problems] == [1, 2]
    assert all("is the file UTF-16?" in p.message for p in report.problems)


@pytest.mark.parametrize("where", ["config", "header"])
def test_deeply_nested_adapter_json_is_refused(tmp_path: Path, where: str) -> None:
    adapter = write_adapter(tmp_path / "a")
    if where == "config":
        (adapter / "adapter_config.json").write_text('{"peft_type": ' + NESTED + "}")
    else:
        header = ('{"x": ' + NESTED + "}").encode()
        (adapter / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(AdapterFileError, match="nested too deeply"):
        inspect_adapter(adapter, BASE, 64)


@pytest.mark.parametrize("claimed", [8 << 30, 50 << 20, 1 << 63])
def test_a_header_length_that_claims_gigabytes_is_refused_before_reading(tmp_path: Path, claimed: int) -> None:
    """The 8-byte length field is checked against the file's size (and a 100 MB cap) before the header is read,
    so a 100-byte file cannot make a reader allocate what it claims."""
    adapter = write_adapter(tmp_path / "a")
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(claimed.to_bytes(8, "little") + b'{"__metadata__": {}}' + b" " * 72)
    with pytest.raises(AdapterFileError, match="corrupt safetensors header length") as refused:
        inspect_adapter(adapter, BASE, 64)
    assert refused.value.param == "adapter_model.safetensors"
    assert read_adapter_origin(weights) is None  # the fingerprint reader refuses it too (and says nothing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), None])
def test_non_finite_weights_are_found_in_every_dtype(tmp_path: Path, dtype: torch.dtype, value: float | None) -> None:
    tensors = {}
    for layer in (0, 1):
        for proj in ("q_proj", "v_proj"):
            in_f, out_f = BASE.in_out(proj)
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(4, in_f).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, 4).to(dtype)
    last = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    if value is not None:
        tensors[last][-1, -1] = value  # the very last element of the file's last tensor
    adapter = write_adapter(tmp_path / "a", tensors={})
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    spec = inspect_adapter(adapter, BASE, 64)

    if value is None:
        check_finite_weights(spec)
    else:
        with pytest.raises(AdapterShapeError, match=r"model\.layers\.1\.self_attn\.v_proj holds NaN or inf") as info:
            check_finite_weights(spec)
        assert info.value.param == last

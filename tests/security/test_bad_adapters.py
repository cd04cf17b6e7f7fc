"""Adapters a tenant must not be able to bring in, at upload (through the API) and at load (on a server):
each is refused saying what is wrong, nothing is unpickled (a payload that would create a file never
does), nothing is stored, and serving goes on. Names that happen to be Python attributes work normally.

Loading by path on a server (``..``, ``/``, absolute paths, symlinks out of the adapter root) and stored
adapters failing their checks are swept in ``tests/integration/server/test_bad_adapters.py``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from core.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from tests.integration.api.peft_adapters import adapter_files, pickle_payload, with_config
from tests.integration.api_inference.deployment import Deployment
from tests.integration.server.adapters import Tensors, copy_adapter, edited
from tests.integration.server.harness import running, server_config
from tests.security.contract import Refusal, assert_refused, assert_still_serving, stores_nothing

pytestmark = pytest.mark.slow
Parts = list[tuple[str, tuple[str, bytes, str]]]
MAX_RANK = 16  # the serving deployment's max_lora_rank (tests/integration/api/conftest.py)
NESTED_JSON = b'{"peft_type": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
PYTHON_ATTRIBUTE_NAMES = ("double", "float", "train", "__class__")


def widen_a(tensors: Tensors) -> Tensors:
    return {k: torch.randn(v.shape[0], v.shape[1] + 1) if "lora_A" in k else v for k, v in tensors.items()}


def rank(r: int) -> Callable[[Tensors], Tensors]:
    def rewrite(tensors: Tensors) -> Tensors:
        return {
            k: torch.randn(r, v.shape[1]) if "lora_A" in k else torch.randn(v.shape[0], r) for k, v in tensors.items()
        }

    return rewrite


def with_nan(tensors: Tensors) -> Tensors:
    return {k: torch.full_like(v, float("nan")) if "lora_B" in k else v for k, v in tensors.items()}


def with_weights(good: Path, name: str, content: bytes) -> Parts:
    return [adapter_files(good)[0], (name, (name, content, "application/octet-stream"))]


def nested_config(good: Path) -> Parts:
    return [(ADAPTER_CONFIG_FILE, (ADAPTER_CONFIG_FILE, NESTED_JSON, "application/json")), adapter_files(good)[1]]


# name -> (the upload's parts from (a good adapter, a scratch dir, the pickle's marker file), form fields, refusal)
Build = Callable[[Path, Path, Path], Parts]
BAD_UPLOADS: dict[str, tuple[Build, dict[str, str], Refusal]] = {
    "pickle-bin": (
        lambda good, _, marker: with_weights(good, "adapter_model.bin", pickle_payload(marker)),
        {},
        Refusal(400, "pickle file, which is never loaded"),
    ),
    "pickle-as-safetensors": (
        lambda good, _, marker: with_weights(good, ADAPTER_WEIGHTS_FILE, pickle_payload(marker)),
        {},
        Refusal(400, ADAPTER_WEIGHTS_FILE, ADAPTER_WEIGHTS_FILE),
    ),
    "custom-code": (
        lambda good, *_: with_config(good, auto_map={"AutoModel": "evil.Model"}),
        {},
        Refusal(400, "custom code", "auto_map"),
    ),
    "dora": (lambda good, *_: with_config(good, use_dora=True), {}, Refusal(400, "DoRA", "use_dora")),
    "wrong-shapes": (
        lambda good, scratch, _: adapter_files(edited(good, scratch / "wide", tensors=widen_a)),
        {},
        Refusal(400, "shape"),
    ),
    "rank-above-limit": (
        lambda good, scratch, _: adapter_files(edited(good, scratch / "r32", {"r": 32, "lora_alpha": 64}, rank(32))),
        {},
        Refusal(400, f"outside the served range 1..{MAX_RANK}", "r"),
    ),
    "nan-weights": (
        lambda good, scratch, _: adapter_files(edited(good, scratch / "nan", tensors=with_nan)),
        {},
        Refusal(400, "NaN"),
    ),
    "nested-config": (lambda good, *_: nested_config(good), {}, Refusal(400, "nested too deeply", ADAPTER_CONFIG_FILE)),
    "suffix-dotdot": (lambda good, *_: adapter_files(good), {"suffix": "../x"}, Refusal(400, "suffix may", "suffix")),
    "suffix-slash": (lambda good, *_: adapter_files(good), {"suffix": "a/b"}, Refusal(400, "suffix may", "suffix")),
    "suffix-absolute": (lambda good, *_: adapter_files(good), {"suffix": "/etc"}, Refusal(400, "suffix may", "suffix")),
}


@pytest.mark.parametrize("case", sorted(BAD_UPLOADS))
def test_a_bad_adapter_upload_is_refused_and_nothing_is_kept(
    serving: Deployment, peft_adapter_dir: Path, tmp_path: Path, case: str
) -> None:
    marker = tmp_path / "unpickled"
    build, fields, expected = BAD_UPLOADS[case]
    parts = build(peft_adapter_dir, tmp_path, marker)
    tenant = serving.make_tenant()
    with tenant.http() as http, stores_nothing(serving, tenant):
        assert_refused(http.post("/v1/adapters", files=parts, data=fields), expected)
    assert not marker.exists()
    assert_still_serving(serving, tenant)


@pytest.mark.parametrize("suffix", PYTHON_ATTRIBUTE_NAMES[:3])
def test_adapters_named_like_python_attributes_work_normally(
    serving: Deployment, peft_adapter_dir: Path, suffix: str
) -> None:
    tenant = serving.make_tenant()
    with tenant.http() as http:
        uploaded = http.post("/v1/adapters", files=adapter_files(peft_adapter_dir), data={"suffix": suffix})
        assert uploaded.status_code == 200, uploaded.text
        model = uploaded.json()["model"]
        assert f":{suffix}:" in model
        for path, body in [
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ]:
            answer = http.post(path, json={"model": model, "max_tokens": 2, **body})
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == model
        assert http.delete(f"/v1/models/{model}").status_code == 200


def test_a_server_loads_adapters_named_like_python_attributes_and_refuses_nested_configs(
    tiny_model_dir: Path, peft_adapter_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "adapters"
    for name in PYTHON_ATTRIBUTE_NAMES:
        copy_adapter(peft_adapter_dir, root / name)
    nested = copy_adapter(peft_adapter_dir, root / "nested")
    (nested / ADAPTER_CONFIG_FILE).write_bytes(NESTED_JSON)
    base = tiny_model_dir.name

    with (
        running(server_config(tiny_model_dir, adapter_root=root, max_lora_rank=MAX_RANK)) as server,
        server.http() as http,
    ):
        refused = http.post("/v1/load_lora_adapter", json={"lora_name": "nested", "lora_path": "nested"})
        assert_refused(refused, Refusal(400, "nested too deeply", ADAPTER_CONFIG_FILE))
        for name in PYTHON_ATTRIBUTE_NAMES:
            loaded = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name})
            assert loaded.status_code == 200, loaded.text
            answer = http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
            assert (answer.status_code, answer.json()["model"]) == (200, name)
        listed = {m["id"] for m in http.get("/v1/models").json()["data"]}
        assert listed == {base, *PYTHON_ATTRIBUTE_NAMES}
        for name in PYTHON_ATTRIBUTE_NAMES:
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
        assert http.post("/v1/completions", json={"model": base, "prompt": "hi", "max_tokens": 2}).status_code == 200
        assert json.loads(http.get("/ready").text)["status"] == "ready"

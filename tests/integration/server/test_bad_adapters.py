"""Bad adapters, local or stored, are refused with a 4xx that says what is wrong, and the server keeps serving.

Nothing is unpickled (a pickle that would create a file never does), paths never leave the adapter root.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from core.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from core.base_fingerprint import BaseFingerprint, fingerprint_base
from core.descriptor import AdapterDescriptor
from core.protocol import ADAPTER_FIELD
from core.storage import S3ObjectStore
from core.tiny_model import TinyModelSpec, make_tiny_model
from tests.integration.api.peft_adapters import pickle_payload
from tests.integration.server.adapters import Tensors, copy_adapter, edited, made_on, upload
from tests.integration.server.harness import NO_EOS, ServerUnderTest, served, server_config

MAX_RANK = 16
A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def rank(r: int):
    def rewrite(tensors: Tensors) -> Tensors:
        return {
            k: torch.randn(r, v.shape[1]) if "lora_A" in k else torch.randn(v.shape[0], r) for k, v in tensors.items()
        }

    return rewrite


def widen_q_a(tensors: Tensors) -> Tensors:
    return {**tensors, A_KEY: torch.randn(tensors[A_KEY].shape[0], tensors[A_KEY].shape[1] + 1)}


def add_unknown_module(tensors: Tensors) -> Tensors:
    return {**tensors, A_KEY.replace("q_proj", "foo_proj"): torch.randn(8, 128)}


# name -> (config changes, tensor rewrite, words the error must contain)
BROKEN = {
    "rank-zero": ({"r": 0}, None, "r=0"),
    "rank-above-max": ({"r": 32, "lora_alpha": 64}, rank(32), f"1..{MAX_RANK}"),
    "wrong-shape": ({}, widen_q_a, "shape"),
    "unknown-module": ({}, add_unknown_module, "foo_proj"),
    "dora": ({"use_dora": True}, None, "DoRA"),
    "custom-code": ({"auto_map": {"AutoModel": "evil.Model"}}, None, "auto_map"),
    "negative-alpha": ({"lora_alpha": -4}, None, "lora_alpha"),
}


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory, peft_dir: Path) -> Path:
    """A perfectly good adapter outside the root: reachable only by escaping it."""
    return copy_adapter(peft_dir, tmp_path_factory.mktemp("outside") / "adapter")


@pytest.fixture(scope="module")
def marker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file the pickle payloads would create if anything unpickled them."""
    return tmp_path_factory.mktemp("marker") / "unpickled"


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> BaseFingerprint:
    """A base with the tiny model's shapes and other weights."""
    return fingerprint_base(make_tiny_model(tmp_path_factory.mktemp("twin") / "tiny-twin", TinyModelSpec(seed=1)))


@pytest.fixture(scope="module")
def adapter_root(
    tmp_path_factory: pytest.TempPathFactory, peft_dir: Path, outside: Path, marker: Path, twin: BaseFingerprint
) -> Path:
    root = tmp_path_factory.mktemp("root")
    copy_adapter(peft_dir, root / "good")
    made_on(peft_dir, root / "twin-made", twin)
    for name, (config, tensors, _) in BROKEN.items():
        edited(peft_dir, root / name, config=config, tensors=tensors)
    pickled = root / "pickled"
    pickled.mkdir()
    (pickled / ADAPTER_CONFIG_FILE).write_bytes((peft_dir / ADAPTER_CONFIG_FILE).read_bytes())
    (pickled / "adapter_model.bin").write_bytes(pickle_payload(marker))
    os.symlink(outside, root / "escape")
    file_link = root / "file-link"
    file_link.mkdir()
    (file_link / ADAPTER_CONFIG_FILE).write_bytes((peft_dir / ADAPTER_CONFIG_FILE).read_bytes())
    os.symlink(outside / ADAPTER_WEIGHTS_FILE, file_link / ADAPTER_WEIGHTS_FILE)
    return root


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, adapter_root: Path, s3_store: S3ObjectStore) -> Iterator[ServerUnderTest]:
    yield from served(server_config(tiny_model_dir, adapter_root=adapter_root, max_lora_rank=MAX_RANK), s3_store)


def still_serving(server: ServerUnderTest, base_name: str) -> None:
    """The base model and a good adapter still answer, and the engine is ready."""
    client = server.client()
    assert (
        client.completions.create(model=base_name, prompt="ok", max_tokens=2, extra_body=NO_EOS).usage.completion_tokens
        == 2
    )
    assert (
        client.completions.create(model="good", prompt="ok", max_tokens=2, extra_body=NO_EOS).usage.completion_tokens
        == 2
    )
    assert httpx.get(f"{server.url}/ready", headers=server.headers).status_code == 200


def load(server: ServerUnderTest, name: str, path: str) -> httpx.Response:
    with server.http() as http:
        return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_invalid_local_adapters_are_refused_saying_why(server, base_name, name):
    response = load(server, name, name)
    assert response.status_code == 400, response.text
    assert BROKEN[name][2] in response.json()["error"]["message"]
    # Requested by name straight away (standalone use), the answer is the same.
    with server.http() as http:
        direct = http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
    assert direct.status_code == 400 and BROKEN[name][2] in direct.json()["error"]["message"]
    assert name not in {m.id for m in server.client().models.list().data}
    still_serving(server, base_name)


def test_a_pickle_adapter_is_refused_and_never_unpickled(server, base_name, marker):
    response = load(server, "pickled", "pickled")
    assert response.status_code == 400 and "pickle" in response.json()["error"]["message"]
    assert not marker.exists()
    still_serving(server, base_name)


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("../outside/adapter", "'..'"),
        ("good/../../outside", "'..'"),
        ("/etc", "outside the server's --adapter-root"),  # absolute paths inside the root are taken (vLLM)
        ("escape", "outside the adapter root"),
        ("file-link", "outside the adapter root"),
    ],
)
def test_paths_that_escape_the_root_are_refused(server, base_name, outside, path, words):
    if path == "/etc":
        path = str(outside)
    response = load(server, "escapee", path)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]
    still_serving(server, base_name)


def test_an_adapter_made_on_a_same_shaped_base_is_refused(
    server, base_name, s3_store, tiny_model_dir, adapter_root, twin
):
    """Shapes fit, so only the fingerprint tells: the one its weights file records (local or stored) and the one
    the control plane recorded when it accepted the adapter (the descriptor's)."""
    words = "made on base model 'tiny-twin'"
    response = load(server, "twin-made", "twin-made")
    assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
    assert response.json()["error"]["code"] == "base_model_mismatch"
    stored = stored_request(server, upload(s3_store, adapter_root / "twin-made", base_name))
    assert stored.status_code == 400 and words in stored.json()["error"]["message"], stored.text

    good = upload(s3_store, adapter_root / "good", base_name)
    changed = stored_request(server, good.model_copy(update={"base_fingerprint": twin.digest}))
    assert changed.status_code == 400 and "its weights changed" in changed.json()["error"]["message"], changed.text
    ours = fingerprint_base(tiny_model_dir).digest
    assert stored_request(server, good.model_copy(update={"base_fingerprint": ours})).status_code == 200
    still_serving(server, base_name)

    refusals = [e for e in server.runtime.audit.take() if e.action == "refuse" and e.reason == "base_model_mismatch"]
    assert {(e.adapter_name, e.tier) for e in refusals} >= {("twin-made", "local")}
    assert any(
        e.tier == "store" and e.sha256 == good.sha256 and "weights changed" in (e.detail or "") for e in refusals
    )


def test_a_missing_local_adapter_is_404(server):
    assert load(server, "ghost", "not-there").status_code == 404


def stored_request(server: ServerUnderTest, descriptor: AdapterDescriptor) -> httpx.Response:
    with server.http() as http:
        body = {"model": descriptor.name, "prompt": "hi", "max_tokens": 2, ADAPTER_FIELD: descriptor.model_dump()}
        return http.post("/v1/completions", json=body)


def test_stored_adapters_are_verified_before_use(server, base_name, s3_store, peft_dir, tmp_path, marker):
    good = upload(s3_store, peft_dir, base_name)
    cases: list[tuple[AdapterDescriptor, int, str]] = [
        (good.model_copy(update={"sha256": "0" * 64}), 400, "sha256"),
        (good.model_copy(update={"config_sha256": "f" * 64}), 400, "sha256"),
        (good.model_copy(update={"rank": 64}), 400, f"up to {MAX_RANK}"),
        (good.model_copy(update={"base_model": "another-base"}), 400, "another-base"),
        (good.model_copy(update={"storage_prefix": "tenants/t-test/adapters/none/"}), 404, "no object"),
    ]
    for name in ("wrong-shape", "unknown-module", "dora"):
        config, tensors, words = BROKEN[name]
        cases.append((upload(s3_store, edited(peft_dir, tmp_path / name, config, tensors), base_name), 400, words))
    pickled = copy_adapter(peft_dir, tmp_path / "pickled")
    (pickled / ADAPTER_WEIGHTS_FILE).write_bytes(pickle_payload(marker))
    cases.append((upload(s3_store, pickled, base_name), 400, "pickle"))

    for descriptor, status, words in cases:
        response = stored_request(server, descriptor)
        assert response.status_code == status, (descriptor, response.text)
        assert words in response.json()["error"]["message"], response.text
    assert not marker.exists()
    assert stored_request(server, good).status_code == 200
    still_serving(server, base_name)

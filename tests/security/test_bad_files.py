"""Training files that cannot be trained on: each is refused with a 4xx naming the problem (and line),
nothing reaches the database or the object store, and the next good upload works."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from core.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from core.descriptor import adapter_prefix, file_key
from tests.holdings import holdings
from tests.integration.api.conftest import TEST_MAX_UPLOAD_BYTES
from tests.integration.api.datasets import chat_jsonl
from tests.integration.api.peft_adapters import adapter_files
from tests.integration.api_inference.deployment import Deployment
from tests.security.contract import Refusal, assert_refused, stores_nothing

pytestmark = pytest.mark.slow
GOOD = chat_jsonl(12)
TEXT = GOOD.decode()
LINE = json.dumps({"prompt": "x" * 1000, "completion": "y"}) + "\n"
Upload = Callable[[httpx.Client], httpx.Response]


def upload(content: bytes, purpose: str | None = "fine-tune", field: str = "file") -> Upload:
    data = {} if purpose is None else {"purpose": purpose}
    return lambda http: http.post("/v1/files", files={field: ("train.jsonl", content)}, data=data)


def broken_line(text: str) -> bytes:
    lines = TEXT.splitlines()
    lines[1] = text
    return "\n".join(lines).encode()


FILE = "file"
BAD_UPLOADS: dict[str, tuple[Upload, Refusal]] = {
    "invalid-jsonl": (upload(broken_line("{not json")), Refusal(400, "line 2: invalid JSON", FILE)),
    "utf-16": (upload(TEXT.encode("utf-16")), Refusal(400, "line 1: contains NUL bytes (is the file UTF-16?)", FILE)),
    "utf-16-le-no-bom": (upload(TEXT.encode("utf-16-le")), Refusal(400, "(is the file UTF-16?)", FILE)),
    "invalid-utf-8": (upload(GOOD.replace(b"plus", b"pl\xffus")), Refusal(400, "not valid UTF-8", FILE)),
    "latin-1": (upload(GOOD.replace(b"plus", "plüs".encode("latin-1"))), Refusal(400, "save the file as UTF-8", FILE)),
    "empty": (upload(b""), Refusal(400, "the file has no examples", FILE)),
    "blank-lines": (upload(b"\n \n\n"), Refusal(400, "the file has no examples", FILE)),
    "json-array": (
        upload(json.dumps([json.loads(x) for x in TEXT.splitlines()]).encode()),
        Refusal(400, "each line must be a JSON object", FILE),
    ),
    "deeply-nested": (
        upload(broken_line('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}")),
        Refusal(400, "line 2: invalid JSON: nested too deeply", FILE),
    ),
    "unknown-role": (
        upload(broken_line(json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}))),
        Refusal(400, "messages[0].role must be one of", FILE),
    ),
    "huge-line": (upload(("x" * (TEST_MAX_UPLOAD_BYTES + 1)).encode()), Refusal(413, "limit")),
    "oversize": (upload((LINE * (TEST_MAX_UPLOAD_BYTES // len(LINE) + 50)).encode()), Refusal(413, "limit")),
    "wrong-purpose": (
        upload(GOOD, purpose="assistants"),
        Refusal(400, "only 'fine-tune' files are accepted", "purpose"),
    ),
    "no-purpose": (upload(GOOD, purpose=None), Refusal(400, "missing the 'purpose' form field", "purpose")),
    "wrong-field": (upload(GOOD, field="data"), Refusal(400, "send the JSONL as 'file'", "data")),
    "json-body": (
        lambda http: http.post("/v1/files", json={"file": TEXT, "purpose": "fine-tune"}),
        Refusal(400, "multipart/form-data", code="unsupported_media_type"),
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_UPLOADS))
def test_a_bad_training_file_is_refused_and_nothing_is_kept(serving: Deployment, case: str) -> None:
    send, expected = BAD_UPLOADS[case]
    tenant = serving.make_tenant()
    with tenant.http() as http:
        with stores_nothing(serving, tenant):
            assert_refused(send(http), expected)
        assert upload(GOOD)(http).status_code == 200  # the next good one is taken


def test_client_file_names_never_become_paths(serving: Deployment, peft_adapter_dir: Path) -> None:
    tenant = serving.make_tenant()
    weights = (peft_adapter_dir / ADAPTER_WEIGHTS_FILE).read_bytes()
    escaping_adapter = [
        adapter_files(peft_adapter_dir)[0],
        (ADAPTER_WEIGHTS_FILE, ("../../" + ADAPTER_WEIGHTS_FILE, weights, "x")),
    ]
    with tenant.http() as http:
        file = http.post("/v1/files", files={"file": ("../../etc/passwd", GOOD)}, data={"purpose": "fine-tune"})
        adapter = http.post("/v1/adapters", files=escaping_adapter)
    assert (file.status_code, adapter.status_code) == (200, 200), (file.text, adapter.text)
    assert file.json()["filename"] == "passwd"  # only the base name is kept, as a label
    file_id, adapter_id = file.json()["id"], adapter.json()["id"]
    assert holdings(serving.settings, serving.engine, tenant.id).objects == {
        file_key(tenant.id, file_id),
        *(adapter_prefix(tenant.id, adapter_id) + name for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)),
    }

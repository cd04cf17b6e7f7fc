"""/v1/files through the openai SDK: upload, list, retrieve, download, delete; bad uploads leave nothing behind."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from core.settings import Settings
from core.storage import open_store
from tests.integration.api.conftest import TEST_MAX_UPLOAD_BYTES, TenantHandle
from tests.integration.api.datasets import chat_jsonl, tool_chat_jsonl


def stored_objects(settings: Settings, tenant: TenantHandle) -> list[str]:
    return [o.key for o in open_store(settings).list(f"tenants/{tenant.id}/")]


def test_upload_list_retrieve_download_delete(tenant: TenantHandle, api_settings: Settings) -> None:
    client = tenant.openai()
    data = chat_jsonl(12)

    uploaded = client.files.create(file=("train.jsonl", data), purpose="fine-tune")

    assert uploaded.object == "file" and uploaded.id.startswith("file-")
    assert (uploaded.bytes, uploaded.filename, uploaded.purpose, uploaded.status) == (
        len(data),
        "train.jsonl",
        "fine-tune",
        "processed",
    )
    assert uploaded.model_extra is not None and uploaded.model_extra["sha256"] == hashlib.sha256(data).hexdigest()
    assert uploaded.model_extra["num_examples"] == 12
    assert [f.id for f in client.files.list()] == [uploaded.id]
    assert client.files.retrieve(uploaded.id).bytes == len(data)
    assert client.files.content(uploaded.id).content == data

    deleted = client.files.delete(uploaded.id)

    assert deleted.deleted and deleted.id == uploaded.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    assert list(client.files.list()) == []
    assert stored_objects(api_settings, tenant) == []


def test_files_list_pages_with_after_and_limit(tenant: TenantHandle) -> None:
    client = tenant.openai()
    ids = [client.files.create(file=(f"f{i}.jsonl", chat_jsonl()), purpose="fine-tune").id for i in range(3)]

    first = client.files.list(limit=2)

    assert [f.id for f in first.data] == ids[::-1][:2] and first.has_more
    assert [f.id for f in client.files.list(limit=2, after=first.data[-1].id).data] == [ids[0]]
    assert [f.id for f in client.files.list(limit=2)] == ids[::-1]  # the SDK follows has_more
    assert [f.id for f in client.files.list(order="asc").data] == ids


def test_invalid_lines_are_listed_by_number_and_nothing_is_stored(tenant: TenantHandle, api_settings: Settings) -> None:
    lines = chat_jsonl(12).decode().splitlines()
    lines[1] = "{not json"
    lines[3] = json.dumps({"messages": [{"role": "wizard", "content": "hi"}]})
    client = tenant.openai()

    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("bad.jsonl", "\n".join(lines).encode()), purpose="fine-tune")

    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "file" and error["code"] == "invalid_file"
    assert "line 2: invalid JSON" in error["message"]
    assert "line 4: messages[0].role must be one of" in error["message"]
    assert list(client.files.list()) == []
    assert stored_objects(api_settings, tenant) == []


def test_tool_calling_files_are_accepted_and_their_bad_fields_named(tenant: TenantHandle) -> None:
    client = tenant.openai()
    data = tool_chat_jsonl(12)

    uploaded = client.files.create(file=("tools.jsonl", data), purpose="fine-tune")

    assert uploaded.model_extra is not None and uploaded.model_extra["num_examples"] == 12
    lines = data.decode().splitlines()
    lines[2] = lines[2].replace('"name": "add", "arguments"', '"name": "sub", "arguments"')
    lines[5] = lines[5].replace('"tool_call_id": "call_5"', '"tool_call_id": "call_9"')
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("bad.jsonl", "\n".join(lines).encode()), purpose="fine-tune")
    assert isinstance(caught.value.body, dict)
    message = caught.value.body["message"]
    assert "line 3: messages[1].tool_calls[0].function.name 'sub' is not one of the example's tools" in message
    assert "line 6: messages[2].tool_call_id 'call_9' matches no earlier assistant tool call" in message
    assert [f.id for f in client.files.list()] == [uploaded.id]


@pytest.mark.parametrize(
    ("filename", "content", "purpose", "param", "fragment"),
    [
        ("empty.jsonl", b"", "fine-tune", "file", "no examples"),
        ("few.jsonl", chat_jsonl(3), "fine-tune", "file", "at least 10 are needed"),
        ("latin1.jsonl", chat_jsonl(12).replace(b"plus", "plüs".encode("latin-1")), "fine-tune", "file", "UTF-8"),
        ("train.jsonl", chat_jsonl(12), "assistants", "purpose", "only 'fine-tune'"),
    ],
)
def test_bad_uploads_are_refused_with_the_field_named(
    tenant: TenantHandle, filename: str, content: bytes, purpose: str, param: str, fragment: str
) -> None:
    client = tenant.openai()

    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=(filename, content), purpose=purpose)  # type: ignore[arg-type]

    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == param and fragment in caught.value.body["message"]
    assert list(client.files.list()) == []


def test_an_upload_over_the_limit_is_413_and_not_stored(tenant: TenantHandle, api_settings: Settings) -> None:
    line = json.dumps({"prompt": "x" * 1000, "completion": "y"}).encode() + b"\n"
    oversized = line * (TEST_MAX_UPLOAD_BYTES // len(line) + 50)

    with pytest.raises(openai.APIStatusError) as caught:
        tenant.openai().files.create(file=("big.jsonl", oversized), purpose="fine-tune")

    assert caught.value.status_code == 413
    assert stored_objects(api_settings, tenant) == []


def _chunked_multipart(boundary: str, content: bytes, *, close: bool = True) -> Iterator[bytes]:
    yield f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'.encode()
    yield (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="s.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    for start in range(0, len(content), 64 * 1024):
        yield content[start : start + 64 * 1024]
    if close:
        yield f"\r\n--{boundary}--\r\n".encode()


def test_a_streamed_upload_without_length_is_cut_off_at_the_limit(tenant: TenantHandle, api_settings: Settings) -> None:
    # A generator body goes out chunked, with no Content-Length: only counting while streaming can stop it.
    line = json.dumps({"prompt": "x" * 1000, "completion": "y"}).encode() + b"\n"
    oversized = line * (TEST_MAX_UPLOAD_BYTES // len(line) + 50)
    headers = {"Content-Type": "multipart/form-data; boundary=b0undary"}

    with tenant.http() as http:
        response = http.post("/v1/files", content=_chunked_multipart("b0undary", oversized), headers=headers)

    assert response.status_code == 413, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert stored_objects(api_settings, tenant) == []


def test_a_streamed_upload_within_the_limit_is_stored(tenant: TenantHandle) -> None:
    headers = {"Content-Type": "multipart/form-data; boundary=b0undary"}
    data = chat_jsonl(40)

    with tenant.http() as http:
        response = http.post("/v1/files", content=_chunked_multipart("b0undary", data), headers=headers)
        assert response.status_code == 200, response.text
        assert http.get(f"/v1/files/{response.json()['id']}/content").content == data


def test_a_truncated_upload_is_refused(tenant: TenantHandle, api_settings: Settings) -> None:
    headers = {"Content-Type": "multipart/form-data; boundary=b0undary"}
    body = b"".join(_chunked_multipart("b0undary", chat_jsonl(12), close=False))

    with tenant.http() as http:
        response = http.post("/v1/files", content=body, headers=headers)

    assert response.status_code == 400
    assert "closing boundary" in response.json()["error"]["message"]
    assert stored_objects(api_settings, tenant) == []


def test_a_json_body_is_refused_as_the_wrong_media_type(tenant: TenantHandle) -> None:
    with tenant.http() as http:
        response = http.post("/v1/files", json={"file": "x", "purpose": "fine-tune"})

    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unsupported_media_type"


def test_content_of_a_missing_file_is_404(tenant: TenantHandle) -> None:
    with pytest.raises(openai.NotFoundError):
        tenant.openai().files.content("file-doesnotexist")


def test_unknown_routes_and_methods_answer_in_the_error_shape(tenant: TenantHandle) -> None:
    with tenant.http() as http:
        missing = http.get("/v1/nothing-here")
        wrong_method = http.put("/v1/files")

    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_url"
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert set(wrong_method.json()["error"]) == {"message", "type", "param", "code"}


def test_docs_and_schema_are_served(api_server_url: str) -> None:
    assert httpx.get(f"{api_server_url}/docs").status_code == 200
    schema = httpx.get(f"{api_server_url}/openapi.json").json()
    assert "/v1/files" in schema["paths"] and "/v1/fine_tuning/jobs/{job_id}/events" in schema["paths"]


def test_the_schemas_links_name_real_operations_and_parameters(api_server_url: str) -> None:
    """Every OpenAPI link resolves: its target operation exists and takes the parameters the link fills."""
    schema = httpx.get(f"{api_server_url}/openapi.json").json()
    links = [
        (f"{method.upper()} {path}", link)
        for path, methods in schema["paths"].items()
        for method, operation in methods.items()
        for response in operation["responses"].values()
        for link in response.get("links", {}).values()
    ]
    assert len(links) >= 25
    for source, link in links:
        _, _, target_path, target_method = link["operationRef"].split("/")
        path = target_path.replace("~1", "/").replace("~0", "~")
        target = schema["paths"][path][target_method]
        taken = {p["name"] for p in target.get("parameters", [])}
        assert set(link.get("parameters", {})) <= taken, (source, link)
        if "requestBody" in link:
            body = target["requestBody"]["content"]["application/json"]["schema"]
            if "$ref" in body:
                body = schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
            properties = set(body.get("properties", {}))
            assert set(link["requestBody"]) <= properties or body.get("additionalProperties") is not False, link

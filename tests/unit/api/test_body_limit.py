"""JSON bodies past the cap get a 413 before the app holds them; uploads keep their own limit."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from api.body_limit import BodyLimit

LIMIT = 1024


def app() -> FastAPI:
    application = FastAPI()
    application.add_middleware(BodyLimit, max_bytes=LIMIT)

    @application.post("/v1/completions")
    async def echo(request: Request) -> dict:
        return {"size": len(await request.body())}

    @application.post("/v1/files")
    async def upload(request: Request) -> dict:
        return {"size": len(await request.body())}

    return application


def chunks(total: int, size: int = 256) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        yield b"x" * min(size, total - sent)
        sent += size


def test_a_body_declared_too_large_is_refused_at_once() -> None:
    with TestClient(app()) as client:
        answer = client.post(
            "/v1/completions", content=b"x" * (LIMIT + 1), headers={"content-type": "application/json"}
        )
    assert answer.status_code == 413
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("payload_too_large", "body")
    assert f"at most {LIMIT} bytes" in error["message"] and "LORAPLEX_MAX_REQUEST_BYTES" in error["message"]


def test_a_chunked_body_is_cut_off_when_it_passes_the_cap() -> None:
    with TestClient(app()) as client:
        answer = client.post("/v1/completions", content=chunks(LIMIT * 4), headers={"content-type": "application/json"})
        assert answer.status_code == 413 and "larger than that" in answer.json()["error"]["message"]
        assert client.post("/v1/completions", content=b"x" * LIMIT).json() == {"size": LIMIT}


def test_uploads_stream_under_their_own_limit_but_not_by_claiming_multipart_elsewhere() -> None:
    multipart = {"content-type": "multipart/form-data; boundary=b"}
    with TestClient(app()) as client:
        assert client.post("/v1/files", content=b"x" * (LIMIT * 2), headers=multipart).json() == {"size": LIMIT * 2}
        assert client.post("/v1/completions", content=b"x" * (LIMIT * 2), headers=multipart).status_code == 413

"""The contract every refused request keeps, checked the same way across the sweeps: the status a client
acts on, the OpenAI error shape, a message naming what to fix (and ``param``, the field), nothing stored
or billed, and a platform that still serves the next request."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from tests.holdings import holdings
from tests.integration.api.conftest import TenantHandle
from tests.integration.api_inference.deployment import Deployment

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


@dataclass(frozen=True)
class Refusal:
    """What a client must get back: ``words`` from the message, and the field to fix when there is one."""

    status: int
    words: str
    param: str | None = None
    code: str | None = None


def assert_refused(response: httpx.Response, expected: Refusal) -> None:
    assert response.status_code == expected.status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == ERROR_TYPES[expected.status], error
    assert expected.words in error["message"], error
    if expected.param is not None:
        assert error["param"] == expected.param, error
    if expected.code is not None:
        assert error["code"] == expected.code, error


@contextmanager
def stores_nothing(deployment: Deployment, tenant: TenantHandle) -> Iterator[None]:
    """The block leaves the tenant's rows, objects and billed tokens exactly as they were."""
    before = holdings(deployment.settings, deployment.engine, tenant.id)
    yield
    assert holdings(deployment.settings, deployment.engine, tenant.id) == before


def assert_still_serving(deployment: Deployment, tenant: TenantHandle) -> None:
    """The API and its replicas answer a good request right after."""
    with tenant.http() as http:
        assert http.get("/ready").status_code == 200
        answer = http.post("/v1/completions", json={"model": deployment.base_model, "prompt": "ok", "max_tokens": 1})
        assert answer.status_code == 200, answer.text

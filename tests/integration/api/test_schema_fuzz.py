"""schemathesis over the live API's OpenAPI schema: whatever it sends, valid or not, no route answers 500.

Driven through schemathesis's Python API (one Hypothesis run per operation and generation mode) rather
than ``schema.parametrize()``: the schema comes from a server that a fixture starts, and the lazy
``from_fixture`` loader does not work with this pytest release.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance

from core.settings import Settings

pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 10  # per generation mode; about 600 requests in all, a minute on two busy cores
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,  # the same cases every run: a failure here reproduces
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def fuzz_keys(admin: httpx.Client, api_settings: Settings) -> dict[str, str]:
    """Bearer keys by route family: the admin key for /admin, a tenant's own key for the rest."""
    created = admin.post("/admin/tenants", json={"name": f"fuzz-{uuid.uuid4().hex[:8]}"})
    assert created.status_code == 201
    assert api_settings.admin_key is not None
    return {"admin": api_settings.admin_key.get_secret_value(), "tenant": created.json()["api_key"]["key"]}


def fuzz(operation: schemathesis.APIOperation, mode: GenerationMode, key: str) -> None:
    @FUZZ_SETTINGS
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        checks = [not_a_server_error]
        if mode is GenerationMode.POSITIVE:
            checks.append(response_schema_conformance)  # a 200 must look like the schema says
        case.call_and_validate(headers={"Authorization": f"Bearer {key}"}, checks=checks, timeout=60)

    run()


def test_no_route_answers_500(api_server_url: str, fuzz_keys: dict[str, str]) -> None:
    schema = schemathesis.openapi.from_url(f"{api_server_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 25  # every route is in the schema, so every route is fuzzed

    failures = []
    for operation in operations:
        key = fuzz_keys["admin" if operation.path.startswith("/admin") else "tenant"]
        takes_input = len(operation.path_parameters) + len(operation.query) + len(operation.body) > 0
        modes = list(GenerationMode) if takes_input else [GenerationMode.POSITIVE]  # nothing to get wrong
        for mode in modes:
            try:
                fuzz(operation, mode, key)
            except Exception as exc:  # collect all, so one run reports every broken route
                failures.append(f"{operation.label} ({mode.value}): {exc}")
    assert not failures, "\n\n".join(failures)

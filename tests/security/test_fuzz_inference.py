"""schemathesis over the inference operations of an API with live replicas: whatever the body, well-formed
or not, neither the API nor a replica answers 5xx. (Every other route is fuzzed in
``tests/integration/api/test_schema_fuzz.py``, where inference stops at "no replica".)

Well-formed cases are aimed at the base model with small token counts, so they reach a replica's engine
quickly instead of being refused as an unknown model or spending minutes generating."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.integration.api_inference.deployment import Deployment

pytestmark = pytest.mark.slow
INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")
EXAMPLES_PER_MODE = 25
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES_PER_MODE,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
SMALL = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2}


def aimed(base_model: str) -> Any:
    def aim(case: schemathesis.Case) -> schemathesis.Case:
        if isinstance(case.body, dict):
            case.body["model"] = base_model
            for name, cap in SMALL.items():
                if isinstance(case.body.get(name), int):
                    case.body[name] = max(1, min(case.body[name], cap))
        return case

    return aim


def fuzz(operation: schemathesis.APIOperation, mode: GenerationMode, key: str, base_model: str) -> None:
    strategy = operation.as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE:
        strategy = strategy.map(aimed(base_model))

    @FUZZ_SETTINGS
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(headers={"Authorization": f"Bearer {key}"}, checks=[not_a_server_error], timeout=120)

    run()


def test_no_inference_body_makes_the_api_or_a_replica_fail(serving: Deployment) -> None:
    tenant = serving.make_tenant()
    schema = schemathesis.openapi.from_url(f"{serving.api.url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations() if r.ok().path in INFERENCE_PATHS]
    assert len(operations) == 2

    failures = []
    for operation in operations:
        for mode in GenerationMode:
            try:
                fuzz(operation, mode, tenant.key, serving.base_model)
            except Exception as exc:  # collect all, so one run reports every failing operation and mode
                failures.append(f"{operation.label} ({mode.value}): {exc}")
    assert not failures, "\n\n".join(failures)
    assert serving.usage_records(tenant.id)  # the well-formed cases did reach the replicas

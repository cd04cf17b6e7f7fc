"""Job requests that must not start a job: each is a 400 naming the field, and no job row (or queue
message) appears; the tenant's next request is served."""

from __future__ import annotations

from typing import Any

import pytest

from core.queue import make_celery, train_queue, waiting_job_ids
from tests.integration.api.datasets import chat_jsonl
from tests.integration.api_inference.deployment import Deployment
from tests.security.contract import Refusal, assert_refused, assert_still_serving, stores_nothing

pytestmark = pytest.mark.slow
HP = "hyperparameters"
OTHERS_FILE = "<another tenant's file>"

# overrides of a valid request -> what the client must be told
BAD_JOBS: dict[str, tuple[dict[str, Any], Refusal]] = {
    "unknown-file": ({"training_file": "file-doesnotexist"}, Refusal(400, "no file with id", "training_file")),
    "another-tenants-file": ({"training_file": OTHERS_FILE}, Refusal(400, "no file with id", "training_file")),
    "unknown-validation-file": ({"validation_file": "file-x"}, Refusal(400, "no file with id", "validation_file")),
    "rank-zero": ({HP: {"lora_r": 0}}, Refusal(400, "lora_r must be between 1 and 16", f"{HP}.lora_r")),
    "rank-100000": ({HP: {"lora_r": 100_000}}, Refusal(400, "lora_r must be between 1 and 16", f"{HP}.lora_r")),
    "negative-lr": ({HP: {"learning_rate": -0.1}}, Refusal(400, "learning_rate must be > 0", f"{HP}.learning_rate")),
    "million-epochs": ({HP: {"n_epochs": 10**6}}, Refusal(400, "n_epochs must be between 1 and 100", f"{HP}.n_epochs")),
    "unknown-base-model": ({"model": "gpt-4o-mini"}, Refusal(400, "cannot be fine-tuned here", "model")),
    "someone-elses-model": ({"model": "ft:tiny:someone::ftjob-1"}, Refusal(400, "no fine-tuned model", "model")),
    "unknown-field": ({"warmup": 3}, Refusal(400, "unknown field", "warmup")),
}


@pytest.mark.parametrize("case", sorted(BAD_JOBS))
def test_a_bad_job_request_starts_nothing(serving: Deployment, case: str) -> None:
    overrides, expected = BAD_JOBS[case]
    owner, other = serving.make_tenant(), serving.make_tenant()
    upload = {"file": ("train.jsonl", chat_jsonl())}
    with other.http() as http:
        others_file = http.post("/v1/files", files=upload, data={"purpose": "fine-tune"}).json()["id"]
    with owner.http() as http:
        own_file = http.post("/v1/files", files=upload, data={"purpose": "fine-tune"}).json()["id"]
        body = {"model": serving.base_model, "training_file": own_file, **overrides}
        if body["training_file"] == OTHERS_FILE:
            body["training_file"] = others_file
        celery = make_celery(serving.settings)
        waiting = waiting_job_ids(celery, train_queue(serving.base_model))

        with stores_nothing(serving, owner), stores_nothing(serving, other):
            assert_refused(http.post("/v1/fine_tuning/jobs", json=body), expected)
        assert waiting_job_ids(celery, train_queue(serving.base_model)) <= waiting  # nothing sent to workers
        celery.close()
    assert_still_serving(serving, owner)

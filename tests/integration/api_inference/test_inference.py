"""Inference through the API with the openai SDK: both endpoints, streaming or not, on a fine-tuned adapter
and on the base model, with usage chunks only for those who ask; mistakes get 400s, others' adapters 404."""

from __future__ import annotations

import json

import openai
import pytest

from core.protocol import STATS_FIELD
from tests.integration.api.conftest import TenantHandle
from tests.integration.api_inference.deployment import Deployment
from tests.integration.api_inference.serving import TrainedAdapter

pytestmark = pytest.mark.slow
PROMPT = "What is 3 plus 3?"
MESSAGES = [{"role": "user", "content": PROMPT}]


def call(client: openai.OpenAI, endpoint: str, model: str, **kw: object):  # type: ignore[no-untyped-def]
    if endpoint == "chat":
        return client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, **kw)  # type: ignore[arg-type]
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=6, **kw)  # type: ignore[arg-type]


def text_of(choice: object) -> str:
    message = getattr(choice, "message", None)
    return message.content if message is not None else choice.text  # type: ignore[attr-defined]


def delta_of(choice: object) -> str:
    delta = getattr(choice, "delta", None)
    return (delta.content or "") if delta is not None else (choice.text or "")  # type: ignore[attr-defined]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("target", ["adapter", "base"])
def test_non_streaming_answers_carry_usage_and_no_internal_fields(
    serving: Deployment, trained_adapter: TrainedAdapter, endpoint: str, target: str
) -> None:
    model = trained_adapter.model if target == "adapter" else serving.base_model
    response = call(trained_adapter.owner.openai().with_raw_response, endpoint, model, seed=1)
    body = json.loads(response.text)
    answer = response.parse()

    assert answer.model == model
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert isinstance(text_of(answer.choices[0]), str)
    assert answer.usage.prompt_tokens > 0 and 0 < answer.usage.completion_tokens <= 6
    assert STATS_FIELD not in body
    assert response.headers["x-request-id"].startswith("req-")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("target", ["adapter", "base"])
def test_streams_end_with_the_usage_chunk_when_asked(
    serving: Deployment, trained_adapter: TrainedAdapter, endpoint: str, target: str
) -> None:
    model = trained_adapter.model if target == "adapter" else serving.base_model
    chunks = list(
        call(trained_adapter.owner.openai(), endpoint, model, stream=True, stream_options={"include_usage": True})
    )

    *deltas, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens > 0 and last.usage.prompt_tokens > 0
    assert all(c.usage is None for c in deltas)
    assert {c.model for c in chunks} == {model}
    assert any(c.choices and c.choices[0].finish_reason for c in deltas)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_without_include_usage_no_usage_chunk_or_stats_reach_the_client(
    trained_adapter: TrainedAdapter, endpoint: str
) -> None:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = {"model": trained_adapter.model, "max_tokens": 6, "stream": True}
    body.update({"messages": MESSAGES} if endpoint == "chat" else {"prompt": PROMPT})
    with trained_adapter.owner.http() as http, http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]

    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads and all(p["choices"] for p in payloads)  # no choice-less usage chunk
    assert all(p.get("usage") is None and STATS_FIELD not in p for p in payloads)
    assert any(p["choices"][0].get("finish_reason") for p in payloads)


def test_another_tenants_adapter_answers_like_a_missing_one(
    serving: Deployment, trained_adapter: TrainedAdapter
) -> None:
    intruder = serving.make_tenant()
    missing = trained_adapter.model + "x"
    for endpoint in ("chat", "completions"):
        with pytest.raises(openai.NotFoundError) as theirs:
            call(intruder.openai(), endpoint, trained_adapter.model)
        with pytest.raises(openai.NotFoundError) as nobodys:
            call(intruder.openai(), endpoint, missing)
        assert theirs.value.code == nobodys.value.code == "model_not_found"
        assert theirs.value.message.replace(trained_adapter.model, "M") == nobodys.value.message.replace(missing, "M")
    assert serving.usage_records(intruder.id) == []


def test_a_descriptor_smuggled_in_the_body_is_ignored(serving: Deployment, trained_adapter: TrainedAdapter) -> None:
    intruder = serving.make_tenant()
    with intruder.http() as http:
        response = http.post(
            "/v1/completions",
            json={
                "model": serving.base_model,
                "prompt": PROMPT,
                "max_tokens": 2,
                "adapter": {"id": trained_adapter.adapter_id},
            },
        )
    assert response.status_code == 200, response.text
    [record] = serving.usage_records(intruder.id)
    assert record.adapter_id is None  # served on the base model


def test_one_tenants_prompts_are_never_another_tenants_cache_hits(serving: Deployment) -> None:
    """The server keeps each tenant's prefix cache apart (a hit would time another tenant's prompt), even when a
    client smuggles another tenant's tag into the body."""
    owner, other, poser = serving.make_tenant(), serving.make_tenant(), serving.make_tenant()
    prompt = "A system prompt two tenants happen to share, long enough for several full pages. " * 2

    def cached(caller: TenantHandle, extra_body: dict | None = None) -> int:
        usage = (
            caller.openai()
            .completions.create(model=serving.base_model, prompt=prompt, max_tokens=1, extra_body=extra_body)
            .usage
        )
        return usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0

    assert cached(owner) == 0
    assert cached(owner) >= 16  # its own second request hits
    assert cached(other) == 0
    assert cached(poser, {"tenant": {"id": owner.id}}) == 0  # the API replaced the tag with the poser's own


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages.0.role"),
        ({"messages": MESSAGES, "n": 1000}, "n"),
        ({"messages": MESSAGES, "max_tokens": 10**9}, "max_tokens"),
        ({"messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
        ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_client_mistakes_are_400s_naming_the_field(serving: Deployment, body: dict, param: str) -> None:
    tenant = serving.make_tenant()
    with tenant.http() as http:
        response = http.post("/v1/chat/completions", json={"model": serving.base_model, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert serving.usage_records(tenant.id) == []


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompts_and_invalid_json_are_400s(serving: Deployment, prompt: object) -> None:
    with serving.make_tenant().http() as http:
        empty = http.post("/v1/completions", json={"model": serving.base_model, "prompt": prompt})
        broken = http.post("/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt"
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]


def test_the_servers_refusals_pass_through_in_the_openai_shape(serving: Deployment) -> None:
    tenant = serving.make_tenant()
    too_long = "x" * 3000  # byte-level tokens: beyond the tiny model's 2048-token context, which only the server knows
    with pytest.raises(openai.BadRequestError) as exc:
        tenant.openai().completions.create(model=serving.base_model, prompt=too_long, max_tokens=4)
    assert exc.value.type == "invalid_request_error"
    assert isinstance(exc.value.body, dict) and exc.value.body.get("message")
    [record] = serving.usage_records(tenant.id)
    assert (record.status, record.completion_tokens) == ("rejected", 0)


def test_a_jobs_checkpoint_is_listed_and_serves_the_adapter_it_saved(
    serving: Deployment, trained_adapter: TrainedAdapter
) -> None:
    client = trained_adapter.owner.openai()
    [checkpoint] = client.fine_tuning.jobs.checkpoints.list(trained_adapter.job_id).data  # one epoch, one checkpoint

    job = client.fine_tuning.jobs.retrieve(trained_adapter.job_id)
    assert checkpoint.id.startswith("ftckpt-") and checkpoint.fine_tuning_job_id == job.id
    assert checkpoint.step_number == 3  # 10 examples in batches of 4
    assert checkpoint.fine_tuned_model_checkpoint == f"{job.fine_tuned_model}:ckpt-step-3"
    assert checkpoint.metrics.step == 3 and checkpoint.metrics.train_loss is not None
    assert checkpoint.fine_tuned_model_checkpoint in [m.id for m in client.models.list()]
    # The last epoch's checkpoint holds the final weights: greedy answers are the same.
    answers = [
        client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
        for model in (checkpoint.fine_tuned_model_checkpoint, trained_adapter.model)
    ]
    assert answers[0] == answers[1]
    with pytest.raises(openai.NotFoundError):  # like any adapter, only its owner can call it
        serving.make_tenant().openai().completions.create(
            model=checkpoint.fine_tuned_model_checkpoint, prompt=PROMPT, max_tokens=2
        )

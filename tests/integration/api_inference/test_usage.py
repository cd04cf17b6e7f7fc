"""Metering: ``/admin/usage`` and ``/v1/usage`` add up to exactly the ``usage`` the client was given, in JSON
and CSV alike, for any mix of base, adapter and checkpoint requests, including requests their clients leave
early: those are metered at what went out to them."""

from __future__ import annotations

import csv
import io

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import Stream
from openai.types import CompletionUsage

from core.models import UsageRecord
from tests.integration.api_inference.deployment import Deployment
from tests.integration.api_inference.serving import TrainedAdapter

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Say something."}]


def test_usage_reports_add_up_to_what_clients_received(serving: Deployment, trained_adapter: TrainedAdapter) -> None:
    tenant = serving.make_tenant()
    client = tenant.openai()
    received = []  # (prompt, completion, cached prompt) tokens per request, from the answers themselves

    def count(usage: CompletionUsage) -> int:
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        received.append((usage.prompt_tokens, usage.completion_tokens, cached or 0))
        return cached or 0

    for model in (serving.base_model,):
        count(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5).usage)
        count(client.completions.create(model=model, prompt="Once upon", max_tokens=7, n=2).usage)
        for endpoint in ("chat", "completions"):
            kwargs = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4}
            if endpoint == "chat":
                stream = client.chat.completions.create(model=model, messages=MESSAGES, **kwargs)  # type: ignore[call-overload]
            else:
                stream = client.completions.create(model=model, prompt="Hello", **kwargs)  # type: ignore[call-overload]
            [usage] = [chunk.usage for chunk in stream if chunk.usage is not None]
            count(usage)
    # The same long prompt again and again: later answers read its pages from the server's prefix cache.
    repeated = f"Tenant {tenant.id} tells a long story that starts the same way every time. " * 2
    hits = [count(client.completions.create(model=serving.base_model, prompt=repeated, max_tokens=2).usage)]
    hits += [count(client.completions.create(model=serving.base_model, prompt=repeated, max_tokens=2).usage)]
    assert hits[-1] > 0 and max(hits) < received[-1][0]

    serving.wait_until(lambda: len(serving.usage_records(tenant.id)) == len(received), "every request to be metered")
    report, as_csv = json_and_csv(serving, {"group_by": "tenant"})
    [mine] = [row for row in report["data"] if row["tenant_id"] == tenant.id]

    assert mine["requests"] == len(received) and mine["failed_requests"] == 0
    assert mine["prompt_tokens"] == sum(p for p, _, _ in received)
    assert mine["completion_tokens"] == sum(c for _, c, _ in received)
    assert mine["cached_tokens"] == sum(h for _, _, h in received)
    assert mine["gpu_seconds"] > 0
    [csv_row] = [row for row in as_csv if row["tenant_id"] == tenant.id]
    assert {k: str(v) for k, v in mine.items()} == csv_row

    with tenant.http() as http:
        own = http.get("/v1/usage", params={"group_by": "adapter"}).json()
    assert [row["model"] for row in own["data"]] == [serving.base_model]
    assert own["totals"]["prompt_tokens"] == mine["prompt_tokens"]
    assert own["totals"]["completion_tokens"] == mine["completion_tokens"]
    assert own["totals"]["cached_tokens"] == mine["cached_tokens"]


Call = tuple[str, str, bool, int, int, bool]  # (model kind, endpoint, stream, n, max_tokens, left early)
CALLS = st.tuples(
    st.sampled_from(["base", "adapter", "checkpoint"]),
    st.sampled_from(["chat", "completions"]),
    st.booleans(),
    st.integers(1, 3),
    st.integers(1, 6),
    st.booleans(),
)
LONG = 400  # max_tokens of a request its client leaves early: far from done when the client goes
READ_BEFORE_LEAVING = 2  # text chunks a client reads of a stream before it leaves
GIVE_UP_AFTER_S = 0.2  # a client that does not stream gives up this soon


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mix=st.lists(CALLS, min_size=1, max_size=5))
def test_usage_totals_equal_what_clients_received_for_any_mix(
    serving: Deployment, trained_adapter: TrainedAdapter, mix: list[Call]
) -> None:
    """Adapter, checkpoint and base requests, streaming or not, one or several choices, some left early by
    their clients: the tenant's report grows by exactly the tokens its clients were told they used. A stream
    its client leaves is billed its prompt and at least the tokens read, less than the whole answer; a
    request given up before its answer is billed nothing."""
    owner = trained_adapter.owner
    client = owner.openai()
    checkpoints = sorted(m.id for m in client.models.list() if m.id.startswith(f"{trained_adapter.model}:ckpt-step-"))
    models = {"base": serving.base_model, "adapter": trained_adapter.model, "checkpoint": checkpoints[-1]}
    before = tenant_totals(serving, owner.id)
    received = [0, 0]
    left: dict[str, tuple[CompletionUsage, int]] = {}  # request id of a stream left early -> (last usage read, n)
    gave_up = 0
    for kind, endpoint, stream, n, max_tokens, leaves in mix:
        kwargs: dict = {"model": models[kind], "max_tokens": LONG if leaves else max_tokens, "n": n}
        if leaves:
            kwargs["extra_body"] = {"ignore_eos": True}
        if stream:
            options = {"include_usage": True, "continuous_usage_stats": leaves}  # the usage so far, per chunk
            kwargs |= {"stream": True, "stream_options": options}
        caller = client.with_options(timeout=GIVE_UP_AFTER_S, max_retries=0) if leaves and not stream else client
        try:
            if endpoint == "chat":
                answer = caller.chat.completions.create(messages=MESSAGES, **kwargs)
            else:
                answer = caller.completions.create(prompt="Count with me", **kwargs)
        except openai.APITimeoutError:
            gave_up += 1
            continue
        if stream and leaves:
            left[answer.response.headers["x-request-id"]] = (read_some_and_leave(answer), n)
            continue
        usage = [chunk.usage for chunk in answer if chunk.usage is not None][-1] if stream else answer.usage
        received[0] += usage.prompt_tokens
        received[1] += usage.completion_tokens

    def metered() -> list[UsageRecord] | None:
        records = serving.usage_records(owner.id)[before[2] :]
        return records if len(records) == len(mix) else None

    records = serving.wait_until(metered, "every request of the mix to be metered")
    by_id = {r.request_id: r for r in records}
    for request_id, (read, n) in left.items():
        record = by_id[request_id]
        assert record.status == "client_disconnected"
        assert record.prompt_tokens == read.prompt_tokens  # the prompt was computed: it is billed
        assert read.completion_tokens <= record.completion_tokens < LONG * n  # what went out, not the whole
    left_early = [r for r in records if r.status == "client_disconnected"]
    assert len(left_early) == len(left) + gave_up
    assert all(r.completion_tokens == r.prompt_tokens == 0 for r in left_early if r.request_id not in left)
    billed_for_left = (sum(by_id[i].prompt_tokens for i in left), sum(by_id[i].completion_tokens for i in left))
    now = tenant_totals(serving, owner.id)
    grown = (now[0] - before[0], now[1] - before[1], now[2] - before[2])
    assert grown == (received[0] + billed_for_left[0], received[1] + billed_for_left[1], len(mix))


def read_some_and_leave(stream: Stream) -> CompletionUsage:
    """Read a stream until ``READ_BEFORE_LEAVING`` chunks carried text, then close it: the usage so far."""
    usage, texts = None, 0
    for chunk in stream:
        usage = chunk.usage or usage
        texts += any(c.delta.content if hasattr(c, "delta") else c.text for c in chunk.choices)
        if texts == READ_BEFORE_LEAVING:
            break
    stream.close()
    assert usage is not None and usage.completion_tokens >= READ_BEFORE_LEAVING
    return usage


def tenant_totals(serving: Deployment, tenant_id: str) -> tuple[int, int, int]:
    """The tenant's (prompt tokens, completion tokens, requests) so far, from the admin report."""
    with serving.admin() as admin:
        report = admin.get("/admin/usage", params={"group_by": "tenant", "from": "2020-01-01"}).json()
    rows = [row for row in report["data"] if row["tenant_id"] == tenant_id]
    return (rows[0]["prompt_tokens"], rows[0]["completion_tokens"], rows[0]["requests"]) if rows else (0, 0, 0)


def json_and_csv(serving: Deployment, params: dict[str, str]) -> tuple[dict, list[dict[str, str]]]:
    """The same report as JSON and as CSV rows, read while no usage arrived in between (servers report
    adapter residency all the time): JSON is read before and after the CSV until both reads agree."""

    def consistent() -> tuple[dict, list[dict[str, str]]] | None:
        with serving.admin() as admin:
            before = admin.get("/admin/usage", params=params).json()
            as_csv = admin.get("/admin/usage", params={**params, "format": "csv"})
            after = admin.get("/admin/usage", params=params).json()
        assert as_csv.headers["content-type"].startswith("text/csv")
        rows = list(csv.DictReader(io.StringIO(as_csv.text)))
        return (after, rows) if before == after else None

    return serving.wait_until(consistent, "a report that did not change while it was read")


@pytest.mark.parametrize("group_by", ["tenant", "adapter", "day"])
def test_csv_and_json_reports_agree(serving: Deployment, trained_adapter: TrainedAdapter, group_by: str) -> None:
    trained_adapter.owner.openai().completions.create(model=trained_adapter.model, prompt="x", max_tokens=2)
    report, rows = json_and_csv(serving, {"group_by": group_by, "from": "2020-01-01"})
    data = report["data"]
    assert data and len(rows) == len(data)
    for row, obj in zip(rows, data, strict=True):
        assert row == {k: "" if v is None else str(v) for k, v in obj.items()}


def test_training_is_in_the_owners_report(serving: Deployment, trained_adapter: TrainedAdapter) -> None:
    with trained_adapter.owner.http() as http:
        own = http.get("/v1/usage", params={"group_by": "adapter"}).json()
    [row] = [r for r in own["data"] if r["adapter_id"] == trained_adapter.adapter_id]
    assert row["model"] == trained_adapter.model
    assert row["training_tokens"] > 0 and row["job_compute_seconds"] > 0 and row["storage_bytes"] > 0


def test_a_stream_the_client_abandons_is_metered_at_what_it_received(serving: Deployment) -> None:
    tenant = serving.make_tenant()
    body = {"model": serving.base_model, "prompt": "Go on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    pieces = 0
    with tenant.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                pieces += 1
            if pieces == 3:
                break  # leaving the block closes the connection mid-stream

    [record] = serving.wait_until(lambda: serving.usage_records(tenant.id), "the abandoned stream to be metered")
    assert record.status == "client_disconnected"
    assert 3 <= record.completion_tokens < 2000
    assert record.ttft_ms is not None and record.latency_ms is not None and record.latency_ms >= record.ttft_ms


def test_a_request_given_up_before_its_answer_stops_on_its_replica_and_is_billed_nothing(serving: Deployment) -> None:
    tenant = serving.make_tenant()

    def generated() -> float:
        return sum(serving.replica_metric(r, "loraplex_generation_tokens_total") for r in serving.replicas)

    before = generated()
    impatient = tenant.openai().with_options(timeout=0.5, max_retries=0)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(
            model=serving.base_model, prompt="Go on", max_tokens=2000, extra_body={"ignore_eos": True}
        )

    [record] = serving.wait_until(lambda: serving.usage_records(tenant.id), "the given-up request to be metered")
    assert record.status == "client_disconnected"
    assert (record.prompt_tokens, record.completion_tokens) == (0, 0)  # nothing reached the client

    def idle() -> bool:
        return all(serving.replica_metric(r, "loraplex_requests_running") == 0 for r in serving.replicas)

    serving.wait_until(idle, "the replicas to stop generating")
    assert generated() - before < 2000  # the replica stopped when its client left, not at max_tokens

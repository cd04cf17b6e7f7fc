"""The OpenAI-compatible surface, driven by the openai SDK: completions and chat, streaming or not, for the
base model, a local adapter and a stored one (by descriptor); usage, token ids, logprobs, models, errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import httpx
import openai
import pytest
from openai.lib._parsing._completions import type_to_response_format_param
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from core.descriptor import AdapterDescriptor
from core.protocol import ADAPTER_FIELD, STATS_FIELD
from core.storage import S3ObjectStore
from tests.integration.server.adapters import copy_adapter, upload, variant
from tests.integration.server.harness import NO_EOS, ServerUnderTest, served, server_config

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 10
MAX_MODEL_LEN = 512
MAX_N = 4


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory, peft_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("adapter-root")
    copy_adapter(peft_dir, root / "local-a")
    variant(peft_dir, root / "nested" / "local-b", seed=5)
    return root


@pytest.fixture(scope="module")
def stored(s3_store: S3ObjectStore, peft_dir: Path, tmp_path_factory: pytest.TempPathFactory, base_name: str):
    return upload(s3_store, variant(peft_dir, tmp_path_factory.mktemp("stored") / "a", seed=2), base_name)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, adapter_root: Path, s3_store: S3ObjectStore) -> Iterator[ServerUnderTest]:
    # The engine in its own process, as `loraplex server` runs it: every route here crosses the pipe.
    config = server_config(
        tiny_model_dir, adapter_root=adapter_root, max_n=MAX_N, max_model_len=MAX_MODEL_LEN, engine_process=True
    )
    yield from served(config, s3_store)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def target(model: str, stored: AdapterDescriptor) -> tuple[str, dict]:
    """``model`` and the extra body that names it: the stored adapter travels as a descriptor."""
    if model == "stored":
        return stored.name, {ADAPTER_FIELD: stored.model_dump()}
    return model, {}


@pytest.mark.parametrize("which", ["base", "local-a", "stored"])
def test_completions_streamed_and_not_agree_and_count_usage(server, stored, tokenizer, base_name, which):
    model, extra = target(base_name if which == "base" else which, stored)
    client = server.client()
    body = {"ignore_eos": True, "return_token_ids": True, **extra}
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=body)
    expected_prompt = tokenizer(PROMPT).input_ids
    assert whole.model == model
    assert whole.usage.prompt_tokens == len(expected_prompt) and whole.prompt_token_ids == expected_prompt
    assert whole.usage.completion_tokens == MAX_TOKENS == len(whole.choices[0].token_ids)
    assert whole.usage.total_tokens == len(expected_prompt) + MAX_TOKENS
    assert whole.choices[0].finish_reason == "length"
    stats = getattr(whole, STATS_FIELD)
    assert stats["replica"] == server.config.replica_id and stats["gpu_seconds"] > 0

    chunks = list(
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=body,
        )
    )  # fmt: skip
    *deltas, last = chunks
    assert "".join(c.choices[0].text for c in deltas if c.choices) == whole.choices[0].text
    assert [t for c in deltas if c.choices for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    assert last.choices == [] and last.usage.completion_tokens == MAX_TOKENS
    assert last.usage.prompt_tokens == len(expected_prompt)
    assert getattr(last, STATS_FIELD)["replica"] == server.config.replica_id


def test_adapters_change_the_tokens(server, stored, base_name):
    client = server.client()
    outputs = {}
    for which in ("base", "local-a", "nested/local-b", "stored"):
        model, extra = target(base_name if which == "base" else which, stored)
        out = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
        )  # fmt: skip
        outputs[which] = tuple(out.choices[0].token_ids)
    assert len(set(outputs.values())) == len(outputs), outputs


@pytest.mark.parametrize("which", ["base", "stored"])
def test_chat_streamed_and_not_agree_and_count_usage(server, stored, tokenizer, base_name, which):
    model, extra = target(base_name if which == "base" else which, stored)
    client = server.client()
    body = {"ignore_eos": True, **extra}
    whole = client.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, temperature=0, extra_body=body
    )
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    expected_prompt = len(tokenizer(rendered, add_special_tokens=False).input_ids)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == expected_prompt and whole.usage.completion_tokens == MAX_TOKENS

    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=body,
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == expected_prompt and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_id_prompts_seeded_n_and_logprobs(server, base_name):
    client = server.client()
    prompt = [1, 50, 60, 70, 80, 90]
    args = dict(model=base_name, prompt=prompt, max_tokens=6, n=2, temperature=0.9, seed=7, logprobs=2)
    first = client.completions.create(**args, extra_body={"ignore_eos": True, "return_token_ids": True})
    again = client.completions.create(**args, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert first.usage.prompt_tokens == len(prompt) and first.usage.completion_tokens == 12
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in again.choices]
    for choice in first.choices:
        assert len(choice.logprobs.tokens) == 6 and all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)

    chat = client.chat.completions.create(
        model=base_name, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)


def test_models_lists_the_base_and_adapters_with_their_parent(server, stored, base_name):
    server.client().completions.create(model="local-a", prompt=PROMPT, max_tokens=1)
    server.client().completions.create(
        model=stored.name, prompt=PROMPT, max_tokens=1, extra_body={ADAPTER_FIELD: stored.model_dump()}
    )
    models = {m.id: m for m in server.client().models.list().data}
    assert models[base_name].parent is None
    assert models["local-a"].parent == base_name and models[stored.name].parent == base_name
    assert models[stored.name].root == stored.id


def test_vllm_style_load_and_unload(server, stored, base_name):
    with server.http() as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "float", "lora_path": "nested/local-b"})
        assert loaded.status_code == 200, loaded.text
        client = server.client()
        assert "float" in {m.id for m in client.models.list().data}  # a name that is also a Python builtin
        assert (
            client.completions.create(
                model="float", prompt=PROMPT, max_tokens=2, extra_body=NO_EOS
            ).usage.completion_tokens
            == 2
        )
        other = http.post("/v1/load_lora_adapter", json={"lora_name": "float", "lora_path": "local-a"})
        assert other.status_code == 409 and other.headers["x-should-retry"] == "false"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "float"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="float", prompt=PROMPT, max_tokens=2)
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "float"}).status_code == 404

        # The platform's prefetch: a descriptor instead of a path; answered once the adapter is resident.
        prefetch = {"lora_name": stored.name, "adapter": stored.model_dump(), "pinned": True}
        assert http.post("/v1/load_lora_adapter", json=prefetch).status_code == 200
        assert stored.id in server.runtime.replica_status().resident_adapters


def test_absolute_lora_paths_load_inside_the_root_only(server, adapter_root, tmp_path):
    """vLLM clients send absolute paths: inside --adapter-root they load; outside it (or via '..') they are refused."""
    outside = tmp_path / "outside-a"
    copy_adapter(adapter_root / "local-a", outside)
    with server.http() as http:
        inside = {"lora_name": "abs-b", "lora_path": str(adapter_root / "nested" / "local-b")}
        assert http.post("/v1/load_lora_adapter", json=inside).status_code == 200
        assert server.client().completions.create(model="abs-b", prompt=PROMPT, max_tokens=1).usage.completion_tokens
        for path in (str(outside), f"{adapter_root}/../{outside.name}", "/etc"):
            refused = http.post("/v1/load_lora_adapter", json={"lora_name": "abs-x", "lora_path": path})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "lora_path"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "abs-b"}).status_code == 200


def test_sampling_knobs_through_the_sdk(server, base_name, tokenizer):
    """Penalties, logit bias and min-p are honoured (unit tests check the formulas), and seeded runs repeat."""
    client = server.client()
    a, b = tokenizer("ab", add_special_tokens=False).input_ids
    args = dict(model=base_name, prompt=PROMPT, max_tokens=8, temperature=0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    bias = {str(a): 100, str(b): 100}
    forced = client.completions.create(**args, logit_bias=bias, extra_body=extra)
    assert set(forced.choices[0].token_ids) <= {a, b}
    # A strong frequency penalty makes the two favourites take turns rather than one repeating.
    spread = client.completions.create(**args, logit_bias=bias, frequency_penalty=2.0, extra_body=extra)
    assert set(spread.choices[0].token_ids) == {a, b}
    chat = client.chat.completions.create(
        model=base_name, messages=MESSAGES, max_tokens=4, temperature=0, logit_bias={str(a): 100},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.choices[0].message.content == "aaaa"
    neutral = dict(presence_penalty=0, frequency_penalty=0, logit_bias={})
    plain = client.completions.create(**args, extra_body=extra).choices[0].token_ids
    knobbed = client.completions.create(**args, **neutral, extra_body={**extra, "repetition_penalty": 1, "min_p": 0})
    assert plain == knobbed.choices[0].token_ids  # neutral knobs leave greedy output alone
    seeded = dict(model=base_name, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, presence_penalty=1.0)
    vllm = {**extra, "repetition_penalty": 1.3, "min_p": 0.1}
    first = client.completions.create(**seeded, extra_body=vllm).choices[0].token_ids
    assert client.completions.create(**seeded, extra_body=vllm).choices[0].token_ids == first


def test_stop_strings_spanning_tokens_cut_the_text(server, base_name):
    """Byte-level tokens: a three-character stop string spans three tokens, streamed or not, and never leaks."""
    client = server.client()
    args = dict(model=base_name, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**args, max_tokens=24).choices[0].text
    stop = full[9:12]
    assert len(stop) == 3
    cut = client.completions.create(**args, max_tokens=24, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**args, max_tokens=24, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut.choices[0].text


def test_ignorable_openai_fields_are_accepted(server, base_name):
    client = server.client()
    ignorable = {"user": "u-1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
                 "parallel_tool_calls": False, "safety_identifier": "s", "prompt_cache_key": "c", **NO_EOS}  # fmt: skip
    out = client.chat.completions.create(model=base_name, messages=MESSAGES, max_tokens=2, extra_body=ignorable)
    assert out.usage.completion_tokens == 2
    done = client.completions.create(model=base_name, prompt=PROMPT, max_tokens=2, user="u-1", extra_body=ignorable)
    assert done.usage.completion_tokens == 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streams_are_server_sent_events_ending_in_done(server, base_name, path):
    body = {"model": base_name, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    with server.http() as http, http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_every_route_but_health_needs_the_internal_token(server, base_name):
    assert httpx.get(f"{server.url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.config.internal_token}):
        with httpx.Client(base_url=server.url, headers=headers) as http:
            for method, path in [("GET", "/ready"), ("GET", "/metrics"), ("GET", "/v1/models"),
                                 ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                 ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter")]:  # fmt: skip
                response = http.request(method, path, json={"model": base_name, "prompt": "x"})
                assert response.status_code == 401, (path, response.text)
                assert response.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens", "context"),
        ({"prompt": PROMPT, "n": MAX_N + 1}, 400, "n", "at most"),
        ({"prompt": ""}, 400, "prompt", "empty"),
        ({"prompt": []}, 400, "prompt", "empty"),
        ({"prompt": "x" * MAX_MODEL_LEN}, 400, "prompt", "context"),
        ({"prompt": ["a", "b"]}, 400, "prompt", "one string"),
        ({"prompt": [1, 99999]}, 400, "prompt", "token ids"),
        ({"prompt": PROMPT, "presence_penalty": 3.0}, 400, "presence_penalty", "[-2, 2]"),
        ({"prompt": PROMPT, "logit_bias": {"99999": 1}}, 400, "logit_bias", "vocabulary"),
        ({"prompt": PROMPT, "min_tokens": 2}, 400, "min_tokens", "unknown field"),
        ({"prompt": PROMPT, "stream": True, "stream_options": {"chunk": 1}}, 400, "stream_options.chunk", "unknown"),
        ({"messages": MESSAGES, "functions": [{"name": "f"}]}, 400, "functions", "unknown field"),
        ({"messages": MESSAGES, "repetition_penalty": -1}, 400, "repetition_penalty", "> 0"),
        ({"prompt": PROMPT, "temperature": -1}, 400, "temperature", "greater than or equal"),
        ({"prompt": PROMPT, "model": "no-such-model"}, 404, "model", "neither the base model"),
        ({"prompt": PROMPT, "model": "../etc"}, 400, "model", ".."),
        ({"messages": []}, 400, "messages", "non-empty"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "one of"),
        ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content", "text"),
        ({"messages": "hello"}, 400, "messages", "non-empty"),
    ],
)
def test_bad_requests_get_openai_errors(server, base_name, body, status, param, words):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with server.http() as http:
        response = http.post(path, json={"model": base_name, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


def test_malformed_bodies_are_400_and_the_sdk_raises_typed_errors(server, base_name, stored):
    with server.http() as http:
        assert http.post("/v1/completions", content=b'{"model": "x", "prompt": ').status_code == 400
        invalid_utf8 = b'{"model": "' + base_name.encode() + b'", "prompt": "\xff\xfe"}'
        assert http.post("/v1/completions", content=invalid_utf8).status_code == 400
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="descriptor"):
        client.completions.create(model=base_name, prompt=PROMPT, extra_body={ADAPTER_FIELD: stored.model_dump()})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=MESSAGES)
    assert (
        client.completions.create(
            model=base_name, prompt=PROMPT, max_tokens=1, extra_body=NO_EOS
        ).usage.completion_tokens
        == 1
    )


def test_metrics_expose_exactly_the_documented_names(server):
    server.client().completions.create(model="local-a", prompt=PROMPT, max_tokens=3)
    metrics = server.metrics()
    assert metrics.types == {
        "loraplex_requests_running", "loraplex_requests_waiting", "loraplex_pool_pages",
        "loraplex_adapters_resident", "loraplex_adapter_loads_total", "loraplex_adapter_evictions_total",
        "loraplex_adapter_load_seconds", "loraplex_time_to_first_token_seconds",
        "loraplex_inter_token_latency_seconds", "loraplex_e2e_request_latency_seconds",
        "loraplex_prompt_tokens_total", "loraplex_generation_tokens_total",
        "loraplex_prefix_cache_queries_total", "loraplex_prefix_cache_hits_total",
        "loraplex_tenant_sequences", "loraplex_tenant_kv_pages",
    }  # fmt: skip
    assert metrics.value("loraplex_adapter_loads_total", tier="local") >= 1
    assert metrics.value("loraplex_time_to_first_token_seconds_count") >= 1
    assert metrics.value("loraplex_prefix_cache_queries_total") >= metrics.value("loraplex_prefix_cache_hits_total")
    stats = server.runtime.loop.view.pool
    assert (
        sum(metrics.value("loraplex_pool_pages", kind=kind) for kind in ("free", "adapter", "kv", "kv_cached"))
        == stats.total_pages
    )


@pytest.mark.parametrize("which", ["base", "local-a"])
def test_repeated_prompts_report_cached_tokens(server, base_name, which):
    """The second request with the same long prompt and model reads its full pages from the prefix cache, and
    says so in usage.prompt_tokens_details.cached_tokens: completions and chat, streamed or not."""
    model, client = base_name if which == "base" else which, server.client()
    prompt = f"Cached prefix probe for {which}: " + "the same words again and again, " * 3
    messages = [{"role": "system", "content": prompt}, {"role": "user", "content": "Name a colour."}]
    body = {"ignore_eos": True}
    hits_before = server.metrics().value("loraplex_prefix_cache_hits_total")

    def completion(stream: bool):
        kw = dict(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=body)
        if not stream:
            return client.completions.create(**kw).usage
        return list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))[-1].usage

    def chat(stream: bool):
        kw = dict(model=model, messages=messages, max_tokens=2, temperature=0, extra_body=body)
        if not stream:
            return client.chat.completions.create(**kw).usage
        return list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))[-1].usage

    for ask in (completion, chat):
        first = ask(stream=False)
        assert first.prompt_tokens > 32 and first.prompt_tokens_details.cached_tokens == 0
        for stream in (False, True):
            again = ask(stream=stream)
            cached = again.prompt_tokens_details.cached_tokens
            assert 32 <= cached < again.prompt_tokens and cached % 16 == 0
    assert server.metrics().value("loraplex_prefix_cache_hits_total") >= hits_before + 4 * 32


# ----- structured outputs: response_format through the stock SDK ------------------------------------------------


class Colour(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=8)
    floor: int = Field(ge=0, le=99)


class Person(BaseModel):
    """Nested objects, an enum, a bounded array and an optional field (bounded, so the random model finishes)."""

    name: str = Field(max_length=8)
    colour: Colour
    address: Address
    scores: list[Annotated[int, Field(ge=0, le=9)]] = Field(min_length=1, max_length=3)
    nickname: str | None = Field(default=None, max_length=4)


STRUCTURED_MAX_TOKENS = 300  # above the longest output Person allows: constrained outputs always finish


def person_format() -> dict:
    return type_to_response_format_param(Person)


def test_chat_parse_returns_the_pydantic_object(server, base_name):
    client = server.client()
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=base_name,
            messages=MESSAGES,
            response_format=Person,
            seed=seed,
            max_completion_tokens=STRUCTURED_MAX_TOKENS,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person), choice.message.content
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_output_parses_on_both_routes(server, base_name):
    client = server.client()
    chat = client.chat.completions.create(
        model=base_name, messages=MESSAGES, response_format={"type": "json_object"}, temperature=0
    )
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    finished = 0
    for seed in range(6):  # an unbounded object may be cut by max_tokens: finish_reason "length" says so
        choice = client.completions.create(
            model=base_name,
            prompt=PROMPT,
            max_tokens=200,
            seed=seed,
            extra_body={"response_format": {"type": "json_object"}},
        ).choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
            finished += 1
        else:
            assert choice.finish_reason == "length" and choice.text.startswith("{")
    assert finished


def test_streamed_constrained_output_concatenates_to_valid_json(server, base_name):
    stream = server.client().chat.completions.create(
        model=base_name, messages=MESSAGES, response_format=person_format(), seed=4, stream=True,
        max_completion_tokens=STRUCTURED_MAX_TOKENS,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    assert len(chunks) > 3 and chunks[-1].choices[0].finish_reason == "stop"
    Person.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks))


def test_constrained_and_free_requests_share_steps_on_different_adapters(server, base_name):
    """Free greedy requests give the same tokens whether or not constrained ones run beside them."""
    client = server.client()

    def free(model: str) -> list[int]:
        out = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        return out.choices[0].token_ids

    def constrained(seed: int) -> Person:
        completion = client.chat.completions.parse(
            model="nested/local-b", messages=MESSAGES, response_format=Person, seed=seed,
            max_completion_tokens=STRUCTURED_MAX_TOKENS,
        )  # fmt: skip
        return completion.choices[0].message.parsed

    alone = {model: free(model) for model in (base_name, "local-a")}
    with ThreadPoolExecutor(8) as pool:
        frees = [pool.submit(free, model) for model in (base_name, "local-a") * 3]
        parsed = [pool.submit(constrained, seed) for seed in range(6)]
        assert [f.result() for f in frees] == [alone[base_name], alone["local-a"]] * 3
        assert all(isinstance(p.result(), Person) for p in parsed)


def test_unsupported_schema_features_are_a_400_naming_them(server, base_name):
    schema = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model=base_name, messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": "ids", "schema": schema, "strict": True}},
        )  # fmt: skip
    error = info.value.body.get("error", info.value.body)
    assert info.value.status_code == 400 and error["param"] == "response_format" and "uniqueItems" in error["message"]


# ----- tool calling ----------------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOL_QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]
TOOL_MODEL_LEN = 2048  # the template's tool preamble alone is ~400 byte tokens


@pytest.fixture(scope="module")
def tool_server(tiny_model_dir: Path, s3_store: S3ObjectStore) -> Iterator[ServerUnderTest]:
    yield from served(server_config(tiny_model_dir, max_model_len=TOOL_MODEL_LEN), s3_store)


TOOL_ARGS = {"tools": [WEATHER_TOOL, CLOCK_TOOL], "temperature": 0, "max_tokens": 200, "parallel_tool_calls": False}


def streamed_message(client, **kwargs) -> tuple[str | None, list[dict], str]:
    """A streamed chat completion put back together: content, tool calls (merged by index), finish reason."""
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    return "".join(content) or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip_call_then_result_then_answer(tool_server, base_name, stream):
    client = tool_server.client()
    args = {"model": base_name, **TOOL_ARGS, "tool_choice": "required"}
    if stream:
        content, calls, finish = streamed_message(client, messages=TOOL_QUESTION, **args)
    else:
        out = client.chat.completions.create(messages=TOOL_QUESTION, **args)
        message, finish = out.choices[0].message, out.choices[0].finish_reason
        content = message.content
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    # The random model writes what the grammar lets it: one call to a listed function with valid arguments.
    assert finish == "tool_calls" and content is None and len(calls) == 1
    call = calls[0]
    assert call["id"].startswith("call_") and call["name"] in ("get_weather", "get_time")
    arguments = json.loads(call["arguments"])
    assert isinstance(arguments, dict) and (call["name"] != "get_weather" or isinstance(arguments["city"], str))

    history = [
        *TOOL_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
        ]},
        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"},
    ]  # fmt: skip
    answer = {"model": base_name, **TOOL_ARGS, "tool_choice": "none", "max_tokens": 8}
    if stream:
        content, calls, finish = streamed_message(client, messages=history, **answer)
    else:
        out = client.chat.completions.create(messages=history, **answer)
        content, calls, finish = out.choices[0].message.content, out.choices[0].message.tool_calls or [], None
    assert calls == [] and isinstance(content, str)


def test_named_tool_choice_forces_that_function(tool_server, base_name):
    client = tool_server.client()
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=base_name, messages=TOOL_QUESTION, **TOOL_ARGS, tool_choice=choice)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    assert out.choices[0].finish_reason == "tool_calls"


def test_streamed_call_comes_as_a_head_then_argument_fragments(tool_server, base_name):
    """OpenAI's shape: the first delta carries id, type and name; the rest only ``function.arguments`` pieces,
    which the SDK's own stream helper puts back together into the call."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    args = {"model": base_name, "messages": TOOL_QUESTION, **TOOL_ARGS, "tool_choice": choice}
    deltas = []
    with tool_server.client().chat.completions.stream(**args) as stream:
        for event in stream:
            if event.type == "chunk":
                deltas += [d for c in event.chunk.choices for d in c.delta.tool_calls or []]
        final = stream.get_final_completion()
    head, *rest = deltas
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and rest
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    (call,) = final.choices[0].message.tool_calls
    fragments = (head.function.arguments or "") + "".join(d.function.arguments or "" for d in rest)
    assert call.id == head.id and call.function.arguments == fragments
    assert set(json.loads(fragments)) == {"city"} and final.choices[0].finish_reason == "tool_calls"


def test_the_template_renders_tools_and_calls_into_the_prompt(tool_server, base_name, tokenizer):
    history = [
        *TOOL_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]  # fmt: skip
    out = tool_server.client().chat.completions.create(
        model=base_name, messages=history, tools=[WEATHER_TOOL], max_tokens=1, extra_body={"return_token_ids": True}
    )
    prompt = tokenizer.decode(out.prompt_token_ids)
    assert '"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert "<tools>" in prompt and "Sunny" in prompt


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "letters"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}
                ]
            },
            "tools[0].function.parameters",
            "not a valid JSON schema",
        ),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER_TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "forces a call",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "call"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
            "JSON",
        ),
    ],
)
def test_bad_tool_fields_are_400s_naming_them(tool_server, base_name, extra, param, words):
    with tool_server.http() as http:
        response = http.post("/v1/chat/completions", json={"model": base_name, "messages": MESSAGES, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    with tool_server.http() as http:
        refused = http.post("/v1/completions", json={"model": base_name, "prompt": PROMPT, "tools": [WEATHER_TOOL]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


def test_tenants_and_cache_salts_keep_prefix_caches_apart(server, base_name):
    """Only requests of the same tenant (the control plane's tag; none: the direct tenant) and the same
    cache_salt share cached pages; service_tier "flex" runs in the batch class, answering the same tokens."""
    client, prompt = server.client(), "Shared between callers who must not see each other: " + "padding words, " * 6

    def cached(**extra: object) -> int:
        body = {"ignore_eos": True, **extra}
        usage = client.completions.create(model=base_name, prompt=prompt, max_tokens=1, extra_body=body).usage
        return usage.prompt_tokens_details.cached_tokens

    assert cached() == 0 and cached() >= 32
    assert cached(tenant={"id": "t-1"}) == 0 and cached(tenant={"id": "t-1", "weight": 3}) >= 32
    assert cached(tenant={"id": "t-2"}) == 0
    assert cached(cache_salt="s") == 0 and cached(cache_salt="s") >= 32 and cached(cache_salt="other") == 0
    assert cached(tenant={"id": "t-1"}, cache_salt="s") == 0
    args = dict(model=base_name, prompt=PROMPT, max_tokens=4, temperature=0)
    flex = client.completions.create(**args, extra_body={"service_tier": "flex"}).choices[0].text
    assert flex == client.completions.create(**args).choices[0].text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"service_tier": "fast"}, "service_tier"),
        ({"tenant": {"id": ""}}, "tenant"),
        ({"cache_salt": ""}, "cache_salt"),
    ],
)
def test_bad_tenancy_fields_are_400s_naming_them(server, base_name, extra, param):
    with server.http() as http:
        response = http.post("/v1/completions", json={"model": base_name, "prompt": PROMPT, "max_tokens": 1, **extra})
    assert response.status_code == 400, response.text
    assert param in response.text


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server, base_name):
    """vLLM's ``stream_options.continuous_usage_stats``: the API asks for it on every stream, so a stream cut
    short is billed at the usage of the last chunk that went out."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": base_name, "prompt": PROMPT, "max_tokens": 4, "n": 2, "ignore_eos": True, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body | {"stream_options": options}) as r:
        chunks = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line.startswith("data: {")]
    *deltas, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8  # both choices' tokens
    so_far = [c["usage"]["completion_tokens"] for c in deltas]
    assert so_far == sorted(so_far) and so_far[-1] == 8  # grows with each step, to the final count
    assert sum(len(c["choices"]) for c in deltas) == 8  # one step of each choice per token, all counted
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {last["usage"]["prompt_tokens"]}

    without = {"include_usage": False, "continuous_usage_stats": True}  # as in vLLM: only with include_usage
    with server.http() as http, http.stream("POST", "/v1/completions", json=body | {"stream_options": without}) as r:
        chunks = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and all("usage" not in c for c in chunks)

"""Structured outputs in the engine: every completion matches its JSON schema (random schemas, n > 1, preemption),
grammars compile once per schema, and what the grammar engine cannot enforce is refused naming the feature."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import InvalidRequest
from server.engine.grammar import JSON_OBJECT_SCHEMA, canonical_schema
from server.engine.sampling_params import SamplingParams
from server.memory.block_manager import blocks_for
from server.offline import LLM

MAX_TOKENS = 400  # above the longest output the bounded schemas below allow, so every completion finishes
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "nick": {"type": "string", "maxLength": 4},
    },
    "required": ["name", "age", "colour", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, pool_bytes=16 << 20, max_model_len=512)


def constrained(schema: dict | str, **params) -> SamplingParams:
    text = schema if isinstance(schema, str) else canonical_schema(schema)
    return SamplingParams(**{"temperature": 1.0, "max_tokens": MAX_TOKENS, "json_schema": text, **params})


def assert_valid(completion, schema: dict) -> object:
    assert completion.finish_reason == "stop", completion.text
    value = json.loads(completion.text)
    jsonschema.validate(value, schema)
    return value


def test_n_completions_each_follow_the_schema_with_their_own_matcher(llm):
    compiled = llm.engine.grammars.compilations
    (out,) = llm.generate([("Describe someone:", None, constrained(PERSON, n=4, seed=7))])
    values = [assert_valid(c, PERSON) for c in out.outputs]
    assert len({json.dumps(v) for v in values}) > 1  # independent completions, not one matcher shared
    llm.generate([("Again:", None, constrained(json.loads(canonical_schema(PERSON)), seed=8))])
    assert llm.engine.grammars.compilations - compiled == 1  # compiled once, then served from the cache


def test_json_object_always_parses_greedy_or_sampled(llm):
    requests = [
        (f"Say {i}", None, constrained(JSON_OBJECT_SCHEMA, temperature=t, seed=i)) for i in range(4) for t in (0, 1)
    ]
    for out in llm.generate(requests):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:  # cut by max_tokens: the documented "length" case
            assert completion.finish_reason == "length" and completion.num_tokens == MAX_TOKENS


def test_preempted_constrained_sequences_resume_their_grammar(tiny_model_dir, llm):
    requests = [(f"Person number {i}:", None, constrained(PERSON, seed=i)) for i in range(6)]
    expected = [out.outputs[0].text for out in llm.generate(requests)]
    stats = llm.engine.pool_stats()
    kv_pages = 2 * blocks_for(MAX_TOKENS // 4, 16) + 1  # about two sequences' worth: the rest wait or are preempted
    small = LLM(tiny_model_dir, pool_bytes=kv_pages * stats.page_bytes, max_model_len=512, watermark=0.0)
    outs = small.generate(requests)
    assert small.engine.num_preemptions > 0
    assert [out.outputs[0].text for out in outs] == expected
    for out in outs:
        assert_valid(out.outputs[0], PERSON)


def test_constrained_outputs_over_two_tensor_parallel_ranks_equal_one_rank(tiny_model_dir, llm):
    """Split over two ranks, rank 0 alone masks and samples the gathered logits: the same schema-valid answers."""
    requests = [(f"Person number {i}:", None, constrained(PERSON, temperature=0.0)) for i in range(3)]
    expected = [out.outputs[0].text for out in llm.generate(requests)]
    with LLM(tiny_model_dir, pool_bytes=16 << 20, max_model_len=512, tensor_parallel_size=2, num_threads=1) as split:
        outs = split.generate(requests)
    assert [out.outputs[0].text for out in outs] == expected
    for out in outs:
        assert_valid(out.outputs[0], PERSON)


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ],
)
def test_unsupported_schema_features_are_refused_naming_them(llm, schema, feature):
    with pytest.raises(InvalidRequest) as info:
        llm.engine.add_request("bad", "x", constrained(schema))
    assert info.value.param == "response_format" and feature in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_the_grammar_cache_is_bounded(llm):
    grammars = llm.engine.grammars
    for i in range(grammars.capacity + 5):
        grammars.matcher(canonical_schema({"type": "integer", "minimum": i, "maximum": i + 1}))
    assert len(grammars._compiled) == grammars.capacity


# ----- random schemas: every completion validates ---------------------------------------------------------------

NAMES = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
STRINGS = st.builds(
    lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra}, st.integers(0, 2), st.integers(0, 5)
)
INTEGERS = st.builds(
    lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span}, st.integers(-99, 99), st.integers(0, 999)
)
ENUMS = st.lists(st.text(alphabet="xyz é", min_size=1, max_size=4), min_size=1, max_size=4, unique=True)
LEAVES = st.one_of(STRINGS, INTEGERS, st.just({"type": "boolean"}), ENUMS.map(lambda values: {"enum": values}))


def objects(children: st.SearchStrategy) -> st.SearchStrategy:
    def with_required(props: dict) -> st.SearchStrategy:
        required = st.sets(st.sampled_from(sorted(props))) if props else st.just(set())
        return required.map(
            lambda req: {"type": "object", "properties": props, "required": sorted(req), "additionalProperties": False}
        )

    return st.dictionaries(NAMES, children, max_size=4).flatmap(with_required)


def extend(children: st.SearchStrategy) -> st.SearchStrategy:
    arrays = st.builds(
        lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + extra},
        children,
        st.integers(0, 2),
        st.integers(0, 1),
    )
    return arrays | objects(children)


SCHEMAS = objects(st.recursive(LEAVES, extend, max_leaves=5))


@settings(max_examples=25, deadline=None)
@given(schema=SCHEMAS, seed=st.integers(0, 2**31))
def test_random_schemas_every_completion_validates(llm, schema, seed):
    (out,) = llm.generate([("Fill this in:", None, constrained(schema, n=2, seed=seed))])
    for completion in out.outputs:
        assert_valid(completion, schema)

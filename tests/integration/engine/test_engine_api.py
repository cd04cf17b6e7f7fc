"""The engine as a streaming server drives it: deltas, stop conditions, abort, n, seeds, logprobs, adapters."""

from __future__ import annotations

import pytest

from core.errors import ConfigError
from core.tiny_model import EOS_ID, TinyModelSpec, make_tiny_model
from server.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from server.engine.errors import AdapterInUse, AdapterNotLoaded, DuplicateRequest, PromptTooLong
from server.offline import LLM
from tests.integration.engine.models import save_adapter

PROMPT = "Hello, loraplex!"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden=64, layers=2, heads=4, kv_heads=2))


@pytest.fixture
def engine(model_dir):
    return LLMEngine(EngineConfig(model=str(model_dir), pool_bytes=2 << 20, max_model_len=512))


def drain(engine: LLMEngine) -> list[RequestOutput]:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_streamed_deltas_add_up_to_the_final_completion(engine):
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    outputs = drain(engine)
    final = outputs[-1]
    assert final.finished and all(not o.finished for o in outputs[:-1])
    completion = final.outputs[0]
    assert completion.finish_reason == "length" and completion.num_tokens == 40
    deltas = [c for out in outputs for c in out.outputs]
    assert [t for c in deltas for t in c.new_token_ids] == completion.token_ids
    assert "".join(c.new_text for c in deltas) == completion.text
    assert final.num_prompt_tokens == len(engine.encode(PROMPT)) and final.num_completion_tokens == 40
    assert final.first_token_time is not None and final.arrival_time <= final.first_token_time
    assert engine.pool_stats().kv_pages == 0


def test_stop_strings_and_stop_tokens(engine):
    engine.add_request("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    free = drain(engine)[-1].outputs[0]
    text, tokens = free.text, free.token_ids
    stop = text[8:11]
    assert stop and text.find(stop) == 8
    engine.add_request("s", PROMPT, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))
    outputs = drain(engine)
    completion = outputs[-1].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == text[:8]
    assert "".join(c.new_text for out in outputs for c in out.outputs) == text[:8]

    stop_id = tokens[5]
    first = tokens.index(stop_id)
    engine.add_request("t", PROMPT, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_id]))
    completion = drain(engine)[-1].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    assert completion.token_ids == tokens[: first + 1]


def test_eos_stops_unless_ignored(engine):
    assert EOS_ID in engine.eos_token_ids  # read from the model's config and tokenizer
    engine.add_request("g", PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    tokens = drain(engine)[-1].outputs[0].token_ids
    # A random tiny model rarely emits its real EOS: treat a token it does emit greedily as end of sequence.
    eos = tokens[4]
    first = tokens.index(eos)
    engine.eos_token_ids = {EOS_ID, eos}

    engine.add_request("e", PROMPT, SamplingParams(temperature=0.0, max_tokens=12))
    stopped = drain(engine)[-1].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
    assert stopped.token_ids == tokens[: first + 1]

    engine.add_request("i", PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    ignored = drain(engine)[-1].outputs[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == tokens


def test_abort_reports_and_frees(engine):
    engine.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    engine.add_request("b", PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("a")
    outputs = drain(engine)
    aborted = [o for o in outputs if o.request_id == "a"]
    assert aborted[-1].finished and aborted[-1].outputs[0].finish_reason == "abort"
    assert engine.pool_stats().kv_pages == 0 and not engine.has_unfinished_requests()


def test_n_completions_with_seed_are_reproducible_and_independent_of_the_batch(model_dir, engine):
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, seed=42, max_tokens=12, ignore_eos=True)
    engine.add_request("alone", PROMPT, params)
    alone = drain(engine)
    by_index = {c.index: c.token_ids for out in alone for c in out.outputs if c.finished}
    assert sorted(by_index) == [0, 1, 2]
    assert len({tuple(t) for t in by_index.values()}) > 1  # each completion draws its own stream

    crowded = LLMEngine(EngineConfig(model=str(model_dir), pool_bytes=2 << 20, max_num_batched_tokens=24))
    for i in range(4):
        crowded.add_request(f"other{i}", "other " * (i + 1), SamplingParams(temperature=0.7, max_tokens=9))
    crowded.add_request("again", PROMPT, params)
    again = drain(crowded)
    again_by_index = {c.index: c.token_ids for out in again if out.request_id == "again" for c in out.outputs
                      if c.finished}  # fmt: skip
    assert again_by_index == by_index


def test_logprobs_are_reported_per_token(engine):
    engine.add_request("lp", PROMPT, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True))
    completion = drain(engine)[-1].outputs[0]
    assert len(completion.logprobs) == 6
    for token, lp in zip(completion.token_ids, completion.logprobs, strict=True):
        assert lp.token_id == token and len(lp.top) == 3
        assert lp.top[0][0] == token and lp.logprob == pytest.approx(lp.top[0][1])  # greedy picks the top one
        assert lp.logprob <= 0.0


def test_request_validation(engine):
    with pytest.raises(AdapterNotLoaded):
        engine.add_request("x", PROMPT, adapter="nope")
    with pytest.raises(PromptTooLong):
        engine.add_request("y", list(range(4, 260)) * 2)
    engine.add_request("z", PROMPT)
    with pytest.raises(DuplicateRequest):
        engine.add_request("z", PROMPT)


def test_adapters_in_use_cannot_be_unloaded(model_dir, tmp_path):
    adapter_dir = save_adapter(tmp_path / "ad", model_dir, seed=3, r=4, lora_alpha=8, target_modules=["q_proj"])
    llm = LLM(model_dir, pool_bytes=2 << 20)
    free_before = llm.engine.pool_stats().free_pages
    llm.load_adapter("ad", adapter_dir)
    llm.engine.add_request("r", PROMPT, SamplingParams(max_tokens=4), adapter="ad")
    with pytest.raises(AdapterInUse):
        llm.unload_adapter("ad")
    drain(llm.engine)
    llm.unload_adapter("ad")
    assert llm.engine.pool_stats().free_pages == free_before


def test_an_aborted_request_frees_its_pages_at_once_and_reports_next_step(engine):
    free = engine.pool_stats().available_pages  # free, or cached KV (evictable)
    engine.add_request("gone", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.pool_stats().available_pages < free
    engine.abort_request("gone")
    assert engine.pool_stats().available_pages == free and engine.has_unfinished_requests()
    (out,) = engine.step()
    assert out.request_id == "gone" and out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_kernels_are_chosen_once_when_the_engine_is_built(model_dir, monkeypatch):
    monkeypatch.setenv("LORAPLEX_KERNELS", "torch")
    engine = LLMEngine(EngineConfig(model=str(model_dir), pool_bytes=2 << 20, max_model_len=512))
    kernels = engine.runner.model.kernels
    assert kernels.name == "torch"
    monkeypatch.setenv("LORAPLEX_KERNELS", "no-such-kernels")  # read at build only: the engine keeps serving
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert drain(engine)[-1].outputs[0].num_tokens == 5
    assert engine.runner.model.kernels is kernels
    with pytest.raises(ConfigError, match="LORAPLEX_KERNELS must be one of auto, torch, triton"):
        LLMEngine(EngineConfig(model=str(model_dir), pool_bytes=2 << 20, max_model_len=512))


def test_steps_reuse_their_input_buffers_and_shorter_steps_see_no_stale_data(model_dir, tmp_path, monkeypatch):
    adapter_dir = save_adapter(
        tmp_path / "ad", model_dir, seed=5, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    # A long prefill first, then decode steps of three, then two sequences (one finishes early).
    requests = {
        "long": ("a much longer prompt than the others, " * 4, "ad", 10),
        "short": ("hi", None, 3),
        "mid": (PROMPT, "ad", 10),
    }
    storages: list[dict[str, int]] = []
    step_tokens: list[int] = []

    def spy(prepare):
        def prepare_and_record(batch, pad_to=None):
            inputs = prepare(batch, pad_to)
            tensors = {
                "input_ids": inputs.input_ids,
                "positions": inputs.positions,
                "write_pages": inputs.attention.write_pages,
                "segment_starts": inputs.segments.starts,
                "segment_slots": inputs.segments.slots,
                "logit_rows": inputs.logit_rows,
                "decode_context_lens": inputs.attention.decode_context_lens,
            }
            storages.append({k: t.untyped_storage().data_ptr() for k, t in tensors.items() if t is not None})
            step_tokens.append(inputs.input_ids.numel())
            return inputs

        return prepare_and_record

    def run(names: list[str], record: bool = False) -> dict[str, list[int]]:
        llm = LLM(model_dir, pool_bytes=2 << 20, max_model_len=512)
        llm.load_adapter("ad", adapter_dir)
        if record:
            monkeypatch.setattr(llm.engine.runner, "prepare", spy(llm.engine.runner.prepare))
        for name in names:
            prompt, adapter, max_tokens = requests[name]
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            llm.engine.add_request(name, prompt, params, adapter=adapter)
        return {out.request_id: out.outputs[0].token_ids for out in drain(llm.engine) if out.finished}

    together = run(list(requests), record=True)
    assert step_tokens[0] > 100 and step_tokens[1:4] == [3, 3, 2]
    for key in storages[-1]:
        assert len({s[key] for s in storages if key in s}) == 1, key  # one storage per input, every step
    # Every request gives the tokens it gives alone in a fresh engine, whatever ran in the buffers before.
    for name in requests:
        assert together[name] == run([name])[name], name

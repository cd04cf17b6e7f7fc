"""Offline generation: load a model, load PEFT adapters, generate for a list of requests."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from core.adapter_format import inspect_adapter, load_adapter_weights
from server.engine.config import EngineConfig
from server.engine.llm_engine import LLMEngine
from server.engine.outputs import CompletionOutput, RequestOutput
from server.engine.sampling_params import SamplingParams

Request = tuple[str | list[int], str | None, SamplingParams]


class LLM:
    """``LLM(model_dir, pool_bytes=...)``; keyword arguments are :class:`EngineConfig` fields."""

    def __init__(self, model_path: str | Path, **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model_path), **engine_kwargs))
        self._counter = 0

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (also done when the engine is collected)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def load_adapter(self, name: str, peft_dir: str | Path) -> int:
        """Validate a PEFT directory against the base model and place it in the pool; returns its slot."""
        spec = inspect_adapter(peft_dir, self.engine.model_config.base_shapes(), self.engine.config.max_lora_rank)
        return self.engine.load_adapter(name, load_adapter_weights(spec))

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def generate(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """Run every request to completion; outputs in request order, each with all ``n`` completions."""
        ids = []
        for prompt, adapter, params in requests:
            request_id = f"offline-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, prompt, params, adapter)
            ids.append(request_id)
        finals: dict[str, RequestOutput] = {}
        completions: dict[str, dict[int, CompletionOutput]] = {r: {} for r in ids}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                for completion in out.outputs:
                    if completion.finished:
                        completions[out.request_id][completion.index] = completion
                if out.finished:
                    finals[out.request_id] = out
        for request_id, out in finals.items():
            out.outputs = [completions[request_id][i] for i in sorted(completions[request_id])]
        return [finals[r] for r in ids]

"""Sequences, scheduler, sampler, model runner and the engine a server drives."""

from server.engine.config import EngineConfig
from server.engine.llm_engine import LLMEngine
from server.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from server.engine.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "TokenLogprob"]

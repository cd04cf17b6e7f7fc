"""The one engine configuration object, validated on construction and passed down as plain values."""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import ConfigError
from server.engine.step_costs import DEFAULT_MIN_STRETCH, DEFAULT_STRETCH

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_CPU_POOL_BYTES = 1 << 30


@dataclass
class EngineConfig:
    """How to run one base model: where, in what precision, and within which limits."""

    model: str
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # auto: cuda when available
    pool_bytes: int | None = None  # arena size; None: gpu_memory_fraction of free GPU memory, or 1 GiB on CPU
    gpu_memory_fraction: float = 0.9
    max_model_len: int | None = None  # None: the model's max_position_embeddings (LongRoPE: the original one)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # While any sequence decodes, a step computes at most this many tokens: decodes first, prefill chunks get the
    # rest (at least a page). Keeps inter-token latency steady under long prompts; None: max_num_batched_tokens.
    step_tokens_while_decoding: int | None = 256
    # Within that cap, a step carrying prompt chunks beside decodes may take at most this many times a decode-only
    # step, by step costs measured online (server.engine.step_costs); 0: no time bound, only the cap.
    step_stretch: float = DEFAULT_STRETCH
    # ... and only as much above this as clearing the prompt backlog in a few steps needs (at most step_stretch).
    step_stretch_min: float = DEFAULT_MIN_STRETCH
    enable_prefix_caching: bool = True  # reuse full KV pages of equal prefixes under the same adapter
    fair_scheduling: bool = True  # admit by priority class, then weighted fair share of tokens per tenant; off: FCFS
    max_adapters: int = 32  # adapter slots resident at once
    max_adapters_per_batch: int | None = None  # distinct adapters running at once; None: max_adapters
    adapter_turn_steps: int = 64  # steps an adapter keeps admitting while another waits for the per-batch cap
    max_lora_rank: int = 64
    block_size: int = 16
    watermark: float = 0.01  # fraction of pages new prefills leave free, so decodes rarely need preemption
    num_threads: int | None = None  # CPU threads for torch; None leaves torch's default
    # On CUDA, decode steps replay CUDA graphs captured at start (server.engine.cuda_graphs); True: always eager.
    enforce_eager: bool = False
    # Ranks the model is split over (server.parallel): one process and device each, rank 0 the engine's own.
    tensor_parallel_size: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("EngineConfig.model must name a model directory")
        if self.dtype not in DTYPES:
            raise ConfigError(f"EngineConfig.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"EngineConfig.device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.pool_bytes is not None and self.pool_bytes <= 0:
            raise ConfigError("EngineConfig.pool_bytes must be > 0")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ConfigError("EngineConfig.gpu_memory_fraction must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("EngineConfig.max_model_len must be >= 2")
        if self.max_adapters_per_batch is not None and self.max_adapters_per_batch < 1:
            raise ConfigError("EngineConfig.max_adapters_per_batch must be >= 1")
        if self.step_tokens_while_decoding is not None and self.step_tokens_while_decoding < 1:
            raise ConfigError("EngineConfig.step_tokens_while_decoding must be >= 1")
        if self.step_stretch != 0 and not self.step_stretch > 1.0:
            raise ConfigError("EngineConfig.step_stretch must be above 1 (or 0: no time bound)")
        if not self.step_stretch_min > 1.0:
            raise ConfigError("EngineConfig.step_stretch_min must be above 1")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_adapters",
            "max_lora_rank",
            "block_size",
            "adapter_turn_steps",
            "tensor_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"EngineConfig.{name} must be >= 1")
        if self.block_size != 16:
            raise ConfigError("EngineConfig.block_size must be 16 (the kernels' page layout)")
        if not 0.0 <= self.watermark < 0.5:
            raise ConfigError("EngineConfig.watermark must be in [0, 0.5)")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("EngineConfig.num_threads must be >= 1")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ConfigError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len so every prompt fits a step"
            )

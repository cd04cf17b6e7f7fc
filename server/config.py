"""How one inference server runs: the CLI flags, validated once and passed down as plain values."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import ConfigError
from core.protocol import HEARTBEAT_S
from server.engine import EngineConfig
from server.engine.step_costs import DEFAULT_MIN_STRETCH, DEFAULT_STRETCH

DEFAULT_HOST_CACHE_BYTES = 4 << 30


def random_replica_id() -> str:
    return "replica-" + secrets.token_hex(6)


@dataclass
class ServerConfig:
    """One base model served over HTTP with adapters in three tiers."""

    model: Path  # a local directory (`loraplex server` resolves hub ids with core.model_source first)
    served_model_name: str | None = None  # the CLI sets it; None: the model directory's name
    host: str = "127.0.0.1"
    port: int = 8001
    pool_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # per engine step; smaller keeps decodes flowing while prompts prefill
    step_tokens_while_decoding: int | None = 256  # per step while anything decodes; None: max_num_batched_tokens
    step_stretch: float = DEFAULT_STRETCH  # a step with prompt chunks: at most this x a decode-only one; 0: off
    step_stretch_min: float = DEFAULT_MIN_STRETCH  # ... and this while the prompt backlog clears in a few steps
    max_lora_rank: int = 64
    max_resident_adapters: int = 32
    max_adapters_per_batch: int | None = None  # None: as many as are resident
    adapter_turn_steps: int = 64  # steps a running adapter keeps starting requests while another waits for a seat
    enable_prefix_caching: bool = True  # reuse KV pages of equal prefixes under the same adapter
    fair_scheduling: bool = True  # tenants share the engine by weight; False: first come, first served
    max_waiting: int = 256
    max_n: int = 16
    adapter_root: Path | None = None
    adapter_idle_ttl: float = 300.0  # seconds unused before an adapter leaves the pool
    host_idle_ttl: float = 3600.0  # ... and before it leaves host RAM (scale to zero)
    host_cache_bytes: int = DEFAULT_HOST_CACHE_BYTES
    load_workers: int = 2
    advertise_url: str | None = None  # default: http://host:port
    replica_id: str = field(default_factory=random_replica_id)
    internal_token: str | None = None
    redis_url: str | None = None
    heartbeat_s: float = HEARTBEAT_S
    device: str = "auto"
    dtype: str = "auto"
    num_threads: int | None = None
    enforce_eager: bool = False  # on CUDA, never replay decode steps from captured graphs
    tensor_parallel_size: int = 1  # ranks (processes, devices) the model is split over; rank 0 is the engine's
    seed: int = 0
    # The engine in a process of its own, so the HTTP thread never holds the GIL a step needs; False: a thread
    # of the HTTP process (what in-process tests use to reach the engine's object store).
    engine_process: bool = True

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        if not (self.model / "config.json").is_file():
            raise ConfigError(f"--model {self.model} has no config.json; point it at a Hugging Face model directory")
        if self.adapter_root is not None:
            self.adapter_root = Path(self.adapter_root)
            if not self.adapter_root.is_dir():
                raise ConfigError(f"--adapter-root {self.adapter_root} is not a directory")
        positive = (
            "max_resident_adapters",
            "max_waiting",
            "max_n",
            "load_workers",
            "max_lora_rank",
            "host_cache_bytes",
            "adapter_turn_steps",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_adapters_per_batch is not None and self.max_adapters_per_batch < 1:
            raise ConfigError("--max-adapters-per-batch must be >= 1")
        if self.step_tokens_while_decoding is not None and self.step_tokens_while_decoding < 1:
            raise ConfigError("--step-tokens-while-decoding must be >= 1")
        if self.step_stretch != 0 and not self.step_stretch > 1.0:
            raise ConfigError("--step-stretch must be above 1 (or 0: no time bound)")
        if not self.step_stretch_min > 1.0:
            raise ConfigError("--step-stretch-min must be above 1")
        if self.adapter_idle_ttl <= 0 or self.host_idle_ttl <= 0:
            raise ConfigError("--adapter-idle-ttl and --host-idle-ttl must be > 0 seconds")
        if self.host_idle_ttl < self.adapter_idle_ttl:
            raise ConfigError(
                "--host-idle-ttl must be at least --adapter-idle-ttl (host RAM is the slower tier to leave)"
            )
        if not self.replica_id:
            raise ConfigError("--replica-id must not be empty")

    @property
    def base_name(self) -> str:
        return self.served_model_name or self.model.name

    @property
    def url(self) -> str:
        """Where the control plane reaches this server."""
        return self.advertise_url or f"http://{self.host}:{self.port}"

    @property
    def adapters_per_batch(self) -> int:
        return min(self.max_adapters_per_batch or self.max_resident_adapters, self.max_resident_adapters)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=str(self.model),
            dtype=self.dtype,
            device=self.device,
            pool_bytes=self.pool_bytes,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            step_tokens_while_decoding=self.step_tokens_while_decoding,
            step_stretch=self.step_stretch,
            step_stretch_min=self.step_stretch_min,
            max_adapters=self.max_resident_adapters,
            max_adapters_per_batch=self.adapters_per_batch,
            adapter_turn_steps=self.adapter_turn_steps,
            enable_prefix_caching=self.enable_prefix_caching,
            fair_scheduling=self.fair_scheduling,
            max_lora_rank=self.max_lora_rank,
            num_threads=self.num_threads,
            enforce_eager=self.enforce_eager,
            tensor_parallel_size=self.tensor_parallel_size,
            seed=self.seed,
        )

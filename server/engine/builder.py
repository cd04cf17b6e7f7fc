"""Assemble an engine's parts from its config: device, weights, pool, adapter tables, scheduler, runner."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.errors import ConfigError
from core.projections import NUM_PROJECTIONS
from loraplex_kernels import KernelBackend, KVGeometry, LoraTables, kv_cache_views, select_backend
from server.engine.adapter_turns import AdapterTurns
from server.engine.config import DEFAULT_CPU_POOL_BYTES, EngineConfig
from server.engine.cuda_graphs import MAX_GRAPH_BATCH, MAX_GRAPH_CONTEXT, capture_decode_graphs
from server.engine.host_memory import reuse_freed_host_memory
from server.engine.model_runner import ModelRunner
from server.engine.resident_adapters import ResidentAdapters
from server.engine.sampler import Sampler
from server.engine.scheduler import Scheduler
from server.engine.step_buffers import StepBuffers
from server.engine.step_costs import StepCosts
from server.memory.adapter_pages import AdapterPages, row_alignment
from server.memory.block_manager import BlockManager, blocks_for
from server.memory.pool import PagePool
from server.model.config import ModelConfig
from server.model.llama import LlamaModel, LoraBinding
from server.model.weights import ModelWeights, load_weights
from server.parallel.adapter_pages import ShardedAdapterPages
from server.parallel.followers import Followers
from server.parallel.group import TensorParallel
from server.parallel.shards import Shard

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineParts:
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    pool: PagePool
    adapters: ResidentAdapters
    scheduler: Scheduler
    runner: ModelRunner
    followers: Followers | None = None  # rank 0 under tensor parallelism: the other ranks' processes


def resolve_device(config: EngineConfig, rank: int = 0) -> tuple[torch.device, torch.dtype]:
    """``auto`` means CUDA with bf16 when a GPU is present, else CPU with fp32. Tensor-parallel rank ``rank`` takes
    GPU ``rank`` (and makes it the current one)."""
    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("EngineConfig.device is 'cuda' but no GPU is visible")
    visible = torch.cuda.device_count()
    if name == "cuda" and config.tensor_parallel_size > visible:
        raise ConfigError(f"tensor_parallel_size {config.tensor_parallel_size} needs as many GPUs; {visible} visible")
    device = torch.device(name, rank) if name == "cuda" else torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if config.dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, DTYPES[config.dtype]


def pool_pages(
    config: EngineConfig, geometry: KVGeometry, dtype: torch.dtype, device: torch.device, model_config: ModelConfig
) -> int:
    """Pages in the arena: from ``pool_bytes``, else a fraction of free GPU memory minus activations."""
    if config.pool_bytes is not None:
        budget = config.pool_bytes
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        c = model_config
        per_token = 4 * c.hidden_size + 3 * c.intermediate_size + c.q_size + 2 * c.kv_size + c.vocab_size
        activations = 4 * config.max_num_batched_tokens * per_token * torch.empty((), dtype=dtype).element_size()
        budget = int(free * config.gpu_memory_fraction) - activations
    else:
        budget = DEFAULT_CPU_POOL_BYTES
    pages = PagePool.pages_for_bytes(max(budget, 0), geometry, dtype)
    if pages < 1:
        raise ConfigError(f"the pool budget ({budget} bytes) holds no page; raise pool_bytes")
    return pages


def choose_kernels(device: torch.device, dtype: torch.dtype) -> KernelBackend:
    """The engine's kernel backend, chosen once from the device, dtype and ``LORAPLEX_KERNELS``."""
    try:
        return select_backend(device, dtype)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def use_graphs(config: EngineConfig, device: torch.device, kernels: KernelBackend) -> bool:
    """Whether decode steps replay CUDA graphs: on CUDA, with the Triton kernels, unless ``enforce_eager``."""
    if device.type != "cuda" or config.enforce_eager:
        return False
    if config.tensor_parallel_size > 1:
        log.info("decode CUDA graphs are off under tensor parallelism: its all-reduces have not been captured yet")
        return False
    if kernels.name != "triton":
        # The torch backend reads each step's segments on the host, which a graph cannot replay.
        log.info("decode CUDA graphs are off: the %s kernels read segments on the host", kernels.name)
        return False
    return True


def load_tokenizer(model_dir: str) -> Any:
    """The model directory's Hugging Face tokenizer, or None when it ships none (token-id prompts only)."""
    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def build_engine_parts(config: EngineConfig, tp: TensorParallel | None = None) -> EngineParts:
    """An engine's parts; with ``config.tensor_parallel_size`` > 1, rank 0's, after it started the other ranks
    (which call this with their ``tp``). ``model_config`` is the whole model's; the model, the pool and the adapter
    pages hold this rank's slice (:mod:`server.parallel.shards`)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)  # process-wide in torch
    device, dtype = resolve_device(config, 0 if tp is None else tp.rank)
    kernels = choose_kernels(device, dtype)
    if device.type == "cpu":
        reuse_freed_host_memory()  # process-wide, like the thread count: activations live in host memory
    model_config = ModelConfig.from_dir(config.model)
    # Every rank's slice has the same shape; working it out first refuses sizes the ranks cannot split, before spawning.
    rank_config = Shard(0, config.tensor_parallel_size).config(model_config)
    followers = None
    if tp is None and config.tensor_parallel_size > 1:
        followers = Followers.start(config, device)  # they load their slices while we load ours
        tp = followers.tp
    shard = Shard() if tp is None else tp.shard
    max_model_len = config.max_model_len or model_config.default_max_model_len
    weights: ModelWeights = load_weights(config.model, model_config, dtype, device, shard)
    geometry = KVGeometry(rank_config.num_layers, rank_config.num_kv_heads, rank_config.head_dim, config.block_size)
    pool = PagePool(geometry, pool_pages(config, geometry, dtype, device, rank_config), dtype, device)
    shapes = rank_config.base_shapes()
    row_align = row_alignment(shapes, geometry.page_elems)
    tables = LoraTables.empty(
        config.max_adapters,
        model_config.num_layers,
        config.max_lora_rank,
        device,
        row_align,
        num_projections=NUM_PROJECTIONS,
    )
    if followers is None:
        pages = AdapterPages(pool, tables, shapes)
    else:
        pages = ShardedAdapterPages(pool, tables, shapes, model_config.base_shapes(), followers)
    adapters = ResidentAdapters(pages)
    kv_caches = [kv_cache_views(pool.arena, geometry, layer) for layer in range(model_config.num_layers)]
    lora = LoraBinding.create(pool.arena, tables, rank_config)
    model = LlamaModel(rank_config, weights, kv_caches, lora, max_model_len, kernels, tp)
    block_manager = BlockManager(
        pool,
        config.block_size,
        watermark_pages=int(config.watermark * pool.num_pages),
        enable_prefix_caching=config.enable_prefix_caching,
    )
    scheduler = Scheduler(
        block_manager,
        config.max_num_batched_tokens,
        config.max_num_seqs,
        config.enable_chunked_prefill,
        AdapterTurns(config.max_adapters_per_batch or config.max_adapters, config.adapter_turn_steps),
        fcfs=not config.fair_scheduling,
        step_tokens_while_decoding=config.step_tokens_while_decoding,
        costs=StepCosts(config.step_stretch, config.step_stretch_min) if config.step_stretch else None,
    )
    buffers = StepBuffers(
        config.max_num_batched_tokens, config.max_num_seqs, blocks_for(max_model_len, config.block_size), device
    )
    runner = ModelRunner(model, Sampler(config.seed), adapters.slot_max_rank, config.block_size, device, buffers)
    runner.followers = followers
    if tp is not None:
        tp.barrier()  # every rank built: a rank that failed to (and exited) fails rank 0's start here, not a request
    if use_graphs(config, device, kernels):
        runner.graphs = capture_decode_graphs(
            model,
            buffers,
            pool,
            max_batch=min(config.max_num_seqs, config.max_num_batched_tokens, MAX_GRAPH_BATCH),
            lora_rank=config.max_lora_rank,
            max_blocks=blocks_for(min(max_model_len, MAX_GRAPH_CONTEXT), config.block_size),
        )
    follower = tp is not None and tp.rank > 0
    tokenizer = None if follower else load_tokenizer(config.model)  # a follower never sees text
    eos = set(model_config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    log.info(
        "engine: %s on %s/%s with %s kernels, %d pool pages of %d KiB, max_model_len %d",
        model_config.model_type,
        device,
        dtype,
        kernels.name,
        pool.num_pages,
        pool.stats().page_bytes // 1024,
        max_model_len,
    )
    return EngineParts(
        model_config,
        device,
        dtype,
        max_model_len,
        tokenizer,
        tuple(sorted(eos)),
        pool,
        adapters,
        scheduler,
        runner,
        followers,
    )

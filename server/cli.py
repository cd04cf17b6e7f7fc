"""``loraplex server``: one inference server process for one base model (one per GPU)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from core.protocol import HEARTBEAT_S
from core.thread_options import ServerThreads


def register(app: typer.Typer) -> None:
    """Add ``loraplex server`` to the CLI."""

    # Defaults are literals: importing the configs would load torch for every `loraplex` command.
    # tests/unit/server/test_cli_defaults.py holds them to ServerConfig's.
    @app.command("server")
    def server_cmd(
        model: Annotated[
            str,
            typer.Option(help="Llama-family model: a directory or a Hugging Face hub id org/name[@revision]."),
        ],
        host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port to listen on.")] = 8001,
        served_model_name: Annotated[
            str | None,
            typer.Option(
                help="Name clients use for the base model (default: LORAPLEX_BASE_MODEL_NAME, else the hub id "
                "without revision or the directory name)."
            ),
        ] = None,
        pool_bytes: Annotated[
            int | None,
            typer.Option(help="Bytes of the unified KV/adapter pool (default: 90% of free GPU memory, 1 GiB on CPU)."),
        ] = None,
        max_model_len: Annotated[int | None, typer.Option(help="Context length (default: the model's).")] = None,
        max_num_batched_tokens: Annotated[
            int,
            typer.Option(help="Tokens per engine step; long prompts prefill in chunks of this (lower: steadier ITL)."),
        ] = 2048,
        step_tokens_while_decoding: Annotated[
            int,
            typer.Option(
                help="Tokens per engine step while any request decodes: decodes first, prompt chunks get the rest "
                "(lower: steadier inter-token latency and first tokens under load; higher: faster prefill)."
            ),
        ] = 256,
        step_stretch: Annotated[
            float,
            typer.Option(
                help="A step carrying prompt chunks beside decodes takes at most this many times a decode-only step "
                "(measured as the server runs), within --step-tokens-while-decoding, when prompts back up. Lower: "
                "steadier inter-token latency; higher: faster prefill. 0: no time bound, only the token cap."
            ),
        ] = 3.0,
        step_stretch_min: Annotated[
            float,
            typer.Option(
                help="The stretch while the prompts waiting would clear within a few steps anyway (a streaming or chat "
                "load); it rises towards --step-stretch as prompts back up."
            ),
        ] = 1.5,
        max_lora_rank: Annotated[
            int | None, typer.Option(help="Largest adapter rank (default: LORAPLEX_MAX_LORA_RANK).")
        ] = None,
        adapter_root: Annotated[
            Path | None, typer.Option(help="Directory local adapters may be loaded from (none: descriptors only).")
        ] = None,
        adapter_idle_ttl: Annotated[
            float, typer.Option(help="Seconds unused before an adapter leaves the pool.")
        ] = 300.0,
        host_idle_ttl: Annotated[
            float, typer.Option(help="Seconds unused before an adapter leaves host RAM.")
        ] = 3600.0,
        host_cache_bytes: Annotated[int, typer.Option(help="Host-RAM budget for cached adapters.")] = 4 << 30,
        max_resident_adapters: Annotated[int, typer.Option(help="Adapters in the pool at once.")] = 32,
        max_adapters_per_batch: Annotated[
            int | None, typer.Option(help="Distinct adapters in the running batch (default: max resident).")
        ] = None,
        adapter_turn_steps: Annotated[
            int,
            typer.Option(help="Engine steps a running adapter keeps starting requests while another waits for a seat."),
        ] = 64,
        prefix_caching: Annotated[
            bool,
            typer.Option(
                "--prefix-caching/--no-prefix-caching",
                help="Reuse the KV pages of prompt prefixes seen before under the same adapter.",
            ),
        ] = True,
        fair_scheduling: Annotated[
            bool,
            typer.Option(
                "--fair-scheduling/--fcfs",
                help="Start queued requests by priority class, then by each tenant's weighted share of computed "
                "tokens (--fcfs: in arrival order).",
            ),
        ] = True,
        engine_process: Annotated[
            bool,
            typer.Option(
                "--engine-process/--engine-thread",
                help="Run the engine in a process of its own, so HTTP work never holds the interpreter a step needs "
                "(--engine-thread: a thread of the HTTP process).",
            ),
        ] = True,
        max_waiting: Annotated[int, typer.Option(help="Queued requests before answering 429.")] = 256,
        max_n: Annotated[int, typer.Option(help="Largest n (completions per request).")] = 16,
        advertise_url: Annotated[
            str | None, typer.Option(help="URL the control plane reaches this server at (default: http://host:port).")
        ] = None,
        replica_id: Annotated[str | None, typer.Option(help="Replica id in Redis (default: random).")] = None,
        heartbeat_s: Annotated[float, typer.Option(help="Seconds between heartbeats to Redis.")] = HEARTBEAT_S,
        device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
        dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
        enforce_eager: Annotated[
            bool,
            typer.Option(
                "--enforce-eager",
                help="On CUDA, run every decode step eagerly instead of replaying CUDA graphs captured at start.",
            ),
        ] = False,
        tensor_parallel_size: Annotated[
            int,
            typer.Option(
                "--tensor-parallel-size",
                help="Split the model over this many ranks (one process and device each; gloo on CPU, NCCL on CUDA).",
            ),
        ] = 1,
        threads: ServerThreads = None,
    ) -> None:
        """Serve a base model and its LoRA adapters over an OpenAI-compatible API (object store, token and
        Redis from LORAPLEX_*)."""

        from rich.markup import escape

        from core.cli import console, settings_or_exit
        from core.errors import ConfigError
        from core.http_server import http_server
        from core.model_source import default_model_name, resolve_model_dir
        from core.settings import LOG_FORMAT
        from core.storage import open_store
        from server.config import ServerConfig, random_replica_id
        from server.http import EngineStopped, create_app

        settings = settings_or_exit()
        logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
        try:
            config = ServerConfig(
                model=resolve_model_dir(model, setting="--model"),
                served_model_name=served_model_name or settings.base_model_name or default_model_name(model),
                host=host,
                port=port,
                pool_bytes=pool_bytes,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
                step_tokens_while_decoding=step_tokens_while_decoding,
                step_stretch=step_stretch,
                step_stretch_min=step_stretch_min,
                max_lora_rank=max_lora_rank or settings.max_lora_rank,
                max_resident_adapters=max_resident_adapters,
                max_adapters_per_batch=max_adapters_per_batch,
                adapter_turn_steps=adapter_turn_steps,
                enable_prefix_caching=prefix_caching,
                fair_scheduling=fair_scheduling,
                engine_process=engine_process,
                max_waiting=max_waiting,
                max_n=max_n,
                adapter_root=adapter_root,
                adapter_idle_ttl=adapter_idle_ttl,
                host_idle_ttl=host_idle_ttl,
                host_cache_bytes=host_cache_bytes,
                advertise_url=advertise_url,
                replica_id=replica_id or random_replica_id(),
                internal_token=settings.internal_token.get_secret_value() if settings.internal_token else None,
                redis_url=settings.redis_url,
                heartbeat_s=heartbeat_s,
                device=device,
                dtype=dtype,
                enforce_eager=enforce_eager,
                tensor_parallel_size=tensor_parallel_size,
                num_threads=threads,
            )
        except ConfigError as exc:
            console.print(f"[red]error:[/red] {escape(exc.message)}")
            raise typer.Exit(2) from None
        failures: list[Exception] = []

        def engine_failed(exc: Exception) -> None:
            failures.append(exc)
            server.should_exit = True  # uvicorn's loop checks it a few times a second

        app_ = create_app(config, store=open_store(settings), on_engine_failure=engine_failed)
        server = http_server(app_, settings, host=host, port=port, graceful_shutdown_s=10)
        server.run()
        if failures:
            # Exit so a supervisor (`loraplex up`, systemd, Kubernetes) learns why; 2: fix the configuration.
            exc = failures[0]
            said = "stopped" if isinstance(exc, EngineStopped) else "failed to start"
            console.print(f"[red]error:[/red] the engine {said}: {escape(_describe(exc))}")
            raise typer.Exit(2 if isinstance(exc, ConfigError) else 1)
        if not server.started:
            raise typer.Exit(3)  # uvicorn could not start (e.g. the port is taken); it logged why


def _describe(exc: Exception) -> str:
    from core.errors import LoraplexError

    return exc.message if isinstance(exc, LoraplexError) else f"{type(exc).__name__}: {exc}"

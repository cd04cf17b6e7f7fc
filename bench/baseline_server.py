"""The serving benchmark's peer: an OpenAI-style ``/v1/completions`` over transformers + PEFT, one batch per adapter.

Every adapter under ``--adapter-root`` is loaded into one ``PeftModel`` at start-up (so it has no cold
starts); ``model`` names an adapter directory, or the base model. Streams SSE like our server
(``stream_options.include_usage``, ``return_token_ids``, ``ignore_eos``), greedy decoding only.
Run: ``python bench/baseline_server.py --model DIR --adapter-root DIR --port N``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # spinning OpenMP threads cost more than they bring on shared cores

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` importable

from bench.baseline_batcher import FINISHED, AdapterBatcher, PendingRequest
from bench.common import load_peft


class BadRequest(Exception):
    """A request this server answers with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": "invalid_request_error", "param": self.param, "code": None}
        return JSONResponse({"error": error}, status_code=self.status)


def adapter_dirs(root: Path) -> list[Path]:
    """PEFT adapter directories directly under ``root``, by name."""
    return sorted(p for p in root.iterdir() if (p / "adapter_config.json").is_file())


class Completions:
    """Turns request bodies into queued requests and their tokens into OpenAI responses."""

    def __init__(self, base_name: str, adapters: set[str], tokenizer: Any, batcher: AdapterBatcher) -> None:
        self.base_name = base_name
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.batcher = batcher

    def queue(self, body: dict) -> PendingRequest:
        """Validate ``body`` and queue its request."""
        model = body.get("model")
        if model != self.base_name and model not in self.adapters:
            raise BadRequest(404, f"model {model!r} is neither the base model nor a loaded adapter", "model")
        if (body.get("temperature") or 0) != 0 or body.get("n", 1) != 1:
            raise BadRequest(400, "the baseline serves greedy decoding (temperature 0), n=1 only", "temperature")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest(400, "max_tokens must be a positive integer", "max_tokens")
        request = PendingRequest(
            adapter=None if model == self.base_name else model,
            prompt=self._prompt(body.get("prompt")),
            max_tokens=max_tokens,
            ignore_eos=bool(body.get("ignore_eos", False)),
            loop=asyncio.get_running_loop(),
        )
        self.batcher.submit(request)
        return request

    def _prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str) and prompt:
            return list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise BadRequest(400, "prompt must be a non-empty string or list of token ids", "prompt")

    async def tokens(self, request: PendingRequest) -> AsyncIterator[int]:
        """The request's token ids as they come; cancels it if the consumer stops early."""
        try:
            while (item := await request.tokens.get()) is not FINISHED:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            request.cancelled = True  # a no-op once it finished; frees its batch row if the client left

    async def stream(self, body: dict, request: PendingRequest) -> AsyncIterator[str]:
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body["model"]}  # fmt: skip
        with_ids = bool(body.get("return_token_ids"))
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        count = 0
        try:
            async for token in self.tokens(request):
                count += 1
                choice = {"index": 0, "text": self.tokenizer.decode([token]), "finish_reason": None, "logprobs": None}
                if with_ids:
                    choice["token_ids"] = [token]
                yield _sse({**base, "choices": [choice]})
        except Exception as exc:
            yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
            return
        reason = "length" if count >= request.max_tokens else "stop"
        yield _sse({**base, "choices": [{"index": 0, "text": "", "finish_reason": reason, "logprobs": None}]})
        if usage:
            yield _sse({**base, "choices": [], "usage": _usage(len(request.prompt), count)})
        yield "data: [DONE]\n\n"

    async def whole(self, body: dict, request: PendingRequest) -> dict:
        ids = [token async for token in self.tokens(request)]
        reason = "length" if len(ids) >= request.max_tokens else "stop"
        choice = {"index": 0, "text": self.tokenizer.decode(ids), "finish_reason": reason, "logprobs": None}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        usage = _usage(len(request.prompt), len(ids))
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body["model"], "choices": [choice], "usage": usage}  # fmt: skip


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def create_app(model_dir: Path, adapter_root: Path, base_name: str, max_batch: int) -> FastAPI:
    """The baseline app; the model and every adapter load before it starts listening."""
    from transformers import AutoTokenizer

    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        dirs = adapter_dirs(adapter_root)
        if not dirs:
            raise SystemExit(f"no PEFT adapters under {adapter_root}")
        model = load_peft(model_dir, dirs, [d.name for d in dirs])
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = model.base_model.model.config
        pad = config.pad_token_id if config.pad_token_id is not None else 0
        batcher = AdapterBatcher(model, pad_id=pad, eos_id=config.eos_token_id, max_batch=max_batch)
        batcher.start()
        state["completions"] = Completions(base_name, {d.name for d in dirs}, tokenizer, batcher)
        yield
        batcher.stop()

    app = FastAPI(title="transformers + PEFT baseline", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        service: Completions = state["completions"]
        body = await request.json()
        try:
            pending = service.queue(body)
        except BadRequest as exc:
            return exc.response()
        if body.get("stream"):
            return StreamingResponse(service.stream(body, pending), media_type="text/event-stream")
        return JSONResponse(await service.whole(body, pending))

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--adapter-root", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument("--served-model-name", default=None, help="name of the base model (default: directory name)")
    parser.add_argument("--max-batch", type=int, default=32, help="requests per adapter batch")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    app = create_app(args.model, args.adapter_root, args.served_model_name or args.model.name, args.max_batch)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()

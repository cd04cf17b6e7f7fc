"""The one place errors become HTTP: every failure leaves as ``{"error": {"message", "type", "param", "code"}}``.

Typed errors from ``core.errors`` carry their status; request-validation errors become 400 with
``param`` naming the field; unknown routes and methods keep their 404/405; anything unexpected is a
500 that hides internals. Headers clients act on: ``retry-after`` on 429/503, ``x-should-retry: false``
on 409 (the openai SDK would otherwise retry a conflict).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.errors import Conflict, LoraplexError, RateLimited, ServiceUnavailable, StorageError

log = logging.getLogger(__name__)

DATABASE_RETRY_AFTER = 2.0
_LOCATIONS = {"body", "query", "path", "header", "cookie"}
_TYPE_TAGS = {"int", "float", "str", "bool", "bytes", "list", "dict", "none"}


def error_body(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_headers(exc: LoraplexError) -> dict[str, str]:
    """Headers that tell a client whether and when to retry."""
    if isinstance(exc, RateLimited | ServiceUnavailable):
        return {"retry-after": str(max(1, math.ceil(exc.retry_after)))}
    if isinstance(exc, Conflict):
        return {"x-should-retry": "false"}
    return {}


def loraplex_error_response(exc: LoraplexError) -> JSONResponse:
    """A typed error as its HTTP response."""
    return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=error_headers(exc))


def public_error(exc: LoraplexError) -> LoraplexError:
    """What a client may read of ``exc``: an object-store failure names the operator's endpoint, bucket and
    keys, so clients get the retryable 503 without them (the log keeps the details)."""
    if isinstance(exc, StorageError):
        return ServiceUnavailable(
            "the object store is unavailable; nothing was changed, retry shortly",
            retry_after=exc.retry_after,
            code=exc.code,
        )
    return exc


def unreadable_body_message(cause: BaseException) -> str:
    """Why a request body could not be read as JSON, in words that say what to send instead."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8 (byte {cause.start}); send JSON encoded as UTF-8"
    if isinstance(cause, RecursionError):
        return "the request body is nested too deeply to read; send plain JSON objects and lists"
    return "the request body could not be read as JSON"


def validation_param(loc: Sequence[Any]) -> str | None:
    """``("body", "hyperparameters", "lora_r")`` → ``"hyperparameters.lora_r"``.

    Pydantic adds the tried member of a union to the location (``int``, ``literal['auto']``); those are
    types, not fields, so they are dropped.
    """
    parts = [str(p) for p in loc]
    if parts and parts[0] in _LOCATIONS:
        parts = parts[1:]
    parts = [p for p in parts if p not in _TYPE_TAGS and "[" not in p]
    return ".".join(parts) or None


def _describe(error: dict[str, Any]) -> str:
    kind, msg = error.get("type", ""), str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({error.get('ctx', {}).get('error', msg)})"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "this field is required"
    return msg


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    """Pydantic/FastAPI validation failures as a 400 naming the first bad field (OpenAI answers 400 here)."""
    problems: dict[str | None, list[str]] = {}  # param -> what is wrong with it (union members: each option)
    for error in exc.errors():
        param = None if error.get("type") == "json_invalid" else validation_param(error.get("loc", ()))
        problems.setdefault(param, []).append(_describe(error))
    described = [f"{param}: {' or '.join(texts)}" if param else " or ".join(texts) for param, texts in problems.items()]
    if len(described) > 5:
        described = [*described[:5], f"and {len(described) - 5} more problem(s)"]
    first = next(iter(problems), None)
    body = error_body("; ".join(described) or "invalid request", "invalid_request_error", param=first)
    return JSONResponse(body, status_code=400)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that give every response the OpenAI error shape."""

    @app.exception_handler(LoraplexError)
    async def _typed(_request: Request, exc: LoraplexError) -> JSONResponse:
        if exc.status_code >= 500:
            log.warning("%s: %s", type(exc).__name__, exc.message)
        return loraplex_error_response(public_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"unknown URL ({request.method} {request.url.path}); see /docs for the routes"
            code = "unknown_url"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        elif exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not decode the JSON body
            message, code = unreadable_body_message(exc.__cause__), "invalid_body"
        else:
            message, code = str(exc.detail), None
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = error_body(message, error_type, code=code)
        return JSONResponse(body, status_code=exc.status_code, headers=dict(exc.headers or {}))

    @app.exception_handler(OperationalError)
    async def _database(_request: Request, exc: OperationalError) -> JSONResponse:
        # Locked or unreachable database: the request did not happen and can be retried as is.
        log.warning("database unavailable: %s", exc.orig)
        return loraplex_error_response(
            ServiceUnavailable("the database is busy or unreachable; retry shortly", retry_after=DATABASE_RETRY_AFTER)
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        body = error_body("internal server error; the request was logged", "server_error", code="internal_error")
        return JSONResponse(body, status_code=500)

"""Every failure leaves the server as ``{"error": {"message", "type", "param", "code"}}``, with retry headers.

``retry-after`` on 429/503 and ``x-should-retry: false`` on 409 are what the openai SDK acts on.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.errors import Conflict, LoraplexError, RateLimited, ServiceUnavailable

log = logging.getLogger(__name__)


def error_body(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: LoraplexError) -> JSONResponse:
    headers: dict[str, str] = {}
    if isinstance(exc, RateLimited | ServiceUnavailable):
        headers["retry-after"] = str(max(1, math.ceil(exc.retry_after)))
    elif isinstance(exc, Conflict):
        headers["x-should-retry"] = "false"
    return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=headers)


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc[1:] if not isinstance(p, int)] if loc and loc[0] == "body" else [str(p) for p in loc]
    return ".".join(parts) or None


def validation_response(exc: RequestValidationError) -> JSONResponse:
    """The first problem of a body that failed validation, as a 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return JSONResponse(error_body("invalid request", "invalid_request_error"), status_code=400)
    first = errors[0]
    if first.get("type") == "json_invalid":
        return JSONResponse(error_body("the request body is not valid JSON", "invalid_request_error"), status_code=400)
    param = _param(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = "this field is required"
    elif first.get("type") == "extra_forbidden":
        message = "unknown field: this server does not support it, so it was refused rather than ignored; remove it"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    text = f"{param}: {message}{more}" if param else message + more
    return JSONResponse(error_body(text, "invalid_request_error", param=param), status_code=400)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LoraplexError)
    async def _typed(_request: Request, exc: LoraplexError) -> JSONResponse:
        if exc.status_code >= 500 and exc.code != "loading":
            log.warning("%s: %s", type(exc).__name__, exc.message)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "unknown_url", 405: "method_not_allowed"}
        message = f"{request.method} {request.url.path}: {exc.detail}"
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = error_body(message, error_type, code=codes.get(exc.status_code))
        return JSONResponse(body, status_code=exc.status_code, headers=dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        body = error_body("internal server error; see the server log", "server_error", code="internal_error")
        return JSONResponse(body, status_code=500)

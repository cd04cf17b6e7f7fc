"""Typed errors shared by every component. The API maps them to HTTP once (status + OpenAI error shape).

Each error says what went wrong and what to do next; ``param`` names the offending field when there is
one, ``code`` is a stable machine-readable string.
"""

from __future__ import annotations


class LoraplexError(Exception):
    """Base of every error we raise on purpose."""

    status_code: int = 500
    error_type: str = "server_error"
    default_code: str = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param

    def __reduce__(self) -> tuple:
        # Errors cross from the engine process to the HTTP one: keep every attribute (retry_after, code,
        # param), which the default (``cls(*args)``) would drop or fail on for keyword-only fields.
        return _rebuild_error, (type(self), self.args, self.__dict__.copy())

    def to_dict(self) -> dict:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def _rebuild_error(cls: type[LoraplexError], args: tuple, state: dict) -> LoraplexError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class ConfigError(LoraplexError):
    """A setting is missing or invalid; the message names the ``LORAPLEX_*`` variable."""

    default_code = "invalid_config"


class InvalidRequest(LoraplexError):
    status_code = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"


class AuthenticationFailed(LoraplexError):
    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDenied(LoraplexError):
    status_code = 403
    error_type = "permission_error"
    default_code = "permission_denied"


class NotFound(LoraplexError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class Conflict(LoraplexError):
    """The resource is in a state that forbids the action; retrying the same request will not help."""

    status_code = 409
    error_type = "invalid_request_error"
    default_code = "conflict"


class PayloadTooLarge(LoraplexError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "payload_too_large"


class RateLimited(LoraplexError):
    status_code = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class ClientGone(LoraplexError):
    """The client disconnected; its request was dropped (nginx's 499: nobody reads the answer)."""

    status_code = 499
    default_code = "client_closed_request"


class ServiceUnavailable(LoraplexError):
    """A dependency (database, Redis, object store, inference server) is down; retry later."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "service_unavailable"

    def __init__(self, message: str, *, retry_after: float = 5.0, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class InvalidKey(InvalidRequest):
    """An object-store key that could escape its prefix or is not portable."""

    default_code = "invalid_object_key"


class ObjectNotFound(NotFound):
    default_code = "object_not_found"


class StorageError(ServiceUnavailable):
    """The object store failed or refused us (credentials, network, bucket)."""

    default_code = "storage_unavailable"

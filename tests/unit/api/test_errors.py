"""Mapping errors to HTTP: parameter names from validation locations, the retry headers clients obey, and errors
that reach the HTTP process from the engine process whole."""

from __future__ import annotations

import pickle

import pytest

from api.errors import error_headers, validation_param
from core.errors import Conflict, InvalidRequest, NotFound, RateLimited, ServiceUnavailable


@pytest.mark.parametrize(
    ("loc", "param"),
    [
        (("body", "hyperparameters", "lora_r"), "hyperparameters.lora_r"),
        (("body", "hyperparameters", "batch_size", "int"), "hyperparameters.batch_size"),
        (("body", "hyperparameters", "n_epochs", "literal['auto']"), "hyperparameters.n_epochs"),
        (("body", "hyperparameters", "target_modules", 0), "hyperparameters.target_modules.0"),
        (("query", "limit"), "limit"),
        (("body",), None),
    ],
)
def test_validation_locations_become_dotted_params(loc: tuple, param: str | None) -> None:
    assert validation_param(loc) == param


@pytest.mark.parametrize(
    ("error", "headers"),
    [
        (ServiceUnavailable("down", retry_after=2.2), {"retry-after": "3"}),
        (RateLimited("slow down", retry_after=0.1), {"retry-after": "1"}),
        (Conflict("already done"), {"x-should-retry": "false"}),
        (InvalidRequest("bad"), {}),
        (NotFound("gone"), {}),
    ],
)
def test_retry_headers(error: Exception, headers: dict[str, str]) -> None:
    assert error_headers(error) == headers  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error",
    [
        RateLimited("full", retry_after=1.5, code="server_overloaded"),
        ServiceUnavailable("down", retry_after=2.0, code="engine_failed"),
        InvalidRequest("too long", param="prompt"),
        NotFound("gone"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_cross_a_process_boundary_whole(error: Exception) -> None:
    """The engine process sends its errors to the HTTP process pickled: status, code, param and retry-after
    must arrive (pickle's default rebuilds from ``args`` and would fail on keyword-only fields)."""
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert copy.to_dict() == error.to_dict() and error_headers(copy) == error_headers(error)

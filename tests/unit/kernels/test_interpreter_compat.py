"""Interpreter tensors used as loop bounds convert to ints whatever shape the interpreter gives them
(triton 3.6 holds a loaded scalar as a one-element array, which NumPy >= 2.4 refuses to ``int()``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from loraplex_kernels.interpreter_compat import _index


@pytest.mark.parametrize("data", [np.int32(7), np.array(7), np.array([7]), np.array([[7]], dtype=np.int64)])
def test_a_one_element_handle_converts_to_its_value(data: np.ndarray) -> None:
    value = _index(SimpleNamespace(handle=SimpleNamespace(data=data)))
    assert value == 7 and type(value) is int

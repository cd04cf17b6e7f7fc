"""Lets triton 3.6's CPU interpreter run our kernels under NumPy >= 2.4.

Loop bounds our kernels read from memory (a segment's rank, a sequence's context length) reach Python's
``range`` as interpreter tensors holding a one-element array, and triton 3.6 turns them into ints with
``int(array)``: NumPy 2.4 made that an error for arrays that are not 0-dimensional. Triton 3.7 squeezes
the array first; on 3.6 we install the same conversion. Compiled kernels on a GPU never take this path.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _index(tensor: Any) -> int:
    return int(np.asarray(tensor.handle.data).reshape(-1)[0])


def patch_interpreter_index() -> bool:
    """Make interpreter tensors usable as loop bounds on triton 3.6 and NumPy >= 2.4; True if patched."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_loraplex_index", False) or not _needs_patch():
        return False

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    patch_lang_tensor._loraplex_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


def _needs_patch() -> bool:
    """Whether this triton's interpreter predates the squeeze (3.7 added it)."""
    import triton

    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return (major, minor) < (3, 7)

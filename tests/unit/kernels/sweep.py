"""The multi-LoRA sweep the kernel tests share, and the tolerances they state.

Between them the cases cover hidden sizes {64, 96, 128, 257, 1024}, ranks {1, 4, 8, 16, 32, 64}
mixed in one batch, 1, 3 and 8 adapters, segments of length 0 and 1, no-adapter segments, 1-3
slices of unequal widths, rank-0 slices, identity and permuted token order, and a segment longer
than one token tile.
"""

from __future__ import annotations

import torch

from tests.unit.kernels.cases import LoraCase

CASES: tuple[LoraCase, ...] = (
    LoraCase(
        name="h64-1adapter-rank1",
        hidden=64,
        widths=(64,),
        lengths=(2, 1, 3),
        slots=(-1, 0, -1),
        ranks={0: (1,)},
    ),
    LoraCase(
        name="h96-3adapters-gate-up",
        hidden=96,
        widths=(160, 96),
        lengths=(3, 0, 1, 5, 2),
        slots=(4, 1, -1, 6, 1),
        ranks={4: (16, 8), 1: (4, 32), 6: (64, 1)},
        permute=True,
    ),
    LoraCase(
        name="h128-qkv-gqa",
        hidden=128,
        widths=(128, 32, 32),
        lengths=(3, 0, 1, 4, 2, 1, 17),
        slots=(0, 2, -1, 2, 5, 0, 5),
        ranks={0: (16, 4, 4), 2: (64, 64, 1), 5: (8, 0, 32)},
        permute=True,
    ),
    LoraCase(
        name="h257-8adapters-qkv",
        hidden=257,
        widths=(257, 65, 33),
        lengths=(1, 2, 0, 1, 3, 1, 4, 1, 2, 1),
        slots=(0, 1, 2, -1, 3, 4, 5, 6, 7, 0),
        ranks={
            0: (1, 4, 8),
            1: (16, 32, 64),
            2: (4, 4, 4),
            3: (64, 1, 16),
            4: (8, 0, 32),
            5: (32, 16, 1),
            6: (4, 64, 0),
            7: (1, 8, 64),
        },
    ),
    LoraCase(
        name="h1024-8adapters-decode",
        hidden=1024,
        widths=(96,),
        lengths=(1, 1, 1, 1, 1, 1, 1, 1, 5),
        slots=(7, 6, 5, 4, 3, 2, 1, 0, 7),
        ranks={0: (1,), 1: (4,), 2: (8,), 3: (16,), 4: (32,), 5: (64,), 6: (8,), 7: (32,)},
        permute=True,
    ),
    LoraCase(
        name="h64-long-segment",
        hidden=64,
        widths=(48, 80),
        lengths=(70, 1),
        slots=(3, -1),
        ranks={3: (32, 16)},
        permute=True,
    ),
    LoraCase(
        name="no-adapters",
        hidden=128,
        widths=(64, 64),
        lengths=(4, 0, 3),
        slots=(-1, -1, -1),
        ranks={},
    ),
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# (rtol, atol) for results stored in each dtype. fp32 differs from the reference only in summation
# order. For 16-bit y the bound is about two units in the last place of values of order one: the
# kernel rounds v to the weight dtype before B (as PEFT and vLLM do) and y is rounded once on store.
# vLLM's own tests allow 1e-2 (fp32) and 6e-2 (fp16/bf16); these are 10x to 1000x tighter.
Y_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# v is always fp32 and computed from the same stored inputs on both sides: only summation order
# differs, over at most 1024 products of unit-scale terms.
V_TOLERANCE = (1e-5, 1e-5)


def y_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Keyword arguments for ``torch.testing.assert_close`` on a ``y`` of ``dtype``."""
    rtol, atol = Y_TOLERANCE[dtype]
    return {"rtol": rtol, "atol": atol}

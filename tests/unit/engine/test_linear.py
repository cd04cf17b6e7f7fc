"""Dense projections: the oneDNN-packed path gives ``x @ W^T + b`` for every row count, and only ever runs
at a bounded set of row counts (oneDNN keeps about 1 MiB of kernel per distinct count it sees)."""

from __future__ import annotations

import pytest
import torch

from server.model.linear import MAX_PACKED_ROWS, Linear, row_bucket

# Around every bucket edge, the chunk size, and past several chunks with a ragged tail.
ROWS = [1, 7, 8, 9, 63, 64, 65, 96, 97, 255, 256, 257, 511, 512, 700]


@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_matches_a_plain_matmul(bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    weight_t = torch.randn(96, 160, generator=gen)
    b = torch.randn(160, generator=gen) if bias else None
    linear = Linear(weight_t, b)
    for rows in ROWS:
        x = torch.randn(rows, 96, generator=gen)
        expected = x @ weight_t + (b if b is not None else 0)
        y = linear(x)
        assert y.shape == (rows, 160)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4, msg=f"{rows} rows")
    torch.testing.assert_close(linear.dense_weight_t(), weight_t, rtol=1e-5, atol=1e-5)


def test_row_counts_reach_onednn_from_a_small_fixed_set() -> None:
    buckets = {row_bucket(rows) for rows in range(1, MAX_PACKED_ROWS + 1)}
    assert len(buckets) == 14
    assert all(row_bucket(rows) >= rows for rows in range(1, MAX_PACKED_ROWS + 1))
    assert max(buckets) == MAX_PACKED_ROWS
    # Decode batches waste at most 7 padded rows; bigger steps at most 31.
    assert all(row_bucket(rows) - rows < 8 for rows in range(1, 65))
    assert all(row_bucket(rows) - rows < 32 for rows in range(65, MAX_PACKED_ROWS + 1))

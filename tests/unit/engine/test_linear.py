"""Dense projections: both CPU layouts (our panel GEMM, oneDNN's packed weights) give ``x @ W^T + b`` for
every row count, and the oneDNN path only ever runs at a bounded set of row counts (oneDNN keeps about 1 MiB
of kernel per distinct count it sees)."""

from __future__ import annotations

import pytest
import torch

import server.model.linear as linear_module
from loraplex_kernels.cpu_linear import panel_gemm_suits
from server.model.linear import MAX_PACKED_ROWS, Linear, row_bucket

# Around every bucket edge (oneDNN) and row block (panels: 8 rows, 256 per pass), the chunk size, and past
# several chunks with a ragged tail.
ROWS = [1, 7, 8, 9, 63, 64, 65, 96, 97, 255, 256, 257, 511, 512, 700]


@pytest.fixture(params=["panels", "onednn"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which CPU layout ``Linear`` packs into; panels need the C library built with AVX-512."""
    if request.param == "panels" and not panel_gemm_suits(torch.zeros(1, 1)):
        pytest.skip("the panel GEMM is used only where the C library is built with AVX-512")
    if request.param == "onednn":
        monkeypatch.setattr(linear_module, "panel_gemm_suits", lambda weight_t: False)
    return request.param


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [160, 45])  # whole panels of 32 columns, and a partial last one
def test_every_row_count_matches_a_plain_matmul(layout: str, bias: bool, out_features: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weight_t = torch.randn(96, out_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    linear = Linear(weight_t, b)
    assert (linear._panels is not None) == (layout == "panels")
    for rows in ROWS:
        x = torch.randn(rows, 96, generator=gen)
        expected = x @ weight_t + (b if b is not None else 0)
        y = linear(x)
        assert y.shape == (rows, out_features)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4, msg=f"{rows} rows")
    torch.testing.assert_close(linear.dense_weight_t(), weight_t, rtol=1e-5, atol=1e-5)
    assert linear.num_bytes() >= weight_t.numel() * 4


def test_strided_rows_are_read_correctly(layout: str) -> None:
    gen = torch.Generator().manual_seed(1)
    weight_t = torch.randn(64, 96, generator=gen)
    linear = Linear(weight_t)
    wide = torch.randn(20, 200, generator=gen)
    for x in (wide[:, 10:74], wide.t()[:64].t()):  # a row stride of 200; a column stride of 200
        torch.testing.assert_close(linear(x), x @ weight_t, rtol=1e-5, atol=1e-4)


# 96 inputs: whole AMX steps of 32 where the CPU has AMX; 97: the vector loop, with an odd last input row.
@pytest.mark.parametrize("in_features", [96, 97])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_panels_match_an_fp32_matmul_of_the_same_values(in_features: int, bias: bool) -> None:
    """In bf16 the panels take bf16 rows and give bf16 rows: one rounding of the fp32 result, at every row count
    (AMX blocks of 32 and 16 rows and a cut tail), partial panels and strided rows included."""
    if not panel_gemm_suits(torch.zeros(1, 1, dtype=torch.bfloat16)):
        pytest.skip("the C library does not build here")
    gen = torch.Generator().manual_seed(2)
    weight_t = torch.randn(in_features, 45, generator=gen).bfloat16()
    b = torch.randn(45, generator=gen).bfloat16() if bias else None
    linear = Linear(weight_t, b)
    assert linear._panels is not None and linear.num_bytes() < weight_t.numel() * 4
    assert torch.equal(linear.dense_weight_t(), weight_t)
    for rows in [*ROWS, 15, 16, 17, 31, 32, 33, 47, 48]:
        wide = torch.randn(rows, in_features + 9, generator=gen).bfloat16()
        x = wide[:, 3 : 3 + in_features]
        expected = x.float() @ weight_t.float() + (b.float() if b is not None else 0)
        y = linear(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 45)
        torch.testing.assert_close(y.float(), expected, rtol=8e-3, atol=1e-2, msg=f"{rows} rows")


def test_row_counts_reach_onednn_from_a_small_fixed_set() -> None:
    buckets = {row_bucket(rows) for rows in range(1, MAX_PACKED_ROWS + 1)}
    assert len(buckets) == 14
    assert all(row_bucket(rows) >= rows for rows in range(1, MAX_PACKED_ROWS + 1))
    assert max(buckets) == MAX_PACKED_ROWS
    # Decode batches waste at most 7 padded rows; bigger steps at most 31.
    assert all(row_bucket(rows) - rows < 8 for rows in range(1, 65))
    assert all(row_bucket(rows) - rows < 32 for rows in range(65, MAX_PACKED_ROWS + 1))

"""The GPU benchmark's pure pieces (shapes, byte counts, placement, peer) and its CPU entry points."""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from loraplex_kernels import reference
from loraplex_kernels.layout import ROW_ALIGN

BENCH = Path(__file__).resolve().parents[3] / "bench" / "kernels_gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kernels_gpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture
def tiny(bench):
    return bench.ModelDims(hidden=8, kv_dim=4, intermediate=16, num_heads=2, num_kv_heads=1, num_layers=1)


def test_decode_sweep_spans_the_issue_shapes(bench):
    shapes = bench.decode_shapes()
    assert {s.group for s in shapes} == {"qkv", "gate_up", "down"}
    assert {1, 256} <= {s.tokens for s in shapes} and all(1 <= s.tokens <= 256 for s in shapes)
    assert {1, 16, 64} <= {s.adapters for s in shapes} and all(s.adapters <= s.tokens for s in shapes)
    ranks = {r for s in shapes for r in bench.adapter_ranks(s)}
    assert ranks == {8, 16, 32, 64}
    assert any(len(set(bench.adapter_ranks(s))) > 1 for s in shapes), "some batch must mix ranks"


def test_lora_bytes_count_x_each_used_adapter_once_and_y_twice(bench, tiny):
    # qkv: in 8, outs 8 + 4 + 4; two adapters of rank 8; 3 tokens; 2-byte elements.
    shape = bench.LoraShape("qkv", tokens=3, adapters=2, rank=8)
    weights = 2 * 8 * (3 * 8 + 16)
    assert bench.lora_bytes(shape, tiny, 2) == 2 * (3 * 8 + weights + 2 * 3 * 16)
    # down: in 16, out 8; mixed ranks 8/16/32/64 over four adapters, all used by four tokens.
    mixed = bench.LoraShape("down", tokens=4, adapters=4, rank=0)
    assert bench.lora_bytes(mixed, tiny, 1) == 4 * 16 + 120 * (16 + 8) + 2 * 4 * 8


def test_attention_bytes_count_q_kv_and_out(bench, tiny):
    # 2 sequences x 5 tokens x 1 KV head x head_dim 4, K and V; q and out: 2 x 2 heads x 4.
    assert bench.attention_bytes(2, 5, tiny, 2) == 2 * (2 * 2 * 5 * 4 + 2 * 2 * 2 * 4)


def test_rows_are_aligned_inside_pages_and_never_overlap(bench):
    widths = [100, 4096, 7, 4096, 300] * 20
    offsets = bench.place_rows(widths, 8192, torch.Generator().manual_seed(0))
    spans = sorted((off, off + w) for off, w in zip(offsets, widths, strict=True))
    assert all(off % ROW_ALIGN == 0 for off in offsets)
    assert all(start // 8192 == (end - 1) // 8192 for start, end in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))


def test_benchmark_problem_and_torch_peer_agree_with_the_reference(bench, tiny):
    shape = bench.LoraShape("qkv", tokens=5, adapters=3, rank=0)
    p = bench.build_lora(shape, tiny, torch.float32, "cpu")
    expected = p.y.clone()
    reference.add_lora(expected, p.x, p.arena, p.tables.layer(0), p.group, p.segs)
    bench.torch_gather_bmm(p)
    assert_close(p.y, expected, rtol=1e-5, atol=1e-5)
    assert expected.abs().sum() > 0


def test_help_works_without_a_gpu(bench, capsys):
    with pytest.raises(SystemExit) as exited:
        bench.main(["--help"])
    assert exited.value.code == 0 and "--interpret-smoke" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_without_a_gpu_the_full_run_refuses_with_a_hint(bench, capsys):
    assert bench.main(["--quick"]) == 2
    assert "--interpret-smoke" in capsys.readouterr().err


def test_interpret_smoke_runs_every_code_path_on_cpu(tmp_path):
    # A fresh process started elsewhere, without TRITON_INTERPRET: the script must set it itself.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(BENCH), "--interpret-smoke"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "add_lora" in done.stdout and "paged decode attention" in done.stdout
    assert "mismatches vs peers: 0" in done.stdout

"""Trainer unit tests run the tiny model on one thread: on a shared, busy machine OpenMP threads waiting
for each other make its small matmuls many times slower, and the results are the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from trainer.train import load_tokenizer

    return load_tokenizer(tiny_model_dir)

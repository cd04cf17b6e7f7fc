"""Upload spools: the size cap, and JSONL validated line by line across arbitrary chunk boundaries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.spools import DatasetSpool, FileSpool
from core.dataset_format import MAX_LINE_BYTES
from core.errors import PayloadTooLarge


def example(i: int) -> bytes:
    return json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}).encode()


def spool_in_chunks(tmp_path: Path, data: bytes, chunk: int, max_bytes: int = 10**9) -> DatasetSpool:
    spool = DatasetSpool(tmp_path / "upload.jsonl", max_bytes=max_bytes)
    for start in range(0, len(data), chunk):
        spool.write(data[start : start + chunk])
    spool.close()
    return spool


@pytest.mark.parametrize("chunk", [1, 5, 33, 4096])
def test_lines_split_across_chunks_validate_with_their_numbers(tmp_path: Path, chunk: int) -> None:
    lines = [example(i) for i in range(12)]
    lines[4] = b'{"prompt": "q4"'  # broken JSON on line 5
    data = b"\n".join(lines)  # no newline after the last line

    spool = spool_in_chunks(tmp_path, data, chunk)

    assert [p.line for p in spool.report.problems] == [5]
    assert spool.report.num_examples == 11
    assert spool.path.read_bytes() == data
    assert spool.size == len(data)


def test_a_valid_file_reports_its_format_and_count(tmp_path: Path) -> None:
    spool = spool_in_chunks(tmp_path, b"\r\n".join(example(i) for i in range(10)) + b"\r\n", 7)

    assert spool.report.ok and spool.report.format == "prompt_completion" and spool.report.num_examples == 10


def test_an_overlong_line_is_refused_without_being_held_whole(tmp_path: Path) -> None:
    huge = b'{"prompt": "' + b"x" * (3 * MAX_LINE_BYTES) + b'", "completion": "y"}'
    data = b"\n".join([example(0), huge, *(example(i) for i in range(1, 11))])

    spool = spool_in_chunks(tmp_path, data, 1024 * 1024)

    assert [str(p) for p in spool.report.problems] == [f"line 2: line is longer than {MAX_LINE_BYTES} bytes"]
    assert spool.report.num_examples == 11


def test_passing_the_cap_raises_at_once(tmp_path: Path) -> None:
    spool = FileSpool(tmp_path / "f", max_bytes=10, what="adapter_model.safetensors")
    spool.write(b"x" * 10)

    with pytest.raises(PayloadTooLarge, match=r"adapter_model\.safetensors is larger than the 10-byte"):
        spool.write(b"y")


def test_the_report_needs_the_part_to_end(tmp_path: Path) -> None:
    spool = DatasetSpool(tmp_path / "f", max_bytes=100)
    spool.write(example(0))

    with pytest.raises(RuntimeError):
        spool.report  # noqa: B018
    spool.discard()

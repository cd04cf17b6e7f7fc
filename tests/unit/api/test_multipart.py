"""The streaming multipart parser: any chunking gives the same fields and files; broken bodies are refused."""

from __future__ import annotations

import pytest

from api.multipart import FilePart, StreamingForm, display_filename
from core.errors import InvalidRequest

BOUNDARY = "XyZ"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def body(*parts: tuple[str, str | None, bytes], close: bool = True) -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + (f"--{BOUNDARY}--\r\n".encode() if close else b"")


class Collector:
    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        self.closed = True


def parse(
    raw: bytes, chunk: int, text_fields: frozenset[str] = frozenset({"purpose"})
) -> tuple[StreamingForm, dict[str, tuple[FilePart, Collector]]]:
    files: dict[str, tuple[FilePart, Collector]] = {}

    def open_file(part: FilePart) -> Collector:
        files[part.field] = (part, Collector())
        return files[part.field][1]

    form = StreamingForm(CONTENT_TYPE, open_file, text_fields=text_fields)
    for start in range(0, len(raw), chunk):
        form.feed(raw[start : start + chunk])
    form.finish()
    return form, files


@pytest.mark.parametrize("chunk", [1, 2, 7, 64, 10_000])
def test_fields_and_files_arrive_whole_however_the_body_is_chunked(chunk: int) -> None:
    payload = bytes(range(256)) * 20 + b"\r\n--XyZ-not-a-boundary\r\n"
    raw = body(("purpose", None, b"fine-tune"), ("file", "../dir/train.jsonl", payload))

    form, files = parse(raw, chunk)

    assert form.fields == {"purpose": "fine-tune"}
    part, sink = files["file"]
    assert (part.filename, bytes(sink.data), sink.closed) == ("train.jsonl", payload, True)


def test_a_body_without_its_closing_boundary_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="closing boundary"):
        parse(body(("file", "a.jsonl", b"{}"), close=False), 16)


def test_a_field_given_twice_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="more than once") as caught:
        parse(body(("purpose", None, b"a"), ("purpose", None, b"b")), 1000)
    assert caught.value.param == "purpose"


def test_a_long_text_field_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="longer than 4096 bytes"):
        parse(body(("purpose", None, b"x" * 5000)), 1000)


def test_a_text_field_must_be_utf8() -> None:
    with pytest.raises(InvalidRequest, match="not valid UTF-8"):
        parse(body(("purpose", None, b"\xff\xfe")), 1000)


def test_too_many_parts_are_refused() -> None:
    names = [f"f{i}" for i in range(9)]
    with pytest.raises(InvalidRequest, match="too many form parts"):
        parse(body(*[(name, None, b"v") for name in names]), 1000, text_fields=frozenset(names))


def test_an_unknown_text_field_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequest, match="unknown form field 'expires_after'") as caught:
        parse(body(("purpose", None, b"fine-tune"), ("expires_after", None, b"3600")), 1000)
    assert caught.value.param == "expires_after"


@pytest.mark.parametrize("content_type", [None, "application/json", "multipart/form-data", "text/plain; boundary=XyZ"])
def test_other_media_types_or_a_missing_boundary_are_refused(content_type: str | None) -> None:
    with pytest.raises(InvalidRequest):
        StreamingForm(content_type, lambda part: Collector())


def test_garbage_is_a_malformed_body() -> None:
    form = StreamingForm(CONTENT_TYPE, lambda part: Collector())
    with pytest.raises(InvalidRequest, match="malformed multipart body"):
        form.feed(b"this is not multipart at all\r\n\r\n")


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("train.jsonl", "train.jsonl"),
        ("../../etc/passwd", "passwd"),
        ("C:\\Users\\me\\data.jsonl", "data.jsonl"),
        ("bad\x00name\n.jsonl", "badname.jsonl"),
        ("", "upload"),
        ("x" * 300, "x" * 255),
    ],
)
def test_filenames_are_reduced_to_printable_base_names(raw: str, shown: str) -> None:
    assert display_filename(raw) == shown

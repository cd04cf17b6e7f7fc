"""multipart/form-data parsed as it streams in: small text fields are kept, file parts go straight to sinks.

Starlette's form parser reads the whole body before a handler runs; uploads here may be hundreds of
megabytes, so we push each received chunk through ``python_multipart`` ourselves and let the sink of
each file part (a size-capped, validating temp file) refuse it as early as possible.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, Protocol

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from core.errors import InvalidRequest, PayloadTooLarge

MAX_FIELD_BYTES = 4096
MAX_PARTS = 8
FORM_OVERHEAD_BYTES = 64 * 1024  # part headers, boundaries and text fields around the files
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class FilePart:
    """The headers of one file part."""

    field: str
    filename: str
    content_type: str | None


class PartSink(Protocol):
    """Where a file part's bytes go while they arrive."""

    def write(self, data: bytes) -> None: ...

    def close(self) -> None:
        """The part ended normally (the closing boundary was seen)."""


def openapi_form(properties: dict[str, dict[str, Any]], required: list[str]) -> dict[str, Any]:
    """``openapi_extra`` describing a multipart body that a route streams itself (FastAPI cannot see it)."""
    schema = {"type": "object", "required": required, "properties": properties}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


def binary_field(description: str) -> dict[str, Any]:
    """The OpenAPI schema of a file part."""
    return {"type": "string", "format": "binary", "description": description}


def display_filename(raw: str) -> str:
    """A client-supplied filename reduced to a printable base name (it is only ever shown, never a path)."""
    name = PureWindowsPath(PurePosixPath(raw).name).name
    name = _UNPRINTABLE.sub("", name).strip()
    return name[:255] or "upload"


class StreamingForm:
    """A push parser: ``feed`` body chunks in order, then ``finish``. Problems raise ``InvalidRequest``.

    Text parts are accepted only under the names in ``text_fields``; each file part is handed to the
    sink ``open_file`` returns for it (which may refuse it by raising).
    """

    def __init__(
        self,
        content_type: str | None,
        open_file: Callable[[FilePart], PartSink],
        *,
        text_fields: frozenset[str] = frozenset(),
        max_field_bytes: int = MAX_FIELD_BYTES,
        max_parts: int = MAX_PARTS,
    ) -> None:
        media_type, options = parse_options_header(content_type or "")
        if media_type != b"multipart/form-data":
            raise InvalidRequest(
                "send this upload as multipart/form-data (Content-Type: multipart/form-data; boundary=...)",
                code="unsupported_media_type",
            )
        boundary = options.get(b"boundary")
        if not boundary:
            raise InvalidRequest("the multipart Content-Type has no boundary", code="invalid_multipart")
        self.fields: dict[str, str] = {}
        self.file_fields: list[str] = []
        self._open_file = open_file
        self._text_fields = text_fields
        self._max_field_bytes = max_field_bytes
        self._max_parts = max_parts
        self._parts = 0
        self._ended = False
        self._reset_part()
        self._parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._reset_part,
                "on_header_field": self._on_header_field,
                "on_header_value": self._on_header_value,
                "on_header_end": self._on_header_end,
                "on_headers_finished": self._on_headers_finished,
                "on_part_data": self._on_part_data,
                "on_part_end": self._on_part_end,
                "on_end": self._on_end,
            },
        )

    def feed(self, chunk: bytes) -> None:
        """Parse the next chunk of the body."""
        if self._ended:
            return  # an epilogue after the closing boundary is allowed and ignored
        try:
            self._parser.write(chunk)
        except MultipartParseError as exc:
            raise InvalidRequest(f"malformed multipart body: {exc}", code="invalid_multipart") from None

    def finish(self) -> None:
        """The body is complete; a missing closing boundary means the upload was cut short."""
        if not self._ended:
            raise InvalidRequest(
                "the multipart body ended before its closing boundary (was the upload interrupted?)",
                code="invalid_multipart",
            )

    # -- parser callbacks ---------------------------------------------------------------------

    def _reset_part(self) -> None:
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._disposition: bytes | None = None
        self._part_type: bytes | None = None
        self._field: str | None = None
        self._field_data = bytearray()
        self._sink: PartSink | None = None

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _on_header_end(self) -> None:
        name = bytes(self._header_name).lower()
        if name == b"content-disposition":
            self._disposition = bytes(self._header_value)
        elif name == b"content-type":
            self._part_type = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def _on_headers_finished(self) -> None:
        self._parts += 1
        if self._parts > self._max_parts:
            raise InvalidRequest(f"too many form parts (at most {self._max_parts})", code="invalid_multipart")
        _, options = parse_options_header(self._disposition or b"")
        if b"name" not in options:
            raise InvalidRequest("a form part has no name in its Content-Disposition", code="invalid_multipart")
        field = options[b"name"].decode("utf-8", "replace")
        if field in self.fields or field in self.file_fields:
            raise InvalidRequest(f"the form field {field!r} appears more than once", param=field)
        self._field = field
        if b"filename" in options:
            self.file_fields.append(field)
            filename = display_filename(options[b"filename"].decode("utf-8", "replace"))
            part_type = self._part_type.decode("latin-1").strip() if self._part_type else None
            self._sink = self._open_file(FilePart(field=field, filename=filename, content_type=part_type))
        elif field not in self._text_fields:
            raise InvalidRequest(f"unknown form field {field!r}", param=field)

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._sink is not None:
            self._sink.write(data[start:end])
            return
        self._field_data += data[start:end]
        if len(self._field_data) > self._max_field_bytes:
            raise InvalidRequest(
                f"the form field {self._field!r} is longer than {self._max_field_bytes} bytes", param=self._field
            )

    def _on_part_end(self) -> None:
        if self._sink is not None:
            self._sink.close()
            return
        assert self._field is not None  # set when the headers finished
        try:
            self.fields[self._field] = self._field_data.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"the form field {self._field!r} is not valid UTF-8", param=self._field) from None

    def _on_end(self) -> None:
        self._ended = True


async def read_form(request: Request, form: StreamingForm, *, max_body_bytes: int) -> None:
    """Stream the request body through ``form``; past ``max_body_bytes`` it stops reading and raises 413.

    Parsing and the sinks' disk writes run in the thread pool so a large upload never stalls the event loop.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise PayloadTooLarge(f"the upload is {declared} bytes; the limit is {max_body_bytes}")
    received = 0
    try:
        async for chunk in request.stream():
            if not chunk:
                continue
            received += len(chunk)
            if received > max_body_bytes:
                raise PayloadTooLarge(f"the upload is larger than the {max_body_bytes}-byte limit")
            await run_in_threadpool(form.feed, chunk)
    except ClientDisconnect:
        raise InvalidRequest("the client disconnected before the upload finished", code="client_disconnected") from None
    await run_in_threadpool(form.finish)

"""Where uploaded file parts land while they stream in: size-capped temp files, one validating JSONL as it comes.

A training file is checked line by line while it arrives (``core.dataset_format``), so a bad upload is
refused with every problem's line number and never reaches the object store; a good one is then
streamed there from disk. Both are :class:`api.multipart.PartSink` implementations.
"""

from __future__ import annotations

from pathlib import Path

from core.dataset_format import MAX_LINE_BYTES, DatasetReport, DatasetValidator
from core.errors import PayloadTooLarge


class FileSpool:
    """A file part written to ``path``; raises ``PayloadTooLarge`` as soon as it passes ``max_bytes``."""

    def __init__(self, path: Path, *, max_bytes: int, what: str = "file") -> None:
        self.path = path
        self.size = 0
        self.complete = False
        self._max = max_bytes
        self._what = what
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close()/discard(); the caller removes the dir)

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self._max:
            self._file.close()
            raise PayloadTooLarge(f"the {self._what} is larger than the {self._max}-byte upload limit")
        self._file.write(data)

    def close(self) -> None:
        """The part ended normally."""
        self._file.close()
        self.complete = True

    def discard(self) -> None:
        """Release the file handle (idempotent)."""
        self._file.close()


class DatasetSpool(FileSpool):
    """A JSONL training file, validated line by line as it is written."""

    def __init__(self, path: Path, *, max_bytes: int, validator: DatasetValidator | None = None) -> None:
        super().__init__(path, max_bytes=max_bytes, what="file")
        self._validator = validator or DatasetValidator()
        self._line = bytearray()
        self._report: DatasetReport | None = None

    def write(self, data: bytes) -> None:
        super().write(data)
        *complete, rest = data.split(b"\n")
        for piece in complete:
            self._append(piece)
            self._validator.feed(bytes(self._line))
            self._line.clear()
        self._append(rest)

    def _append(self, piece: bytes) -> None:
        # Keep at most one byte past the line limit: enough for the validator to reject an overlong
        # line, without holding a line of hundreds of megabytes in memory.
        room = MAX_LINE_BYTES + 1 - len(self._line)
        if room > 0:
            self._line += piece[:room]

    def close(self) -> None:
        """The part ended: validate the last line and the file as a whole."""
        if self._line:
            self._validator.feed(bytes(self._line))
            self._line.clear()
        super().close()
        self._report = self._validator.finish()

    @property
    def report(self) -> DatasetReport:
        """The validation outcome (after :meth:`close`)."""
        if self._report is None:
            raise RuntimeError("the file part did not end; call close() first")
        return self._report

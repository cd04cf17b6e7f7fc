"""Headless Chromium (Debian's ``chromium`` package) for looking at pages the way a person would."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

CHROMIUM = "/usr/bin/chromium"
# Offline and quiet: no sandbox (containers), no GPU, no QUIC, no phoning home.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def chromium_binary() -> str:
    """The Chromium to run; fails (not skips) when missing, so CI cannot pass without looking at the page."""
    path = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    if path is None:
        pytest.fail("Chromium is not installed: apt-get install -y chromium")
    return path


def run_chromium(args: list[str], profile: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    argv = [chromium_binary(), *FLAGS, f"--user-data-dir={profile}", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def dump_dom(url: str, profile: Path) -> str:
    """The DOM after the page loaded (redirects and cookies followed)."""
    done = run_chromium(["--dump-dom", url], profile)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def screenshot(url: str, out: Path, profile: Path, size: tuple[int, int]) -> Path:
    done = run_chromium([f"--screenshot={out}", f"--window-size={size[0]},{size[1]}", url], profile)
    assert done.returncode == 0 and out.exists(), done.stderr[-2000:]
    return out


class ChartCensus(HTMLParser):
    """Every ``<svg class="chart" data-chart=...>`` with the number of ``rect.bar`` marks it draws, and the
    replica blocks (``data-replica``) of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.charts: list[tuple[str, int]] = []
        self.replicas: list[str] = []
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "svg" and "chart" in (a.get("class") or "").split():
            self._open = a.get("data-chart") or "?"
            self.charts.append((self._open, 0))
        elif tag == "rect" and self._open is not None and a.get("class") == "bar":
            name, bars = self.charts[-1]
            self.charts[-1] = (name, bars + 1)
        elif a.get("data-replica"):
            self.replicas.append(a["data-replica"] or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._open = None

    def bars(self, chart: str) -> list[int]:
        """Bars drawn by each chart of that name, in page order."""
        return [bars for name, bars in self.charts if name == chart]


def png_pixels(path: Path) -> np.ndarray:
    """An 8-bit RGB(A) PNG as an (height, width, channels) array (enough PNG for Chromium's screenshots)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks, header = 8, [], b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            chunks.append(body)
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and color in (2, 6) and header[12] == 0, "only 8-bit, non-interlaced RGB(A)"
    channels = 3 if color == 2 else 4
    stride = width * channels
    raw = np.frombuffer(zlib.decompress(b"".join(chunks)), dtype=np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.int32)
    prev = np.zeros(stride, dtype=np.int32)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 0:
            row = line
        elif kind == 2:
            row = (line + prev) & 0xFF
        elif kind == 1:
            row = np.cumsum(line.reshape(width, channels), axis=0).reshape(stride) & 0xFF
        else:
            row = _sequential(kind, line, prev, channels)
        out[y] = prev = row
    return out.reshape(height, width, channels).astype(np.uint8)


def _sequential(kind: int, line: np.ndarray, prev: np.ndarray, bpp: int) -> np.ndarray:
    """Average (3) and Paeth (4) rows depend on the byte to the left: decoded byte by byte (plain ints are
    far faster than numpy for this)."""
    filtered, up_row = line.tolist(), prev.tolist()
    row = [0] * len(filtered)
    for x, value in enumerate(filtered):
        left = row[x - bpp] if x >= bpp else 0
        up = up_row[x]
        if kind == 3:
            pred = (left + up) // 2
        else:
            upleft = up_row[x - bpp] if x >= bpp else 0
            p = left + up - upleft
            pa, pb, pc = abs(p - left), abs(p - up), abs(p - upleft)
            pred = left if pa <= pb and pa <= pc else (up if pb <= pc else upleft)
        row[x] = (value + pred) & 0xFF
    return np.array(row, dtype=np.int32)

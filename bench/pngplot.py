"""Line charts as PNG files with the standard library only (zlib): the soak's operator memory and
API requests over time (`bench.soak`), for docs/. No text is drawn: the caption next to the image
in docs/benchmarks.md gives the axes, and each panel's range is written into the benchmark's JSON.

A chart is one or more stacked panels; each panel draws its series scaled to its own range (y from
0 to the largest value, x over the shared time range), with a grey frame, grey grid lines at each
quarter, and optional red vertical marks (the moments faults were injected).
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

Color = tuple[int, int, int]
BLUE: Color = (31, 119, 180)
ORANGE: Color = (255, 127, 14)
RED: Color = (214, 39, 40)
GREY: Color = (200, 200, 200)
BLACK: Color = (60, 60, 60)


@dataclass
class Panel:
    """One panel: series of (x, y) points, each with its color; `marks`: x values of red lines."""

    series: list[tuple[Sequence[tuple[float, float]], Color]]
    marks: Sequence[float] = field(default_factory=list)

    def y_max(self) -> float:
        top = max((y for points, _ in self.series for _, y in points), default=0.0)
        return top if top > 0 else 1.0


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            at = (y * self.width + x) * 3
            self.pixels[at:at + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, thick: int = 1) -> None:
        """Bresenham's line, `thick` pixels wide."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        error = dx + dy
        while True:
            for ox in range(thick):
                for oy in range(thick):
                    self.dot(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                return
            double = 2 * error
            if double >= dy:
                error += dy
                x0 += sx
            if double <= dx:
                error += dx
                y0 += sy

    def png(self) -> bytes:
        rows = b"".join(b"\x00" + bytes(self.pixels[y * self.width * 3:(y + 1) * self.width * 3])
                        for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return (struct.pack(">I", len(data)) + kind + data
                    + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


def draw(panels: Sequence[Panel], x_range: tuple[float, float], path: Path,
         width: int = 900, panel_height: int = 220, margin: int = 20) -> None:
    """Write the stacked `panels` as a PNG at `path`."""
    height = len(panels) * (panel_height + margin) + margin
    canvas = Canvas(width, height)
    x_low, x_high = x_range
    span = (x_high - x_low) or 1.0
    for number, panel in enumerate(panels):
        top = margin + number * (panel_height + margin)
        left, right, bottom = margin, width - margin, top + panel_height
        y_max = panel.y_max()

        def at(x: float, y: float, left: int = left, right: int = right, bottom: int = bottom,
               top: int = top, y_max: float = y_max) -> tuple[int, int]:
            return (left + round((x - x_low) / span * (right - left)),
                    bottom - round(y / y_max * (bottom - top)))

        for quarter in (1, 2, 3):
            y = bottom - quarter * (bottom - top) // 4
            canvas.line(left, y, right, y, GREY)
        for mark in panel.marks:
            x, _ = at(mark, 0)
            canvas.line(x, top, x, bottom, RED)
        for a, b in ((left, top), (right, top)), ((right, top), (right, bottom)), \
                ((right, bottom), (left, bottom)), ((left, bottom), (left, top)):
            canvas.line(*a, *b, BLACK)
        for points, color in panel.series:
            placed = [at(x, y) for x, y in points]
            for (x0, y0), (x1, y1) in itertools.pairwise(placed):
                canvas.line(x0, y0, x1, y1, color, thick=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(canvas.png())

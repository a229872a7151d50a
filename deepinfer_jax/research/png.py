"""A dependency-free line plot written as a PNG (numpy + zlib), for the model card's loss curve.

matplotlib is not part of the environment, so this draws onto an RGB canvas: axes, a light grid
with numeric tick labels (a 3x5 pixel digit font), polylines, markers and dashed horizontal
reference lines, then encodes the canvas as an 8-bit RGB PNG (filter 0 rows, one IDAT chunk).
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["encode_png", "line_plot_png"]

_DIGITS = {  # 3x5 glyphs, rows top to bottom, bit 2 = left column
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7), "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1), "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7),
    ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0), "k": (4, 5, 6, 5, 5), "M": (5, 7, 7, 5, 5),
}


def encode_png(rgb: np.ndarray) -> bytes:
    """PNG bytes of an ``[H, W, 3]`` uint8 image."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


class _Canvas:
    def __init__(self, width: int, height: int):
        self.img = np.full((height, width, 3), 255, np.uint8)

    def dot(self, x: int, y: int, color, r: int = 0) -> None:
        h, w, _ = self.img.shape
        self.img[max(0, y - r):min(h, y + r + 1), max(0, x - r):min(w, x + r + 1)] = color

    def line(self, x0: float, y0: float, x1: float, y1: float, color, r: int = 0, dash: int = 0) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i in range(n):
            if dash and (i // dash) % 2:
                continue
            t = i / max(n - 1, 1)
            self.dot(round(x0 + t * (x1 - x0)), round(y0 + t * (y1 - y0)), color, r)

    def text(self, x: int, y: int, s: str, color=(0, 0, 0), scale: int = 2) -> None:
        for ch in s:
            for row, bits in enumerate(_DIGITS.get(ch, (0,) * 5)):
                for col in range(3):
                    if bits >> (2 - col) & 1:
                        self.img[y + row * scale:y + (row + 1) * scale, x + col * scale:x + (col + 1) * scale] = color
            x += 4 * scale


def _label(v: float) -> str:
    if abs(v) >= 1e6:
        return f"{v / 1e6:g}M"
    if abs(v) >= 1e3:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


def _ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    raw = (hi - lo) / n
    mag = 10 ** np.floor(np.log10(raw))
    step = min((m * mag for m in (1, 2, 5, 10)), key=lambda s: abs(s - raw))
    return [float(v) for v in np.arange(np.ceil(lo / step) * step, hi + step * 1e-9, step)]


def line_plot_png(path: str | Path, series: Sequence[dict], hlines: Sequence[dict] = (), *, width: int = 800,
                  height: int = 450, ylim: tuple[float, float] | None = None) -> Path:
    """Draw ``series`` (dicts with ``x``, ``y``, ``color``; ``marker=True`` for points, ``width`` in
    pixels) and dashed ``hlines`` (``y``, ``color``) and write the PNG to ``path``."""
    left, right, top, bottom = 70, 20, 15, 40
    xs = np.concatenate([np.asarray(s["x"], float) for s in series])
    ys = np.concatenate([np.asarray(s["y"], float) for s in series] + [[h["y"] for h in hlines]])
    x0, x1 = 0.0, float(xs.max()) if xs.size else 1.0
    y0, y1 = ylim if ylim else (float(np.floor(ys.min())), float(np.ceil(ys.max())))
    c = _Canvas(width, height)

    def px(x: float) -> float:
        return left + (x - x0) / max(x1 - x0, 1e-12) * (width - left - right)

    def py(y: float) -> float:
        return top + (y1 - y) / max(y1 - y0, 1e-12) * (height - top - bottom)

    grey, black = (225, 225, 225), (0, 0, 0)
    for t in _ticks(y0, y1):
        c.line(px(x0), py(t), px(x1), py(t), grey)
        c.text(left - 8 - 8 * len(_label(t)), round(py(t)) - 5, _label(t))
    for t in _ticks(x0, x1):
        c.line(px(t), py(y0), px(t), py(y1), grey)
        c.text(round(px(t)) - 4 * len(_label(t)), height - bottom + 10, _label(t))
    c.line(px(x0), py(y0), px(x1), py(y0), black)
    c.line(px(x0), py(y0), px(x0), py(y1), black)
    for h in hlines:
        c.line(px(x0), py(h["y"]), px(x1), py(h["y"]), h["color"], r=1, dash=8)
    for s in series:
        pts = [(px(x), py(min(max(y, y0), y1))) for x, y in zip(s["x"], s["y"])]
        if s.get("marker"):
            for x, y in pts:
                c.dot(round(x), round(y), s["color"], r=3)
        else:
            for (a, b), (d, e) in itertools.pairwise(pts):
                c.line(a, b, d, e, s["color"], r=s.get("width", 1) // 2)
    path = Path(path)
    path.write_bytes(encode_png(c.img))
    return path

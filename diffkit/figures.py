"""The report page's pictures, drawn without matplotlib (issue 46: the report adds well under a second).

Maps (reference | candidate | |difference| over the last two axes, and the worst leading-axis
slices) are small palette PNGs written with Pillow: one pixel per pooled cell, coloured through a
256-entry lookup table and shown at a whole multiple of its size (the page sets width/height and
`image-rendering: pixelated`).  The data behind them is `plots`' own (`plots.stage_maps`,
`plots._worst_slices`, `plots._displayable`, `plots.values`), so the page shows what
`Stage.heatmap()` shows in a notebook.  Charts (the error through the network, the error histogram,
the error against the reference value) are inline SVG built with ElementTree: every text node and
attribute is escaped by it, and characters XML cannot hold are dropped first (`render.xml_text`),
so a stage name is always text.  No xmlns is written: HTML's parser puts an inline <svg> in the
SVG namespace itself, and the page holds no URL at all.

Nothing here draws the user's random numbers: samples come from a generator seeded 0.
"""
from __future__ import annotations

import base64
import io
import math
import xml.etree.ElementTree as ET

import torch
from markupsafe import Markup

from . import plots
from .describe import fmt
from .render import xml_text

MAP_BOX = (240, 180)  # a map is drawn at the largest whole multiple of its cells within this (width, height)
SLICE_BOX = (150, 110)
STRIP_HEIGHT = 48  # the height of a one-row map (a 1-D or 0-d value)
CBAR_WIDTH = 12
WORST_SLICES = 4
HIST_BINS = 60
HIST_SAMPLE = 200_000
SCATTER_POINTS = 2_000

# matplotlib's colormaps sampled at 17 evenly spaced points (index 0, 16, 32, …, 255 of its 256-entry
# tables); the lookup table interpolates linearly between them (within 6/255 of matplotlib's per channel).
# Importing matplotlib.colors to read the real tables costs ~0.2 s, a fifth of the report's budget.
_ANCHORS = {
    "viridis": "440154 48186a 472d7b 424086 3b528b 33638d 2c728e 26828e 21918c 1f9f88 27ad81 3dbc74 5cc863 "
               "81d34d aadc32 d5e21a fde725",
    "magma": "000004 0a0822 1d1147 36106b 51127c 6a1c81 832681 9c2e7f b73779 cf4070 e55064 f4695c fb8761 fea571 "
             "fec287 fde0a1 fcfdbf",
}
_LUTS: dict[str, bytes] = {}


def lut(name: str) -> bytes:
    """A 256-entry RGB lookup table (768 bytes, Pillow's palette layout), computed once per colormap."""
    if name not in _LUTS:
        anchors = [bytes.fromhex(h) for h in _ANCHORS[name].split()]
        n = len(anchors) - 1
        out = bytearray()
        for i in range(256):
            pos = i * n / 255
            k = min(int(pos), n - 1)
            f = pos - k
            out += bytes(round(a + (b - a) * f) for a, b in zip(anchors[k], anchors[k + 1]))
        _LUTS[name] = bytes(out)
    return _LUTS[name]


def data_uri(png: bytes) -> Markup:
    """A PNG as a data URI for an <img src>; safe to mark as markup once base64-encoded."""
    return Markup("data:image/png;base64," + base64.b64encode(png).decode("ascii"))


def png(levels: torch.Tensor, cmap: str) -> bytes:
    """A 2-D uint8 tensor of colour levels (0-255) as a palette PNG coloured by `cmap`."""
    from PIL import Image

    h, w = levels.shape
    img = Image.frombytes("P", (w, h), levels.contiguous().numpy().tobytes())
    img.putpalette(lut(cmap))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def levels(t: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Colour levels 0-255 of a finite map between lo and hi (everything at level 0 when hi <= lo)."""
    t = t.to(torch.float64)
    if not hi > lo:
        return torch.zeros(t.shape, dtype=torch.uint8)
    # halves: the span of two values near the largest double overflows, the span of their halves does not
    scaled = (t / 2 - lo / 2) / (hi / 2 - lo / 2) * 255
    return torch.nan_to_num(scaled, nan=0.0).round().clamp(0, 255).to(torch.uint8)


def colour_bar_css() -> Markup:
    """CSS classes `bar viridis` / `bar magma`: each colormap as a vertical gradient through the
    anchors the lookup table interpolates (the same colours, no image); the top is the brightest."""
    rules = []
    for name, anchors in _ANCHORS.items():
        stops = anchors.split()
        rules.append(f".bar.{name}{{background:linear-gradient(to top,"
                     + ",".join(f"#{h} {100 * i / (len(stops) - 1):.4g}%" for i, h in enumerate(stops)) + ")}")
    return Markup("\n".join(rules))


def _cells(n: int, box: int) -> int:
    return n * max(1, box // max(n, 1))


def map_view(t: torch.Tensor, title: str, cmap: str, lo: float | None = None, hi: float | None = None,
             xlabel: str = "", ylabel: str = "", box: tuple[int, int] = MAP_BOX) -> dict:
    """One map for the page: its PNG, the size it is drawn at, its colour bar and labels.
    `t` is a finite 2-D map (see `plots._displayable`); lo/hi default to its own range."""
    t = t.detach().to("cpu", torch.float64)
    lo = float(t.min()) if lo is None else lo
    hi = float(t.max()) if hi is None else hi
    h, w = t.shape
    width = _cells(w, box[0])
    height = STRIP_HEIGHT if h == 1 else _cells(h, box[1])
    return {"src": data_uri(png(levels(t, lo, hi), cmap)), "width": width, "height": height,
            "cells": f"{h}×{w}", "cmap": cmap, "bar_width": CBAR_WIDTH, "title": title,
            "xlabel": xlabel, "ylabel": ylabel, "lo": fmt(lo, ".4g"), "hi": fmt(hi, ".4g")}


def _axis_label(shape: list[int], k: int) -> str:
    """`axis k (size)` for axis k counted from the end (1: last) of `shape`, "" when it has no such axis."""
    if len(shape) < k:
        return ""
    return f"axis {len(shape) - k} ({shape[-k]})"


def stage_maps(stage, worst: int = WORST_SLICES) -> dict:
    """reference | candidate | |difference| maps of a stage over its last two axes (leading axes
    max-reduced, pooled as `plots.stage_maps` does), and its `worst` leading-axis slices of |difference|."""
    r, c, d, note = plots.stage_maps(stage)
    r, c, d = plots._displayable(r), plots._displayable(c), plots._displayable(d)
    shape = list(stage.ref_value.shape)
    xl, yl = _axis_label(shape, 1), _axis_label(shape, 2)
    lo = float(torch.minimum(r.min(), c.min()))
    hi = float(torch.maximum(r.max(), c.max()))
    maps = [map_view(r, "reference", "viridis", lo, hi, xl, yl), map_view(c, "candidate", "viridis", lo, hi, xl, yl),
            map_view(d, "|difference|", "magma", xlabel=xl, ylabel=yl)]
    slices = [map_view(plots.pool(sl), f"|difference| at {list(idx)}", "magma", xlabel=xl, ylabel=yl, box=SLICE_BOX)
              for idx, sl in plots._worst_slices(stage, worst)]
    h, w = (shape[-2] if len(shape) >= 2 else 1), (shape[-1] if shape else 1)
    pooled = tuple(d.shape) != (h, w)
    caption = f"{stage.ref_name or stage.cand_name or '?'}  {'×'.join(map(str, shape)) or 'scalar'}"
    notes = [n for n in (note if note.startswith("max") else "",  # (not "scalar" or "[n]": the caption says so)
                         f"block max-pooled to {d.shape[0]}×{d.shape[1]} cells" if pooled else "") if n]
    return {"caption": caption, "note": "; ".join(notes), "maps": maps, "slices": slices}


# ----------------------------------------------------------------------------- SVG charts
FONT = "11"
RED, BLUE, GREY, PURPLE, INK = "#c0392b", "#2980b9", "#7f8c8d", "#7d3c98", "#333"


def _n(v: float) -> str:
    return f"{v:.1f}"


class Svg:
    """An inline SVG built with ElementTree (so every text and attribute is escaped)."""

    def __init__(self, width: int, height: int, label: str):
        self.root = ET.Element("svg", {"class": "chart", "width": str(width), "height": str(height),
                                       "viewBox": f"0 0 {width} {height}", "role": "img",
                                       "font-size": FONT, "font-family": "sans-serif"})
        ET.SubElement(self.root, "title").text = xml_text(label)

    def add(self, tag: str, text: str | None = None, **attrs) -> ET.Element:
        el = ET.SubElement(self.root, tag, {k.rstrip("_").replace("_", "-"): xml_text(v) for k, v in attrs.items()
                                            if v is not None})
        if text is not None:
            el.text = xml_text(text)
        return el

    def line(self, x1, y1, x2, y2, stroke=INK, **attrs) -> ET.Element:
        return self.add("line", x1=_n(x1), y1=_n(y1), x2=_n(x2), y2=_n(y2), stroke=stroke, **attrs)

    def text(self, x, y, s: str, **attrs) -> ET.Element:
        return self.add("text", s, x=_n(x), y=_n(y), **attrs)

    def markup(self) -> Markup:
        return Markup(ET.tostring(self.root, encoding="unicode"))


def _tick_text(v: float) -> str:
    return "0" if v == 0 else format(v, ".3g")


def linear_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round values (1, 2, 2.5 or 5 times a power of ten apart) in [lo, hi]; the ends alone
    where the span is degenerate or too large for a double."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    span = hi - lo
    if not math.isfinite(span) or span / n < 1e-300:
        return [lo, 0.0, hi] if lo < 0 < hi else [lo, hi]
    raw = span / n
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    ticks = []
    k = math.ceil(lo / step - 1e-9)
    while k * step <= hi * (1 + 1e-12) + step * 1e-9 and len(ticks) <= 2 * n:
        v = k * step
        ticks.append(0.0 if abs(v) < step * 1e-9 else v)
        k += 1
    return ticks if 2 <= len(ticks) <= 2 * n else [lo, hi]


def int_ticks(lo: int, hi: int, n: int = 10) -> list[int]:
    """At most about n whole numbers 1, 2 or 5 times a power of ten apart in [lo, hi] (stage numbers)."""
    raw = max(1.0, (hi - lo) / n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return list(range(-(-lo // step) * step, hi + 1, step))


def log_label(k: int) -> str:
    """10**k for a tick: 1, 10, 100, 1000, then 1e4 …; 0.1, 0.01, then 1e-3 …"""
    return {0: "1", 1: "10", 2: "100", 3: "1000", -1: "0.1", -2: "0.01"}.get(k, f"1e{k}")


def log_ticks(lo_e: int, hi_e: int, most: int = 8) -> list[int]:
    """Exponents of the power-of-ten ticks in [lo_e, hi_e]: every one, or the multiples of the smallest
    round step (2, 5, 10, 20, 50 …) that draws at most `most`."""
    for step in (m * 10 ** p for p in range(4) for m in (1, 2, 5)):
        ticks = list(range(-(-lo_e // step) * step, hi_e + 1, step))
        if len(ticks) <= most:
            return ticks
    return [lo_e, hi_e]


class Frame:
    """A plot area in an Svg: data to pixels (linear, or log10 of y), axes, ticks and titles."""

    def __init__(self, svg: Svg, box: tuple[float, float, float, float], xlim: tuple[float, float],
                 ylim: tuple[float, float], log_y: bool = False):
        self.svg, (self.left, self.top, self.right, self.bottom) = svg, box
        self.xlim, self.ylim, self.log_y = xlim, ylim, log_y  # ylim in exponents when log_y

    @staticmethod
    def _frac(v: float, lo: float, hi: float) -> float:
        if not hi > lo:
            return 0.5
        return (v / 2 - lo / 2) / (hi / 2 - lo / 2)  # halves: no overflow near the largest double

    def x(self, v: float) -> float:
        return self.left + self._frac(v, *self.xlim) * (self.right - self.left)

    def y(self, v: float) -> float:
        if self.log_y:
            v = math.log10(v) if v > 0 else self.ylim[0]
        f = min(max(self._frac(v, *self.ylim), -0.02), 1.02)
        return self.bottom - f * (self.bottom - self.top)

    def axes(self, xticks: list[tuple[float, str]], yticks: list[tuple[float, str]], xtitle: str, ytitle: str,
             grid: bool = True) -> None:
        s = self.svg
        s.add("rect", x=_n(self.left), y=_n(self.top), width=_n(self.right - self.left),
              height=_n(self.bottom - self.top), fill="none", stroke="#999")
        g_x = s.add("g", class_="xticks", text_anchor="middle")
        for v, label in xticks:
            px = self.x(v)
            s.line(px, self.bottom, px, self.bottom + 4)
            ET.SubElement(g_x, "text", {"x": _n(px), "y": _n(self.bottom + 15)}).text = xml_text(label)
        g_y = s.add("g", class_="yticks", text_anchor="end")
        for v, label in yticks:
            py = self.y(10.0 ** v if self.log_y else v)
            if grid:
                s.line(self.left, py, self.right, py, stroke="#e4e4e4")
            s.line(self.left - 4, py, self.left, py)
            ET.SubElement(g_y, "text", {"x": _n(self.left - 6), "y": _n(py + 4)}).text = xml_text(label)
        s.text((self.left + self.right) / 2, self.bottom + 31, xtitle, text_anchor="middle", class_="xtitle")
        cy = (self.top + self.bottom) / 2
        s.text(14, cy, ytitle, text_anchor="middle", transform=f"rotate(-90 14 {_n(cy)})", class_="ytitle")

    def points_path(self, xs, ys, colour: str, size: float = 4, opacity: float = 1.0) -> None:
        """Round dots as one path (a zero-length segment per point): small for thousands of points."""
        d = "".join(f"M{self.x(x):.0f} {self.y(y):.0f}h0" for x, y in zip(xs, ys))
        if d:
            self.svg.add("path", d=d, stroke=colour, stroke_width=str(size), stroke_linecap="round",
                         stroke_opacity=None if opacity >= 1 else str(opacity), fill="none")


def _finite(x) -> float:
    return plots._finite_or_nan(x)


def error_profile(result) -> Markup:
    """Max and mean |error| per compared stage in execution order, log y, atol drawn; the first
    divergence and the root cause marked and named; stages whose error is NaN or Inf marked with a
    cross in a band above the axis."""
    stages = result.compared
    xs = [s.index for s in stages]
    maxes = [_finite(s.stats.max_abs) for s in stages]
    means = [_finite(s.stats.mean_abs) for s in stages]
    atol = result.tolerance().get("atol")
    atol = atol if isinstance(atol, (int, float)) and 0 < atol < plots.DRAWN_AS_INF else None
    positive = [v for v in maxes + means if v == v and v > 0] + ([atol] if atol else [])
    lo_e = math.floor(math.log10(min(positive))) if positive else -12
    hi_e = math.ceil(math.log10(max(positive))) if positive else 0
    zeros = any(v == 0 for v in maxes + means)
    if zeros:
        lo_e -= 1  # exact zeros sit on the bottom edge, a decade below the smallest error
    if hi_e <= lo_e:
        hi_e = lo_e + 1
    bad = [x for x, m, a in zip(xs, maxes, means) if m != m or a != a]
    W, H = 900, 310
    svg = Svg(W, H, "error per stage: max and mean |candidate − reference| in execution order, log scale")
    x_lo, x_hi = (min(xs), max(xs)) if xs else (0, 1)
    if x_hi - x_lo < 2:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    pad = (x_hi - x_lo) * 0.02
    fr = Frame(svg, (70, 52 if bad else 32, W - 16, H - 44), (x_lo - pad, x_hi + pad), (lo_e, hi_e), log_y=True)
    nan_y = fr.top - 12
    xticks = [(v, str(v)) for v in int_ticks(min(xs) if xs else 0, max(xs) if xs else 1)]
    fr.axes(xticks, [(k, log_label(k)) for k in log_ticks(lo_e, hi_e)], "stage (execution order)",
            "|candidate − reference|")
    if atol:
        y = fr.y(atol)
        svg.line(fr.left, y, fr.right, y, stroke=GREY, stroke_dasharray="5 4", class_="atol")
    for vals, colour, label in ((maxes, RED, "max"), (means, BLUE, "mean")):
        d, pen = [], "M"
        for x, v in zip(xs, vals):
            if v != v:
                pen = "M"
                continue
            d.append(f"{pen}{_n(fr.x(x))} {_n(fr.y(v))}")
            pen = "L"
        if d:
            svg.add("path", d="".join(d), stroke=colour, fill="none", stroke_width="1.5", class_=label)
        fr.points_path([x for x, v in zip(xs, vals) if v == v], [v for v in vals if v == v], colour, size=4)
    if bad:
        svg.text(fr.left - 6, nan_y + 4, "NaN/Inf", text_anchor="end", fill=PURPLE)
        d = "".join(f"M{_n(fr.x(x) - 4)} {_n(nan_y - 4)}l8 8m0 -8l-8 8" for x in bad)
        svg.add("path", d=d, stroke=PURPLE, stroke_width="1.6", fill="none", class_="nonfinite")
    fd, rc = result.first_divergence, result.root_cause
    marks = []
    if fd is not None:
        marks.append((fd, RED, f"first divergence: stage {fd.index} {(fd.ref_name or fd.cand_name or '?')[:40]}",
                      fr.top + 14))
    if rc is not None and rc is not fd:
        marks.append((rc, PURPLE, f"root cause: stage {rc.index} {(rc.ref_name or rc.cand_name or '?')[:40]}",
                      fr.top + 30))
    for stage, colour, label, ty in marks:
        x = fr.x(stage.index)
        svg.line(x, fr.top, x, fr.bottom, stroke=colour, stroke_dasharray="2 3", stroke_width="1.5",
                 class_="marker")
        right = x > (fr.left + fr.right) / 2
        svg.text(x - 4 if right else x + 4, ty, label, fill=colour, text_anchor="end" if right else "start",
                 stroke="#fff", stroke_width="3", paint_order="stroke", class_="marker-label")  # (a halo over lines)
    # legend, above the plot area
    items = [(RED, "max |error|", ""), (BLUE, "mean |error|", "")]
    if atol:
        items.append((GREY, f"atol {atol:g}", "5 4"))
    if bad:
        items.append((PURPLE, "NaN/Inf error", ""))
    lx = fr.left
    for colour, label, dash in items:
        if label.startswith("NaN"):
            svg.add("path", d=f"M{_n(lx + 5)} 10l8 8m0 -8l-8 8", stroke=colour, stroke_width="1.6", fill="none")
        else:
            svg.line(lx, 14, lx + 18, 14, stroke=colour, stroke_width="2", stroke_dasharray=dash or None)
        svg.text(lx + 22, 18, label)
        lx += 30 + 6.5 * len(label)
    if zeros:
        svg.text(fr.right, 18, "exact zeros on the bottom edge", text_anchor="end", fill="#777")
    return svg.markup()


def _sample(n: int, k: int, device) -> torch.Tensor | None:
    """k of n indices, the same every time (a generator seeded 0: the user's RNG is left alone); None for all."""
    if n <= k:
        return None
    g = torch.Generator().manual_seed(0)
    return torch.randperm(n, generator=g)[:k].to(device)


def error_histogram(ref: torch.Tensor, cand: torch.Tensor, bins: int = HIST_BINS) -> Markup:
    """Histogram of candidate − reference over the finite elements (≤200 000 sampled), log counts."""
    d = (cand.to(torch.float64) - ref.to(torch.float64)).flatten()
    total = d.numel()
    d = d[torch.isfinite(d)]
    finite = d.numel()
    pick = _sample(finite, HIST_SAMPLE, d.device)
    if pick is not None:
        d = d[pick]
    W, H = 440, 270
    said = f"{finite} finite elements" + (f", {d.numel()} sampled" if pick is not None else "") + (
        f"; {total - finite} not finite" if finite < total else "")
    svg = Svg(W, H, f"error histogram: candidate − reference ({said})")
    svg.text(W / 2, 14, f"error histogram ({said})", text_anchor="middle", class_="chart-title")
    if not finite:
        svg.text(W / 2, H / 2, "no finite differences", text_anchor="middle", fill="#777")
        return svg.markup()
    d = d.cpu()
    lo, hi = float(d.min()), float(d.max())
    if hi == lo:
        half = 0.5 if lo == 0 else abs(lo) * 0.01
        lo, hi = lo - half, hi + half
    scaled = (d / 2 - lo / 2) / (hi / 2 - lo / 2) * bins
    counts = torch.bincount(scaled.floor().clamp(0, bins - 1).to(torch.int64), minlength=bins).tolist()
    top_e = max(1, math.ceil(math.log10(max(counts))))
    bottom_e = -0.3  # a bar of one element still shows
    fr = Frame(svg, (62, 26, W - 14, H - 44), (lo, hi), (bottom_e, top_e), log_y=True)
    edges = [lo * (1 - i / bins) + hi * (i / bins) for i in range(bins + 1)]  # each term finite: no overflow
    fr.axes([(v, _tick_text(v)) for v in linear_ticks(lo, hi)], [(k, log_label(k)) for k in log_ticks(0, top_e)],
            "candidate − reference", "count")
    bars = []
    for i, c in enumerate(counts):
        if c:
            x0, x1, y = fr.x(edges[i]), fr.x(edges[i + 1]), fr.y(c)
            bars.append(f"M{_n(x0)} {_n(fr.bottom)}V{_n(y)}H{_n(x1)}V{_n(fr.bottom)}Z")
    svg.add("path", d="".join(bars), fill=RED, fill_opacity="0.85", stroke="none", class_="bars")
    if lo < 0 < hi:
        x = fr.x(0.0)
        svg.line(x, fr.top, x, fr.bottom, stroke=GREY, stroke_width="0.8")
    return svg.markup()


def _span(lo: float, hi: float) -> tuple[float, float]:
    """[lo, hi] with a 5% margin (a unit or 10% one around a single value), kept finite."""
    if hi == lo:
        half = 0.5 if lo == 0 else abs(lo) * 0.1
        return lo - half, hi + half
    m = (hi / 2 - lo / 2) * 0.1
    return max(lo - m, -1.7e308), min(hi + m, 1.7e308)


def error_vs_reference(ref: torch.Tensor, cand: torch.Tensor, points: int = SCATTER_POINTS) -> Markup:
    """candidate − reference against the reference value (≤2 000 points): a scale bug is a line
    through 0, an offset a flat band."""
    r = ref.to(torch.float64).flatten()
    d = cand.to(torch.float64).flatten() - r
    keep = torch.isfinite(r) & torch.isfinite(d)
    r, d = r[keep], d[keep]
    n = r.numel()
    pick = _sample(n, points, r.device)
    if pick is not None:
        r, d = r[pick], d[pick]
    r, d = r.cpu(), d.cpu()
    W, H = 440, 270
    said = f"{r.numel()} of {n} finite elements" if pick is not None else f"{n} finite elements"
    svg = Svg(W, H, f"error against the reference value ({said})")
    svg.text(W / 2, 14, f"error vs reference value ({said})", text_anchor="middle", class_="chart-title")
    if not n:
        svg.text(W / 2, H / 2, "no finite elements", text_anchor="middle", fill="#777")
        return svg.markup()
    xlim = _span(float(r.min()), float(r.max()))
    ylim = _span(float(d.min()), float(d.max()))
    fr = Frame(svg, (70, 26, W - 14, H - 44), xlim, ylim)
    fr.axes([(v, _tick_text(v)) for v in linear_ticks(*xlim)], [(v, _tick_text(v)) for v in linear_ticks(*ylim)],
            "reference value", "candidate − reference")
    if ylim[0] < 0 < ylim[1]:
        y = fr.y(0.0)
        svg.line(fr.left, y, fr.right, y, stroke=GREY, stroke_width="0.8")
    fr.points_path(r.tolist(), d.tolist(), "#2c3e50", size=3, opacity=0.5)
    return svg.markup()


def stage_charts(stage) -> list[Markup]:
    """The error histogram and the error against the reference value of a stage ([] without values)."""
    pair = plots.values(stage)
    if pair is None:
        return []
    return [error_histogram(*pair), error_vs_reference(*pair)]

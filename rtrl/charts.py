"""Inline SVG charts for `rtrl report` (rtrl/report.py): categorical x (one slot per version, cycle
or day), linear y with round ticks, and native <title> tooltips, so a page needs no script.

Callers pass numbers and already-chosen labels; every label and name is HTML-escaped here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 720, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 14, 46
COLORS = ("#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c", "#0891b2", "#64748b")
PASS, FAIL, CHAMPION = "#16a34a", "#dc2626", "#64748b"


@dataclass(frozen=True)
class Series:
    name: str
    color: str
    values: Sequence[float | None]  # one per x label; None: no point there


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if not hi > lo:
        lo, hi = lo - 1, hi + 1
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.floor(lo / step + 1e-9)
    ticks: list[float] = []
    while not ticks or ticks[-1] < hi - 1e-9 * step:
        ticks.append(round((first + len(ticks)) * step, 10))
    return ticks


def num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


class Frame:
    """The axes of one plot; `x(i)` is the centre of slot i, `y(v)` the height of value v."""

    def __init__(
        self, labels: Sequence[str], lo: float, hi: float, y_label: str, y_fmt: Callable[[float], str]
    ):
        self.labels = list(labels)
        self.ticks = _ticks(lo, hi)
        self.lo, self.hi = self.ticks[0], self.ticks[-1]
        self.y_label, self.y_fmt = y_label, y_fmt
        self.band = (WIDTH - LEFT - RIGHT) / max(1, len(self.labels))

    def x(self, i: int) -> float:
        return LEFT + self.band * (i + 0.5)

    def y(self, value: float) -> float:
        return TOP + (HEIGHT - TOP - BOTTOM) * (self.hi - value) / (self.hi - self.lo)

    def axes(self) -> list[str]:
        parts = []
        for tick in self.ticks:
            y = self.y(tick)
            parts.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
            parts.append(
                f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                f"{escape(self.y_fmt(tick))}</text>"
            )
        every = max(1, math.ceil(len(self.labels) / ((WIDTH - LEFT - RIGHT) // 44)))
        for i, label in enumerate(self.labels):
            if i % every == 0:
                parts.append(
                    f'<text class="tick" x="{self.x(i):.1f}" y="{HEIGHT - BOTTOM + 16}" '
                    f'text-anchor="middle">{escape(label)}</text>'
                )
        parts.append(
            f'<line class="axis" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{HEIGHT - BOTTOM}" y2="{HEIGHT - BOTTOM}"/>'
        )
        parts.append(
            f'<text class="label" x="14" y="{(HEIGHT - BOTTOM + TOP) / 2:.0f}" text-anchor="middle" '
            f'transform="rotate(-90 14 {(HEIGHT - BOTTOM + TOP) / 2:.0f})">{escape(self.y_label)}</text>'
        )
        return parts


def svg(name: str, title: str, body: list[str], legend: Sequence[tuple[str, str]] = ()) -> str:
    """One figure: the SVG (``data-plot`` = `name`) and its legend as HTML."""
    keys = "".join(
        f'<span class="key"><span class="swatch" style="background:{color}"></span>{escape(label)}</span>'
        for label, color in legend
    )
    return (
        f'<figure><h3>{escape(title)}</h3><svg class="plot" data-plot="{name}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'role="img" xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>{"".join(body)}</svg>'
        f"<figcaption>{keys}</figcaption></figure>"
    )


def value_range(values: list[float], *, zero: bool) -> tuple[float, float]:
    values = values + ([0.0] if zero or not values else [])
    pad = 0.05 * (max(values) - min(values))
    return min(values) - (0 if zero and min(values) == 0 else pad), max(values) + pad


def line_chart(
    name: str,
    title: str,
    labels: Sequence[str],
    series: Sequence[Series],
    y_label: str,
    *,
    percent: bool = False,
    zero: bool = True,
) -> str:
    """Lines through each series' points (a gap where a value is missing), a dot on every point."""
    if percent:
        frame = Frame(labels, 0.0, 1.0, y_label, lambda v: f"{100 * v:.0f}%")
    else:
        frame = Frame(
            labels,
            *value_range([v for s in series for v in s.values if v is not None], zero=zero),
            y_label,
            num,
        )
    body = frame.axes()
    if not percent and frame.lo < 0 < frame.hi:
        body.append(
            f'<line class="zero" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{frame.y(0):.1f}" y2="{frame.y(0):.1f}"/>'
        )
    for s in series:
        runs: list[list[str]] = [[]]
        for i, v in enumerate(s.values):
            if v is None:
                runs.append([])
                continue
            runs[-1].append(f"{frame.x(i):.1f},{frame.y(v):.1f}")
            shown = pct(v) if percent else num(v)
            body.append(
                f'<circle cx="{frame.x(i):.1f}" cy="{frame.y(v):.1f}" r="3.5" fill="{s.color}">'
                f"<title>{escape(f'{s.name}, {labels[i]}: {shown}')}</title></circle>"
            )
        for run in runs:
            if len(run) > 1:
                body.append(
                    f'<polyline fill="none" stroke="{s.color}" stroke-width="2" points="{" ".join(run)}"/>'
                )
    return svg(name, title, body, [(s.name, s.color) for s in series])


def bar_chart(
    name: str,
    title: str,
    labels: Sequence[str],
    stacks: Sequence[Series],
    y_label: str,
    *,
    legend: bool = True,
) -> str:
    """Bars, one per label; several series stack on each other (values >= 0)."""
    totals = [sum(s.values[i] or 0.0 for s in stacks) for i in range(len(labels))]
    frame = Frame(labels, 0.0, max(totals, default=0.0) or 1.0, y_label, num)
    body = frame.axes()
    width = max(1.0, frame.band * 0.7)
    for i, label in enumerate(labels):
        base = 0.0
        for s in stacks:
            value = s.values[i] or 0.0
            if value <= 0:
                continue
            top, bottom = frame.y(base + value), frame.y(base)
            body.append(
                f'<rect x="{frame.x(i) - width / 2:.1f}" y="{top:.1f}" width="{width:.1f}" '
                f'height="{bottom - top:.1f}" fill="{s.color}">'
                f"<title>{escape(f'{label}, {s.name}: {num(value)}')}</title></rect>"
            )
            base += value
    return svg(name, title, body, [(s.name, s.color) for s in stacks] if legend else ())

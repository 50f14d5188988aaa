"""Horizontal bar charts drawn with block characters, so figures can be compared at a glance.

    chart.show("tok/s measured here", [Bar("baseline", 12.3), Bar("+ MTP", 25.1, kind="b")])

Bars of one chart share one scale (its largest value, or `scale_max`). A bar is drawn to an eighth of
a cell. `kind` picks the colour: the component classes `bar-chart--a` … `bar-chart--c`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.text import Text
from textual.widget import Widget

EIGHTHS = " ▏▎▍▌▋▊▉"
MAX_BAR = 80  # cells; wider bars are harder to read against their figures


@dataclass
class Bar:
    label: str
    value: float | None  # None: a row with no bar (a figure not measured)
    text: str = ""  # shown after the bar; the value with one decimal when empty
    kind: str = "a"


def bar_cells(value: float, scale_max: float, width: int) -> str:
    """`value` as a run of block characters, `width` cells for `scale_max`."""
    if width <= 0 or scale_max <= 0 or value <= 0:
        return ""
    eighths = round(min(value / scale_max, 1.0) * width * 8)
    full, rest = divmod(eighths, 8)
    return "█" * full + (EIGHTHS[rest] if rest else "")


class BarChart(Widget):
    """A title line, then one line per bar: label, bar, figure."""

    DEFAULT_CSS = """
    BarChart {
        height: auto;
    }
    BarChart > .bar-chart--title {
        text-style: bold;
    }
    BarChart > .bar-chart--value {
        text-style: bold;
    }
    BarChart > .bar-chart--a {
        color: $primary;
    }
    BarChart > .bar-chart--b {
        color: $accent;
    }
    BarChart > .bar-chart--c {
        color: $success;
    }
    BarChart > .bar-chart--none {
        color: $text-muted;
    }
    """
    COMPONENT_CLASSES = {"bar-chart--title", "bar-chart--label", "bar-chart--value", "bar-chart--a",
                         "bar-chart--b", "bar-chart--c", "bar-chart--none"}

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.title: str = ""
        self.bars: list[Bar] = []
        self.scale_max: float | None = None

    def show(self, title: str, bars: Sequence[Bar], *, scale_max: float | None = None) -> None:
        self.title = title
        self.bars = list(bars)
        self.scale_max = scale_max
        self.refresh(layout=True)

    def get_content_height(self, container, viewport, width: int) -> int:  # type: ignore[no-untyped-def]
        return len(self.bars) + (1 if self.title else 0)

    def render(self) -> Text:
        width = self.content_region.width or self.size.width
        style = self.get_component_rich_style
        label_w = max((len(b.label) for b in self.bars), default=0)
        texts = [b.text or (f"{b.value:.1f}" if b.value is not None else "—") for b in self.bars]
        value_w = max((len(t) for t in texts), default=0)
        bar_w = min(max(width - label_w - value_w - 3, 4), MAX_BAR)
        top = self.scale_max or max((b.value or 0.0 for b in self.bars), default=0.0)
        out = Text(no_wrap=True, overflow="ellipsis")
        if self.title:
            out.append(self.title, style("bar-chart--title"))
        for i, (bar, text) in enumerate(zip(self.bars, texts)):
            if out:
                out.append("\n")
            out.append(bar.label.ljust(label_w), style("bar-chart--label"))
            out.append(" ")
            cells = bar_cells(bar.value or 0.0, top, bar_w)
            kind = f"bar-chart--{bar.kind}" if bar.value is not None else "bar-chart--none"
            out.append(cells, style(kind))
            out.append(" " * (bar_w - len(cells) + 1))
            out.append(text.rjust(value_w), style("bar-chart--value"))
        return out

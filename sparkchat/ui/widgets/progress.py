"""A titled progress bar with a line of detail: the bytes of a download or of a model load, with speed and
time left. Hidden until `start`; `finish` leaves a last line (done, cancelled, error)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, ProgressBar, Static

SPEED_WINDOW_S = 3.0  # speed = bytes over the last few seconds, so it follows the link's changes


def format_size(n: float) -> str:
    """Decimal units, as download tools and the Hub show them: 61.2 GB, 85.3 MB."""
    from sparkchat.hub import format_bytes

    return format_bytes(n)


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {s:02d} s"
    hours, m = divmod(minutes, 60)
    return f"{hours} h {m:02d} min"


class RateWindow:
    """Units per second over the last `window` seconds of (time, done) samples."""

    def __init__(self, window: float = SPEED_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.clock = clock
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, done: int) -> float | None:
        now = self.clock()
        self.samples.append((now, done))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window:
            self.samples.popleft()
        return self.rate()

    def rate(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        return (d1 - d0) / (t1 - t0) if t1 > t0 else None


def bytes_detail(done: int, total: int, rate: float | None) -> str:
    """'1.2 GB of 61.2 GB · 85.3 MB/s · 11 min 42 s left'."""
    parts = [f"{format_size(done)} of {format_size(total)}" if total else format_size(done)]
    if rate is not None and rate > 0:
        parts.append(f"{format_size(rate)}/s")
        if total > done:
            parts.append(f"{format_duration((total - done) / rate)} left")
    return " · ".join(parts)


class TransferProgress(Vertical):
    """Title, bar and detail for one long task counted in bytes (speed, time left)."""

    DEFAULT_CSS = """
    TransferProgress {
        height: auto;
    }
    TransferProgress .progress-row {
        height: 1;
    }
    TransferProgress .progress-title {
        width: auto;
        max-width: 50%;
        margin-right: 2;
        text-style: bold;
    }
    TransferProgress ProgressBar {
        width: 1fr;
    }
    TransferProgress ProgressBar Bar {
        width: 1fr;
    }
    TransferProgress .progress-detail {
        color: $text-muted;
    }
    TransferProgress.-error .progress-detail {
        color: $error;
    }
    TransferProgress.-done .progress-detail {
        color: $success;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rates = RateWindow()
        self.done = 0
        self.total = 0

    def compose(self) -> ComposeResult:
        with Horizontal(classes="progress-row"):
            yield Label("", classes="progress-title", markup=False)
            yield ProgressBar(show_eta=False, show_percentage=True)
        yield Static("", classes="progress-detail", markup=False)

    def on_mount(self) -> None:
        self.display = False

    def start(self, title: str, detail: str = "") -> None:
        self.rates = RateWindow()
        self.done, self.total = 0, 0
        self.remove_class("-error", "-done")
        self.query_one(".progress-title", Label).update(title)
        bar = self.query_one(ProgressBar)
        bar.update(total=None, progress=0)
        bar.display = True
        self.query_one(".progress-detail", Static).update(detail)
        self.display = True

    def update(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        bar = self.query_one(ProgressBar)
        bar.update(total=total or None, progress=done)
        self.query_one(".progress-detail", Static).update(bytes_detail(done, total, self.rates.add(done)))

    def finish(self, detail: str, *, error: bool = False, keep_bar: bool = False, title: str | None = None) -> None:
        """The task ended: one line of outcome; the bar stays (at its last value) only with `keep_bar`."""
        if title is not None:
            self.query_one(".progress-title", Label).update(title)
        self.set_class(error, "-error")
        self.set_class(not error, "-done")
        self.query_one(ProgressBar).display = keep_bar
        self.query_one(".progress-detail", Static).update(detail)

    def hide(self) -> None:
        self.display = False

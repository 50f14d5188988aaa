"""The live stats bar under the chat: decode speed with a sparkline, latency, speculation, memory."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.timer import Timer
from textual.widgets import Sparkline, Static

from sparkchat.ui.format import FINISH_LABELS, accept_text, bandwidth_text, format_bytes, format_ms

LIVE_EVERY_S = 0.5  # live numbers are redrawn at most this often (the streamed text: see streaming.RenderPacer)


class StatsBar(Vertical):
    """Two lines: speed + sparkline + latency; then speculation, memory and stop reason.

    While an answer streams, a redraw comes at most every LIVE_EVERY_S (the latest numbers win, none is
    lost): each redraw costs the UI thread CPU time that, on a small CPU, the engine would have used."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._last_live = float("-inf")
        self._pending: tuple[Any, list[float], bool] | None = None
        self._pending_timer: Timer | None = None

    def compose(self) -> ComposeResult:
        with Horizontal(id="stats-speed"):
            yield Static("", id="stats-rate")
            yield Sparkline([], id="stats-spark")
            yield Static("", id="stats-latency")
        yield Static("", id="stats-detail")

    def on_mount(self) -> None:
        self.show_idle("")

    def show_idle(self, message: str) -> None:
        """No answer shown yet: a plain line (model state, active switches)."""
        self._drop_pending()
        self.set_class(True, "-idle")
        self.query_one("#stats-rate", Static).update("")
        self.query_one("#stats-spark", Sparkline).data = []
        self.query_one("#stats-latency", Static).update("")
        self.query_one("#stats-detail", Static).update(Text(message, style="dim"))

    def show_prefill(self) -> None:
        """An answer starts: the live layout now (a change of classes restyles the bar, better done
        before the engine computes than at its first token), numbers from the first token on."""
        self._drop_pending()
        self._last_live = float("-inf")
        self.set_class(False, "-idle")
        self.set_class(True, "-live")
        self.query_one("#stats-rate", Static).update(Text.assemble(("      —", "bold"), " tok/s"))
        self.query_one("#stats-spark", Sparkline).data = []
        self.query_one("#stats-latency", Static).update("")
        self.query_one("#stats-detail", Static).update(Text("prefill…", style="dim"))

    def show(self, stats: Any, rates: Sequence[float], finish_reason: str | None = None,
             mtp_on: bool = True) -> None:
        """Live (finish_reason None) or final numbers of the current answer."""
        if finish_reason is None:
            wait = self._last_live + LIVE_EVERY_S - time.monotonic()
            if wait > 0:  # drawn a moment ago: the latest numbers wait for a later call...
                self._pending = (stats, list(rates), mtp_on)
                if self._pending_timer is None:  # ...or, failing one, for a timer a little later (its
                    # own render: the streamed text's next render usually draws them first)
                    self._pending_timer = self.set_timer(wait + LIVE_EVERY_S, self._show_pending)
                return
            self._last_live = time.monotonic()
        else:
            self._last_live = float("-inf")
        self._drop_pending()
        self._draw(stats, rates, finish_reason, mtp_on)

    def _show_pending(self) -> None:
        self._pending_timer = None
        if self._pending is not None:
            stats, rates, mtp_on = self._pending
            self._pending = None
            self._last_live = time.monotonic()
            self._draw(stats, rates, None, mtp_on)

    def _drop_pending(self) -> None:
        self._pending = None
        if self._pending_timer is not None:
            self._pending_timer.stop()
            self._pending_timer = None

    def _draw(self, stats: Any, rates: Sequence[float], finish_reason: str | None, mtp_on: bool) -> None:
        self.set_class(False, "-idle")
        self.set_class(finish_reason is None, "-live")
        rate = stats.decode_tok_s or (rates[-1] if rates else 0.0)
        # layout=False: these lines never change size, and a layout pass per refresh costs the engine
        # thread CPU time (see docs/app-overhead.md)
        self.query_one("#stats-rate", Static).update(
            Text.assemble((f"{rate:7.1f}", "bold"), " tok/s"), layout=False)
        # A leading 0 pins the sparkline's floor at 0 tok/s (it scales between the data's min and max).
        self.query_one("#stats-spark", Sparkline).data = [0.0, *rates] if rates else []
        latency = Text()
        if stats.ttft_s:
            latency.append(f"TTFT {format_ms(stats.ttft_s)}")
        if stats.prefill_tok_s:
            latency.append(f" │ prefill {stats.prefill_tok_s:,.0f} tok/s")
            reused = stats.prompt_tokens - stats.prefilled_tokens
            if reused > 0:  # the kept conversation state spared this much of the prompt
                latency.append(f" ({reused:,} of {stats.prompt_tokens:,} reused)", style="dim")
        if stats.tpot_ms:
            latency.append(f" │ TPOT {stats.tpot_ms:.1f} ms")
        latency.append(f" │ {stats.generated_tokens} tok")
        self.query_one("#stats-latency", Static).update(latency, layout=False)
        detail = Text()
        accept = accept_text(stats)
        if accept:
            detail.append("MTP ", style="bold")
            detail.append(accept)
        else:
            detail.append("MTP off" if not mtp_on else "MTP —", style="dim")
        if stats.peak_memory_bytes:
            detail.append(f" │ peak {format_bytes(stats.peak_memory_bytes)}")
        state = FINISH_LABELS.get(finish_reason, finish_reason) if finish_reason else "streaming…"
        detail.append(" │ ")
        detail.append(state, style="bold" if finish_reason is None else "")
        memory = bandwidth_text(stats)
        if memory:  # how close to the memory's limit this runs (last: a narrow terminal cuts it first)
            detail.append(f" │ {memory}")
        self.query_one("#stats-detail", Static).update(detail, layout=False)

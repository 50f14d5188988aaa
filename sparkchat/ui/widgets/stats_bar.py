"""The live stats bar under the chat: decode speed with a sparkline, latency, speculation, memory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Sparkline, Static

from sparkchat.ui.format import FINISH_LABELS, accept_text, format_bytes, format_ms


class StatsBar(Vertical):
    """Two lines: speed + sparkline + latency; then speculation, memory and stop reason."""

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
        self.set_class(True, "-idle")
        self.query_one("#stats-rate", Static).update("")
        self.query_one("#stats-spark", Sparkline).data = []
        self.query_one("#stats-latency", Static).update("")
        self.query_one("#stats-detail", Static).update(Text(message, style="dim"))

    def show(self, stats: Any, rates: Sequence[float], finish_reason: str | None = None,
             mtp_on: bool = True) -> None:
        """Live (finish_reason None) or final numbers of the current answer."""
        self.set_class(False, "-idle")
        self.set_class(finish_reason is None, "-live")
        rate = stats.decode_tok_s or (rates[-1] if rates else 0.0)
        self.query_one("#stats-rate", Static).update(
            Text.assemble((f"{rate:7.1f}", "bold"), " tok/s"))
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
        self.query_one("#stats-latency", Static).update(latency)
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
        self.query_one("#stats-detail", Static).update(detail)

"""The byte bar the commands show on stderr for long transfers (a download, a model load)."""

from __future__ import annotations

from typing import Any


def byte_bar(console: Any, description: str) -> tuple[Any, Any]:
    """(a rich Progress, its one task): bytes done of total, speed, time left. Transient: on a terminal
    the bar disappears when done, so a failure leaves only its one line."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=console, transient=True)
    return bar, bar.add_task(description, total=None)

"""What the workers post to the UI. Workers only post these; they never touch widgets."""

from __future__ import annotations

from typing import Any

from textual.message import Message

from sparkchat.engine.events import GenerationStats


class EngineReady(Message):
    """The model finished loading."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.engine = engine


class EngineFailed(Message):
    """The model could not be loaded; `error` is one line for the user."""

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class StreamChunk(Message):
    """Wake-up: the answer's StreamBuffer has new text (drain it; more may arrive before you do)."""

    def __init__(self, gen_id: int, buffer: Any) -> None:
        super().__init__()
        self.gen_id = gen_id
        self.buffer = buffer  # sparkchat.ui.streaming.StreamBuffer


class StreamDone(Message):
    """The answer ended: stop, length, cancelled or error. `text` is the whole reply."""

    def __init__(self, gen_id: int, text: str, stats: GenerationStats, finish_reason: str,
                 error: str | None = None) -> None:
        super().__init__()
        self.gen_id = gen_id
        self.text = text
        self.stats = stats
        self.finish_reason = finish_reason
        self.error = error

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


class LoadProgress(Message):
    """A model switch: `done` of `total` checkpoint bytes read."""

    def __init__(self, done: int, total: int) -> None:
        super().__init__()
        self.done = done
        self.total = total


class LoadStage(Message):
    """A model switch: the layers are in, a slower step runs (`text` says which)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class ModelsListed(Message):
    """The local models (sparkchat.hub.LocalModel), or the one-line reason they could not be listed;
    `listing` numbers the request it answers (an older listing may finish after a newer one)."""

    def __init__(self, models: list[Any], error: str | None = None, listing: int = 0) -> None:
        super().__init__()
        self.models = models
        self.error = error
        self.listing = listing


class DownloadProgress(Message):
    """Wake-up: a Hub download's byte count moved; `latest.take()` gives (done, total) as of now
    (total 0: not known yet). One is pending at a time, however often the hub reports."""

    def __init__(self, repo_id: str, latest: Any) -> None:
        super().__init__()
        self.repo_id = repo_id
        self.latest = latest  # sparkchat.ui.screens.models.Latest


class DownloadDone(Message):
    """A Hub download ended: `path` on success, else `error` (one line; cancelled ones say so)."""

    def __init__(self, repo_id: str, path: Any = None, error: str | None = None, cancelled: bool = False) -> None:
        super().__init__()
        self.repo_id = repo_id
        self.path = path
        self.error = error
        self.cancelled = cancelled


class BenchProgress(Message):
    """The bench started measuring `step` (one of `steps`, numbered from 1 as `index`)."""

    def __init__(self, step: str, index: int, steps: int) -> None:
        super().__init__()
        self.step = step
        self.index = index
        self.steps = steps


class BenchDone(Message):
    """The bench ended: a sparkchat.engine.bench.BenchResult, or one line saying why not."""

    def __init__(self, result: Any = None, source: str = "", error: str | None = None,
                 cancelled: bool = False) -> None:
        super().__init__()
        self.result = result
        self.source = source
        self.error = error
        self.cancelled = cancelled

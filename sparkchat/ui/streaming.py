"""The body of the engine worker, and how its output reaches the UI without slowing the engine.

The worker (a thread) pushes each event's text into a `StreamBuffer` (a lock and a list append) and
posts a `StreamChunk` wake-up only when the buffer goes from drained to non-empty. The UI drains the
buffer when it handles that message, when its `RenderPacer` allows, taking everything that arrived
meanwhile. So the engine never waits on the UI, the UI's queue holds at most one wake-up per answer,
and text that arrives just before the engine pauses is shown at once. The worker never touches
widgets; it also saves the partial answer every `SAVE_S`.

The pacer holds the UI thread's CPU time to a budget while a CPU engine computes: every render (the
answer's Markdown, a layout and a compositor pass) takes a core and the GIL from the engine's threads
(docs/app-overhead.md), so the next render waits until the time the last one cost is within the budget.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparkchat.engine.errors import SparkchatError
from sparkchat.engine.events import GenerationStats, SamplingParams
from sparkchat.ui.messages import StreamChunk, StreamDone

FLUSH_S = 0.05  # the UI renders streamed text at most this often
# While the engine computes on the CPU, the UI thread may use this share of one core (renders and
# everything else it does meanwhile): the next render waits until the CPU time spent since the previous
# one is within it, however long or short the answer's renders are; see docs/app-overhead.md.
CPU_RENDER_BUDGET = 0.015
MAX_FLUSH_S = 1.5  # ... but the shown text is never older than this
SAVE_S = 0.5  # how often the partial answer is written to the history
MAX_RATE_SAMPLES = 600
CANCEL_GRACE_EVENTS = 4  # events an engine may still yield after the cancel event before it is closed


def render_budget(engine: Any) -> float | None:
    """The UI thread's CPU budget while `engine` streams (a share of one core); None: no budget."""
    device = getattr(engine, "device", None)
    return CPU_RENDER_BUDGET if getattr(device, "type", None) == "cpu" else None


class RenderPacer:
    """When the UI may render streamed text next: at least `min_s` after the previous render, at most
    `max_s`, and, with a `budget`, once the UI thread's CPU time since the previous render is no more
    than `budget` of the time passed. The first text is shown at once; the CPU time from `start()`
    (mounting the answer's view) paces the render after it. Call `rendered()` on the UI thread as each
    render starts."""

    def __init__(self, budget: float | None = None, *, min_s: float = FLUSH_S, max_s: float = MAX_FLUSH_S,
                 clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self.budget, self.min_s, self.max_s = budget, min_s, max_s
        self.clock, self.cpu_clock = clock, cpu_clock
        self.renders = 0
        self._last: float | None = None
        self._last_cpu: float | None = None
        self._gap = min_s

    def start(self) -> None:
        """The answer's view is being made: what the UI spends from here counts toward the first render."""
        self._last_cpu = self.cpu_clock()

    def wait(self) -> float:
        """Seconds until the next render may start (0: now)."""
        if self._last is None:
            return 0.0
        return max(0.0, self._last + self._gap - self.clock())

    def rendered(self) -> None:
        now, cpu = self.clock(), self.cpu_clock()
        if self._last_cpu is not None and self.budget:
            # what the UI thread spent since the previous render (that render's layout and compositor
            # passes included) is what this one will cost: it must be spread over the time to the next
            self._gap = min(max((cpu - self._last_cpu) / self.budget, self.min_s), self.max_s)
        self._last, self._last_cpu = now, cpu
        self.renders += 1


class StreamBuffer:
    """Text and the latest stats from the worker, waiting for the UI to take them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: list[str] = []
        self._stats: GenerationStats | None = None
        self._wake_pending = False

    def push(self, text: str, stats: GenerationStats) -> bool:
        """Add an event's text; True when the UI must be woken (nothing was waiting for it yet)."""
        with self._lock:
            if text:
                self._parts.append(text)
            self._stats = stats
            if self._wake_pending:
                return False
            self._wake_pending = True
            return True

    def take(self) -> tuple[str, GenerationStats | None]:
        """Everything pushed since the last take, and a snapshot of the latest stats."""
        with self._lock:
            text = "".join(self._parts)
            self._parts.clear()
            stats = copy.deepcopy(self._stats) if self._stats is not None else None
            self._wake_pending = False
        return text, stats


class RateMeter:
    """Decode tok/s samples over an answer, one per UI refresh: tokens over the engine's own decode time
    since the previous sample (wall time when the engine reports none)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.samples: list[float] = []
        self._t: float | None = None
        self._tokens = 0
        self._decode_s = 0.0

    def update(self, stats: GenerationStats) -> None:
        now = self.clock()
        if self._t is None:
            if stats.generated_tokens:
                self._t, self._tokens, self._decode_s = now, stats.generated_tokens, stats.decode_s
            return
        new_tokens = stats.generated_tokens - self._tokens
        if new_tokens <= 0:
            return
        spent = stats.decode_s - self._decode_s if stats.decode_s > self._decode_s else now - self._t
        if spent > 0:
            self.samples.append(new_tokens / spent)
            del self.samples[:-MAX_RATE_SAMPLES]
            self._t, self._tokens, self._decode_s = now, stats.generated_tokens, stats.decode_s


@dataclass
class Job:
    gen_id: int
    engine: Any
    messages: list[dict[str, str]]
    params: SamplingParams
    thinking: bool
    cancel: threading.Event = field(default_factory=threading.Event)
    buffer: StreamBuffer = field(default_factory=StreamBuffer)
    reset: bool = False  # drop the engine's kept state first (another conversation)


SaveFn = Callable[..., None]  # save(content, stats=None, status=None)


def run_job(job: Job, post: Callable[[Any], Any], save: SaveFn, *, is_cancelled: Callable[[], bool] = lambda: False,
            clock: Callable[[], float] = time.monotonic, save_s: float = SAVE_S) -> str:
    """Generate one answer. Returns the finish reason ('stop', 'length', 'cancelled' or 'error')."""
    parts: list[str] = []
    stats = GenerationStats()
    finish: str | None = None
    error: str | None = None
    last_save = clock()
    events = None
    save_error: list[str] = []

    def safe_save(*args: Any, **kwargs: Any) -> None:
        try:
            save(*args, **kwargs)
        except Exception as exc:  # a full disk or a locked database must not end the answer
            save_error.append(f"history not saved: {exc}")

    try:
        if job.reset:
            job.engine.reset()
        events = job.engine.generate(job.messages, job.params, enable_thinking=job.thinking, cancel=job.cancel)
        after_cancel = 0
        for event in events:
            stats = event.stats
            if event.text:
                parts.append(event.text)
            finish = event.finish_reason
            if finish is not None:
                break
            if job.buffer.push(event.text, stats):
                post(StreamChunk(job.gen_id, job.buffer))
            if job.cancel.is_set():
                # The engine sees the same event and ends with its own "cancelled" step, leaving its kept
                # state whole; only one that does not is closed from here.
                after_cancel += 1
                if after_cancel > CANCEL_GRACE_EVENTS:
                    finish = "cancelled"
                    break
            if is_cancelled():  # the app is closing
                finish = "cancelled"
                break
            now = clock()
            if now - last_save >= save_s:
                safe_save("".join(parts))
                last_save = now
    except SparkchatError as exc:
        error = str(exc)
    except Exception as exc:  # the UI must survive any engine failure and say what it was
        error = f"{type(exc).__name__}: {exc}"
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                pass
    if error is not None:
        finish = "error"
    elif finish is None:
        finish = "cancelled" if job.cancel.is_set() else "stop"
    text = "".join(parts)
    final_stats = copy.deepcopy(stats)
    status = "complete" if finish in ("stop", "length") else "interrupted"
    safe_save(text, stats={**final_stats.to_dict(), "finish_reason": finish}, status=status)
    if error is None and save_error:
        error = save_error[-1]
    post(StreamDone(job.gen_id, text, final_stats, finish, error))
    return finish

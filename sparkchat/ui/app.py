"""The terminal app: `SparkchatApp` and `run_app`, the function `sparkchat` (no subcommand) calls.

The engine is injected: an already loaded one, or a factory run in a thread worker at start (the app
shows "loading…" meanwhile, and "no model loaded" with neither). Modes: chat (the one the app starts in),
models (local models, Hub downloads, switching model) and bench (the optimization table measured here);
settings, help and dialogs are pushed on top.

One piece of work holds the engine at a time: an answer, a bench run or a model load
(`engine_busy` says which); the others wait or are refused with that reason.
"""

from __future__ import annotations

import gc
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from sparkchat.engine.errors import SparkchatError
from sparkchat.history import History
from sparkchat.ui import prefs as prefs_mod
from sparkchat.ui.messages import EngineFailed, EngineReady, LoadProgress, LoadStage
from sparkchat.ui.screens.bench import BenchScreen
from sparkchat.ui.screens.chat import ChatScreen
from sparkchat.ui.screens.models import ModelsScreen

# () or (progress=callback(bytes_read, bytes_total), stage=callback(text)), either keyword optional -> engine
EngineFactory = Callable[..., Any]
ENGINE_SWITCH_INTERVAL_S = 0.001


class SparkchatApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "sparkchat"
    MODES = {"chat": ChatScreen, "models": ModelsScreen, "bench": BenchScreen}
    DEFAULT_MODE = "chat"
    BINDINGS = [
        Binding("f1", "help", "Help"),
        Binding("f3", "switch_mode('models')", "Models"),
        Binding("f4", "switch_mode('bench')", "Bench"),
    ]

    def __init__(self, engine: Any | None = None, *, engine_factory: EngineFactory | None = None,
                 history: History | None = None, settings_path: str | os.PathLike[str] | None = None,
                 model_label: str | None = None, no_model_reason: str | None = None, device: str = "auto",
                 dtype: str = "auto", max_context: int = 8192) -> None:
        super().__init__()
        self.engine = engine
        self.engine_factory = engine_factory
        self.engine_status = "ready" if engine is not None else ("loading" if engine_factory else "none")
        self.engine_error: str | None = None
        self.model_label = model_label
        self.no_model_reason = no_model_reason  # shown when there is no engine (e.g. "not downloaded yet")
        self.history = history if history is not None else History()
        self.settings_path = Path(settings_path) if settings_path is not None else None  # None: the user's file
        self.prefs = prefs_mod.load(self.settings_path)
        self.chat_screen: ChatScreen | None = None
        self.models_screen: ModelsScreen | None = None
        self.bench_screen: BenchScreen | None = None
        self.load_options = {"device": device, "dtype": dtype, "max_context": max_context}  # for model switches
        self.model_dir: Path | None = None  # the folder being loaded or loaded, when the app loaded it
        self.load_progress: tuple[int, int] | None = None  # (bytes read, bytes to read) while loading
        self.load_stage: str | None = None  # the slow step after the layers, while it runs
        self.bench_running = False
        self._default_after_load: str | None = None  # the `model` setting to save once a switch has loaded
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkchat-engine")

    def on_mount(self) -> None:
        if self.prefs.load_error:
            self.notify(f"{self.prefs.load_error}. Using default settings; fix the file to keep changes.",
                        title="Settings not read", severity="warning", timeout=10)
        if self.prefs.theme in self.available_themes:
            self.theme = self.prefs.theme
        if self.engine is not None:
            self.apply_switches()
        elif self.engine_factory is not None:
            self._load_engine()

    def watch_theme(self, theme: str) -> None:
        if theme != self.prefs.theme:
            self.prefs.theme = theme
            self.save_prefs()

    def save_prefs(self) -> None:
        try:
            prefs_mod.save(self.prefs, self.settings_path)
        except SparkchatError as exc:  # SettingsError: an unreadable file is never overwritten
            self.notify(str(exc), title="Settings not saved", severity="error")

    # -- engine --------------------------------------------------------------------------------------

    def on_engine_thread(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run `fn` on the app's one engine thread and return its result; call it from a thread worker.

        Every engine call (load, answers, bench) runs on this same thread. PyTorch's CPU ops run on an
        OpenMP team that belongs to the calling thread; with a second calling thread there are two teams,
        and OpenMP, seeing more threads than cores, stops spinning between the many small ops of a decode
        step (3× slower on 2 cores, see docs/app-overhead.md)."""
        return self._engine_thread.submit(fn, *args, **kwargs).result()

    def on_unmount(self) -> None:
        self._engine_thread.shutdown(wait=False, cancel_futures=True)

    @work(thread=True, group="load", exit_on_error=False)
    def _load_engine(self) -> None:
        assert self.engine_factory is not None
        factory = self.engine_factory

        def load() -> Any:
            _release_memory()  # a model being replaced is gone only once collected
            engine = _call_factory(factory, lambda done, total: self.post_message(LoadProgress(done, total)),
                                   lambda text: self.post_message(LoadStage(text)))
            gc.collect()  # the load's own garbage goes now, before on_engine_ready freezes what is left
            return engine

        try:
            engine = self.on_engine_thread(load)
        except SparkchatError as exc:
            self.post_message(EngineFailed(str(exc)))
        except Exception as exc:  # show it instead of crashing the app
            self.post_message(EngineFailed(f"{type(exc).__name__}: {exc}"))
        else:
            self.post_message(EngineReady(engine))

    def apply_switches(self) -> None:
        """Hand the saved switches to the engine; it applies them at the next answer, no reload."""
        if self.engine is None:
            return
        try:
            self.engine.set_switches(self.prefs.switches)
        except (ValueError, SparkchatError) as exc:
            self.notify(f"Switches not applied: {exc}", severity="error")

    @property
    def demo_model(self) -> bool:
        """Whether the model loaded (or loading) is the small built-in demo."""
        from sparkchat.cli.resolve import is_demo

        path = getattr(self.engine, "model_dir", None) if self.engine is not None else self.model_dir
        return is_demo(path)

    def on_engine_ready(self, message: EngineReady) -> None:
        # The model's Python objects live as long as the engine: frozen, full garbage collections skip
        # them (one took ~150 ms of the UI thread at the first prompt); thawed again before a switch.
        gc.freeze()
        self.engine = message.engine
        self.engine_status = "ready"
        self.engine_error = None
        self.load_progress = None
        self.load_stage = None
        self.apply_switches()
        default, self._default_after_load = self._default_after_load, None
        if default is not None and self._save_default_model(default):
            self.notify(f"{self.engine.name} loaded; sparkchat opens it from now on", timeout=4)
        else:
            self.notify(f"{self.engine.name} loaded", timeout=3)
        self._engine_changed()

    def _save_default_model(self, model: str) -> bool:
        try:
            prefs_mod.save_default_model(model, self.settings_path)
        except SparkchatError as exc:  # SettingsError: an unreadable file is never overwritten
            self.notify(str(exc), title="Default model not saved", severity="error")
            return False
        return True

    def on_engine_failed(self, message: EngineFailed) -> None:
        self.engine_status = "failed"
        self.engine_error = message.error
        self.load_progress = None
        self.load_stage = None
        self._default_after_load = None
        self.notify(message.error, title="Model not loaded", severity="error", timeout=10)
        self._engine_changed()

    def on_load_progress(self, message: LoadProgress) -> None:
        if self.engine_status != "loading":
            return
        self.load_progress = (message.done, message.total)
        if self.models_screen is not None:
            self.models_screen.load_progress_changed()
        if self.chat_screen is not None and self.chat_screen.is_attached:
            self.chat_screen.refresh_state()

    def on_load_stage(self, message: LoadStage) -> None:
        if self.engine_status != "loading":
            return
        self.load_stage = message.text
        self._engine_changed()

    def _engine_changed(self) -> None:
        for screen in (self.chat_screen, self.models_screen, self.bench_screen):
            if screen is not None and screen.is_attached:
                screen.engine_changed()

    def engine_busy(self) -> str | None:
        """Why the engine cannot take other work now, in a few words; None when it can."""
        if self.engine_status == "loading":
            return "a model is loading"
        if self.chat_screen is not None and self.chat_screen.generating:
            return "still answering in the chat (Esc there stops it)"
        if self.bench_running:
            return "the bench is running"
        return None

    def switch_model(self, model_dir: str | os.PathLike[str], label: str, *, setting: str | None = None) -> bool:
        """Unload the engine and load `model_dir` in its place (same device, dtype and context), in the
        background; LoadProgress reports the bytes read. Once it has loaded, it becomes the default model
        (the settings' `model`: `setting` when given, e.g. a Hub repo id, else the folder). False (and a
        notice) when the engine is busy."""
        busy = self.engine_busy()
        if busy:
            self.notify(f"Cannot switch model now: {busy}.", severity="warning")
            return False
        path = Path(model_dir)
        self._default_after_load = setting if setting is not None else str(path.expanduser().resolve())
        self.engine = None  # dropped before loading: two large models do not fit side by side
        self.engine_status = "loading"
        self.engine_error = None
        self.model_label = label
        self.model_dir = path
        self.load_progress = None
        self.load_stage = None
        self.engine_factory = engine_loader(path, **self.load_options)
        self._engine_changed()
        self._load_engine()
        return True

    # -- actions and the command palette -------------------------------------------------------------

    def action_help(self) -> None:
        from sparkchat.ui.screens.help import HelpScreen

        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        chat = self.chat_screen
        yield SystemCommand("Help", "Every key of sparkchat (f1)", self.action_help)
        yield SystemCommand("Models", "Local models, download from the Hub, switch model (f3)",
                            lambda: self.switch_mode("models"))
        yield SystemCommand("Bench", "Measure baseline → +MXFP4 → +FP8 head → +MTP here (f4)",
                            lambda: self.switch_mode("bench"))
        yield SystemCommand("Chat", "Back to the conversation", lambda: self.switch_mode("chat"))
        if chat is None:
            return
        yield SystemCommand("New chat", "Start an empty conversation (ctrl+n)", chat.action_new_chat)
        yield SystemCommand("Settings", "Optimizations, sampling, system prompt, thinking (f2)", chat.action_settings)
        yield SystemCommand("History", "Show or hide past chats (ctrl+b)", chat.action_toggle_history)
        yield SystemCommand("Regenerate", "Answer the last prompt again (ctrl+r)", chat.action_regenerate)
        yield SystemCommand("Edit last prompt", "Bring the last prompt back to edit and resend (↑)",
                            chat.action_edit_last)
        yield SystemCommand("Stop", "Stop the answer being generated (esc)", chat.action_stop)
        yield SystemCommand("Copy answer", "Copy the last answer (ctrl+o)", chat.action_copy_answer)
        yield SystemCommand("Copy code block", "Copy the last code block (ctrl+l)", chat.action_copy_code)
        yield SystemCommand("Export chat", "Save this chat as Markdown", chat.action_export)


def run_app(model_dir: str | os.PathLike[str] | None = None, *, engine: Any | None = None, device: str = "auto",
            dtype: str = "auto", max_context: int = 8192, no_model_reason: str | None = None) -> int:
    """Open the terminal app. With `model_dir`, the engine loads in the background while the app starts;
    with neither `model_dir` nor `engine`, the app opens in its "no model loaded" state, showing
    `no_model_reason` (one line, e.g. how to download the model) when given."""
    factory: EngineFactory | None = None
    if engine is None and model_dir is not None:
        factory = engine_loader(Path(model_dir), device=device, dtype=dtype, max_context=max_context)

    history = History()
    try:
        with engine_thread_settings():
            app = SparkchatApp(engine, engine_factory=factory, history=history,
                               model_label=Path(model_dir).name if model_dir is not None else None,
                               no_model_reason=no_model_reason, device=device, dtype=dtype,
                               max_context=max_context)
            if factory is not None:
                app.model_dir = Path(model_dir)
            app.run()
    finally:
        history.close()
    return app.return_code or 0


@contextmanager
def engine_thread_settings() -> Iterator[None]:
    """Process settings for an engine that runs beside the UI (run_app uses them; so does
    benchmarks/app_overhead.py, to measure the app as users run it)."""
    # The engine thread gives the GIL back to the UI thread and takes it again on every step; a short
    # switch interval lets it take it back sooner while the UI renders (the default is 5 ms).
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(switch_interval)


def engine_loader(path: Path, *, device: str = "auto", dtype: str = "auto", max_context: int = 8192) -> EngineFactory:
    """A factory that loads the model in `path`, reporting bytes read to `progress` and slow steps to `stage`."""
    def load(progress: Callable[[int, int], None] | None = None, stage: Callable[[str], None] | None = None) -> Any:
        from sparkchat.engine import Engine  # torch loads here, inside the worker

        return Engine.load(path, device=device, dtype=dtype, max_context=max_context, progress=progress,
                           stage=stage)

    return load


def _call_factory(factory: EngineFactory, progress: Callable[[int, int], None],
                  stage: Callable[[str], None]) -> Any:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    given = {"progress": progress, "stage": stage}
    return factory(**{name: fn for name, fn in given.items() if name in params})


def _release_memory() -> None:
    """Collect a dropped engine now, and give its GPU memory back to the device."""
    gc.unfreeze()  # the old model's objects were frozen when it loaded
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()

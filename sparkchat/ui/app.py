"""The terminal app: `SparkchatApp` and `run_app`, the function `sparkchat` (no subcommand) calls.

The engine is injected: an already loaded one, or a factory run in a thread worker at start (the app
shows "loading…" meanwhile, and "no model loaded" with neither). Screens: chat (the mode the app starts
in), settings, help and dialogs pushed on top; later screens (models, bench) add a mode or a push.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from sparkchat.engine.errors import SparkchatError
from sparkchat.history import History
from sparkchat.ui import prefs as prefs_mod
from sparkchat.ui.messages import EngineFailed, EngineReady
from sparkchat.ui.screens.chat import ChatScreen

EngineFactory = Callable[[], Any]
ENGINE_SWITCH_INTERVAL_S = 0.001


class SparkchatApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "sparkchat"
    MODES = {"chat": ChatScreen}
    DEFAULT_MODE = "chat"
    BINDINGS = [Binding("f1", "help", "Help")]

    def __init__(self, engine: Any | None = None, *, engine_factory: EngineFactory | None = None,
                 history: History | None = None, settings_path: str | os.PathLike[str] | None = None,
                 model_label: str | None = None, no_model_reason: str | None = None) -> None:
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

    @work(thread=True, group="load", exit_on_error=False)
    def _load_engine(self) -> None:
        assert self.engine_factory is not None
        try:
            engine = self.engine_factory()
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

    def on_engine_ready(self, message: EngineReady) -> None:
        self.engine = message.engine
        self.engine_status = "ready"
        self.engine_error = None
        self.apply_switches()
        self.notify(f"{self.engine.name} loaded", timeout=3)
        if self.chat_screen is not None:
            self.chat_screen.engine_changed()

    def on_engine_failed(self, message: EngineFailed) -> None:
        self.engine_status = "failed"
        self.engine_error = message.error
        self.notify(message.error, title="Model not loaded", severity="error", timeout=10)
        if self.chat_screen is not None:
            self.chat_screen.engine_changed()

    # -- actions and the command palette -------------------------------------------------------------

    def action_help(self) -> None:
        from sparkchat.ui.screens.help import HelpScreen

        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        chat = self.chat_screen
        yield SystemCommand("Help", "Every key of sparkchat (f1)", self.action_help)
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
        path = Path(model_dir)

        def load() -> Any:
            from sparkchat.engine import Engine  # torch loads here, inside the worker

            return Engine.load(path, device=device, dtype=dtype, max_context=max_context)

        factory = load

    history = History()
    # The engine thread gives the GIL back to the UI thread and takes it again on every step; a short
    # switch interval lets it take it back sooner while the UI renders (the default is 5 ms).
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
    try:
        app = SparkchatApp(engine, engine_factory=factory, history=history,
                           model_label=Path(model_dir).name if model_dir is not None else None,
                           no_model_reason=no_model_reason)
        app.run()
    finally:
        sys.setswitchinterval(switch_interval)
        history.close()
    return app.return_code or 0

"""The models screen: local models and whether they fit, Hub downloads with byte progress, switching model.

Listing, downloading and deleting run in thread workers that only post messages (ModelsListed,
DownloadProgress, DownloadDone); loading goes through the app's own loader (`SparkchatApp.switch_model`),
which reports the bytes read as LoadProgress. A download goes on while other screens are shown; a cancel sets
its event and the hub stops at the next chunk (finished files stay in the cache).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Header, Input, Label, Static

from sparkchat.engine.errors import SparkchatError
from sparkchat.ui.messages import DownloadDone, DownloadProgress, ModelsListed
from sparkchat.ui.screens.dialogs import ConfirmScreen
from sparkchat.ui.widgets.progress import TransferProgress, format_size

if TYPE_CHECKING:
    from sparkchat.ui.app import SparkchatApp

SUGGESTED_REPO = "inclusionAI/Ling-3.0-flash-fp4"


class ModelTable(DataTable[Any]):
    """The local models; keys act on the highlighted one."""

    BINDINGS = [
        Binding("enter", "select_cursor", "Load model"),
        Binding("d,delete", "delete_model", "Delete model"),
        Binding("r,f5", "refresh_models", "Refresh list"),
    ]

    def action_delete_model(self) -> None:
        self.screen.action_delete_model()  # type: ignore[attr-defined]

    def action_refresh_models(self) -> None:
        self.screen.refresh_models()  # type: ignore[attr-defined]


class Latest:
    """The newest (done, total) from the download threads, waiting for the UI. `put` says when to post
    a wake-up (none is pending yet); `take` clears it. So the UI always shows the latest figures and its
    queue never holds more than one DownloadProgress, however fast chunks arrive."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = (0, 0)
        self._pending = False

    def put(self, done: int, total: int) -> bool:
        with self._lock:
            self._value = (done, total)
            if self._pending:
                return False
            self._pending = True
            return True

    def take(self) -> tuple[int, int]:
        with self._lock:
            self._pending = False
            return self._value


class ModelsScreen(Screen[None]):
    CSS_PATH = "models.tcss"
    BINDINGS = [
        Binding("escape", "back", "Back to chat"),
        Binding("ctrl+x", "cancel_download", "Cancel download", priority=True),
    ]

    app: SparkchatApp

    def __init__(self) -> None:
        super().__init__()
        self.models: list[Any] = []  # sparkchat.hub.LocalModel
        self.list_error: str | None = None
        self.listing = True  # until the first list arrives
        self.listings = 0  # listings requested so far: only the latest one's answer is shown
        self.download_repo: str | None = None
        self.download_cancel: threading.Event | None = None
        self._select_after_list: Path | None = None

    # -- layout and state ----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="⚡")
        with Vertical(id="models-main"):
            with Horizontal(classes="models-section-row"):
                yield Label("Local models", classes="models-section")
                yield Label("enter loads · d deletes · r refreshes", classes="models-hint")
            yield ModelTable(id="model-table", cursor_type="row", zebra_stripes=True)
            yield Static("", id="model-detail", markup=False)
            yield TransferProgress(id="load-progress")
            with Horizontal(classes="models-section-row"):
                yield Label("Download from the Hugging Face Hub", classes="models-section")
                yield Label("safetensors, configs and tokenizer only · resumable", classes="models-hint")
            with Horizontal(id="download-row"):
                yield Input(placeholder=f"owner/name, e.g. {SUGGESTED_REPO}", id="repo-id")
                yield Button("Download", variant="primary", id="download", compact=True)
                yield Button("Cancel  ^x", id="cancel-download", compact=True, disabled=True)
            yield TransferProgress(id="download-progress")
            yield Static("", id="download-error", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.app.models_screen = self
        self.title = "Models"
        table = self.query_one(ModelTable)
        table.add_column("", key="mark", width=1)
        for label, key in (("Name", "name"), ("Size", "size"), ("Format", "format"), ("MTP", "mtp"),
                           ("Fits here", "fits")):
            table.add_column(label, key=key)
        self.query_one("#download-error").display = False
        self.engine_changed()
        self.refresh_models()
        table.focus()

    def on_screen_resume(self) -> None:
        if not self.listing and self.download_repo is None:
            self.refresh_models()

    def on_unmount(self) -> None:
        if self.download_cancel is not None:
            self.download_cancel.set()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "cancel_download":
            return self.download_repo is not None and not self.download_cancel.is_set()  # type: ignore[union-attr]
        return True

    def engine_changed(self) -> None:
        """The app's engine or its status changed: the sub-title, the load bar and the loaded mark."""
        app = self.app
        engine = app.engine
        if engine is not None:
            self.sub_title = f"{engine.name} loaded"
        else:
            stage = f" {app.load_stage}" if app.load_stage else ""
            self.sub_title = {"loading": f"loading {app.model_label or 'the model'}…{stage}",
                              "failed": "model failed to load"}.get(app.engine_status, "no model loaded")
        bar = self.query_one("#load-progress", TransferProgress)
        if app.engine_status == "loading":
            if not bar.display or bar.has_class("-done") or bar.has_class("-error"):
                bar.start(f"Loading {app.model_label or 'the model'}", "reading the weights…")
            self.load_progress_changed()
        elif app.engine_status == "failed" and bar.display:
            bar.finish(f"{app.engine_error}", error=True, title=f"Could not load {app.model_label or 'the model'}")
        elif app.engine_status == "ready" and bar.display and engine is not None:
            bar.finish("esc goes back to the chat", title=f"{engine.name} loaded")
        self._fill_table()

    def load_progress_changed(self) -> None:
        if self.app.load_progress is not None:
            self.query_one("#load-progress", TransferProgress).update(*self.app.load_progress)

    # -- the list ------------------------------------------------------------------------------------

    def refresh_models(self) -> None:
        self.listing = True
        self.listings += 1
        loaded = self._loaded_path()
        # the folder the loaded model came from is listed too (it may hold others beside it)
        self._list_models([loaded.parent] if loaded is not None else [], self.listings)

    @work(thread=True, group="list-models", exclusive=True, exit_on_error=False)
    def _list_models(self, extra_dirs: list[Path], listing: int) -> None:
        from sparkchat import hub

        try:
            models = _unique(hub.list_local_models(extra_dirs=extra_dirs))
        except SparkchatError as exc:
            self.post_message(ModelsListed([], str(exc), listing))
        except Exception as exc:  # an odd cache layout must not close the screen
            self.post_message(ModelsListed([], f"{type(exc).__name__}: {exc}", listing))
        else:
            self.post_message(ModelsListed(models, listing=listing))

    def on_models_listed(self, message: ModelsListed) -> None:
        if message.listing != self.listings:
            # a listing that a newer one replaced (a thread worker runs on after its cancel): its models
            # may predate a delete or a download, so it must not land after the newer list
            return
        self.listing = False
        self.models = message.models
        self.list_error = message.error
        self._fill_table()

    def _loaded_path(self) -> Path | None:
        app = self.app
        if app.engine is not None:
            path = getattr(app.engine, "model_dir", None)
        else:
            path = app.model_dir if app.engine_status == "loading" else None
        return _resolved(path) if path is not None else None

    def _is_loaded(self, model: Any) -> bool:
        loaded = self._loaded_path()
        return loaded is not None and _resolved(model.path) == loaded

    def _fill_table(self) -> None:
        table = self.query_one(ModelTable)
        keep = self._highlighted_path()
        if self._select_after_list is not None:
            keep, self._select_after_list = self._select_after_list, None
        table.clear()
        table.display = bool(self.models)
        loaded = next((m for m in self.models if self._is_loaded(m)), None)
        for i, m in enumerate(self.models):
            is_loaded = m is loaded
            mark = Text("●", style=f"bold {self._color('success')}") if is_loaded else Text("")
            if is_loaded and self.app.engine_status == "loading":
                mark = Text("…", style=f"bold {self._color('warning')}")
            table.add_row(mark, Text(m.name, style="bold" if is_loaded else ""), Text(format_size(m.size),
                          justify="right"), Text(m.weight_format), Text(_yes_no(m.has_mtp)), self._fits_text(m, loaded),
                          key=str(i))
        if keep is None and loaded is not None:
            keep = _resolved(loaded.path)
        if keep is not None:
            for i, m in enumerate(self.models):
                if _resolved(m.path) == keep:
                    table.move_cursor(row=i)
        self._show_detail()

    def _fits_text(self, m: Any, loaded: Any) -> Text:
        if m.fits:
            return Text("yes", style=self._color("success"))
        # The memory probe counts the loaded model as used; switching frees it first.
        freed = loaded.resident_bytes if loaded is not None and loaded is not m else 0
        if freed and m.resident_bytes <= m.available_bytes + freed:
            return Text("yes, in place of the loaded model", style=self._color("success"))
        free = f"{format_size(m.available_bytes + freed)} once the loaded one is out" if freed else \
            f"{format_size(m.available_bytes)} free"
        return Text(f"no: needs {format_size(m.resident_bytes)}, {free}", style=self._color("error"))

    def _color(self, name: str) -> str:
        return self.app.theme_variables.get(name, "")

    def _highlighted(self) -> Any | None:
        table = self.query_one(ModelTable)
        if not self.models or table.row_count == 0:
            return None
        row = table.cursor_row
        return self.models[row] if 0 <= row < len(self.models) else None

    def _highlighted_path(self) -> Path | None:
        m = self._highlighted()
        return _resolved(m.path) if m is not None else None

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_detail()

    def _show_detail(self) -> None:
        detail = self.query_one("#model-detail", Static)
        if self.list_error:
            detail.update(f"Could not list the local models: {self.list_error}")
            detail.add_class("-error")
            return
        detail.remove_class("-error")
        if not self.models:
            detail.update("listing…" if self.listing else
                          f"No local models yet: download one below (e.g. {SUGGESTED_REPO}).")
            return
        m = self._highlighted()
        if m is None:
            detail.update("")
            return
        where = "Hugging Face cache" if m.source == "hf-cache" else "local folder"
        rev = f" @ {m.revision[:12]}" if m.revision else ""
        detail.update(f"{m.path}\n{where}{rev} · needs about {format_size(m.resident_bytes)} of memory, "
                      f"{format_size(m.available_bytes)} available now")

    # -- load ----------------------------------------------------------------------------------------

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_load_model()

    def action_load_model(self) -> None:
        m = self._highlighted()
        if m is None:
            return
        if self._is_loaded(m) and self.app.engine_status in ("ready", "loading"):
            self.notify(f"{m.name} is already {'loaded' if self.app.engine_status == 'ready' else 'loading'}.",
                        timeout=3)
            return
        busy = self.app.engine_busy()
        if busy:
            self.notify(f"Cannot switch model now: {busy}.", severity="warning")
            return
        loaded = next((x for x in self.models if self._is_loaded(x)), None)
        freed = loaded.resident_bytes if loaded is not None and self.app.engine is not None else 0
        if m.resident_bytes > m.available_bytes + freed:
            question = (f"{m.name} needs about {format_size(m.resident_bytes)} of memory and "
                        f"{format_size(m.available_bytes + freed)} would be free. Load it anyway?")
            self.app.push_screen(ConfirmScreen(question, yes="Load"),
                                 lambda yes: self._switch(m) if yes else None)
            return
        self._switch(m)

    def _switch(self, m: Any) -> None:
        # the default from now on: a Hub download by its repo id (its newest snapshot), others by folder
        setting = m.name if m.source == "hf-cache" and "@" not in m.name else None
        if self.app.switch_model(m.path, m.name.split("/")[-1], setting=setting):
            self._fill_table()

    # -- delete --------------------------------------------------------------------------------------

    def action_delete_model(self) -> None:
        m = self._highlighted()
        if m is None:
            return
        if self._is_loaded(m) and self.app.engine_status in ("ready", "loading"):
            self.notify(f"{m.name} is in use: load another model first.", severity="warning")
            return

        def answer(yes: bool | None) -> None:
            if yes:
                self._delete(m)

        self.app.push_screen(ConfirmScreen(f"Delete {m.name} ({format_size(m.size)}) from disk?"), answer)

    @work(thread=True, group="delete-model", exit_on_error=False)
    def _delete(self, m: Any) -> None:
        from sparkchat import hub

        try:
            _, freed = hub.remove_model(m.path)
        except SparkchatError as exc:
            self.app.call_from_thread(self.notify, str(exc), title="Not deleted", severity="error")
        else:
            self.app.call_from_thread(self.notify, f"Deleted {m.name}, {format_size(freed)} freed", timeout=4)
        self.app.call_from_thread(self.refresh_models)

    # -- download ------------------------------------------------------------------------------------

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "repo-id":
            event.stop()
            self.start_download(event.value)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "download":
            self.start_download(self.query_one("#repo-id", Input).value)
        elif event.button.id == "cancel-download":
            self.action_cancel_download()

    def start_download(self, repo_id: str) -> bool:
        repo_id = repo_id.strip() or SUGGESTED_REPO
        if self.download_repo is not None:
            self.notify(f"Still downloading {self.download_repo}; cancel it first.", severity="warning")
            return False
        self.query_one("#repo-id", Input).value = repo_id
        self.download_repo = repo_id
        self.download_cancel = threading.Event()
        self._show_download_error(None)
        self.query_one("#download-progress", TransferProgress).start(repo_id, "asking the Hub for the file list…")
        self._set_download_buttons()
        self._download(repo_id, self.download_cancel)
        return True

    @work(thread=True, group="download", exit_on_error=False)
    def _download(self, repo_id: str, cancel: threading.Event) -> None:
        from sparkchat import hub

        latest = Latest()

        def progress(done: int, total: int) -> None:  # called from the hub's download threads
            if latest.put(done, total):
                self.post_message(DownloadProgress(repo_id, latest))

        try:
            path = hub.download(repo_id, progress=progress, cancel=cancel, endpoint=_endpoint())
        except SparkchatError as exc:
            self.post_message(DownloadDone(repo_id, error=str(exc), cancelled=cancel.is_set()))
        except Exception as exc:  # the hub client can raise almost anything; one line is enough
            self.post_message(DownloadDone(repo_id, error=_one_line(f"{type(exc).__name__}: {exc}")))
        else:
            self.post_message(DownloadDone(repo_id, path=path))

    def on_download_progress(self, message: DownloadProgress) -> None:
        if message.repo_id == self.download_repo:
            self.query_one("#download-progress", TransferProgress).update(*message.latest.take())

    def on_download_done(self, message: DownloadDone) -> None:
        if message.repo_id != self.download_repo:
            return
        bar = self.query_one("#download-progress", TransferProgress)
        self.download_repo = None
        self.download_cancel = None
        self._set_download_buttons()
        if message.path is not None:
            got = f"{format_size(bar.done)} downloaded" if bar.done else "already downloaded"
            bar.finish(f"{message.repo_id}: {got} · enter loads it", keep_bar=bar.done > 0)
            self._select_after_list = _resolved(Path(message.path))
            self.refresh_models()
            self.query_one(ModelTable).focus()
        elif message.cancelled:
            bar.finish("cancelled · finished files are kept; download again to continue", error=True)
        else:
            bar.hide()
            self._show_download_error(message.error)

    def action_cancel_download(self) -> None:
        if self.download_cancel is not None:
            self.download_cancel.set()
            self.query_one("#cancel-download", Button).disabled = True
            self.refresh_bindings()

    def _set_download_buttons(self) -> None:
        running = self.download_repo is not None
        self.query_one("#download", Button).disabled = running
        self.query_one("#cancel-download", Button).disabled = not running
        self.refresh_bindings()

    def _show_download_error(self, error: str | None) -> None:
        line = self.query_one("#download-error", Static)
        line.update(_one_line(error or ""))
        line.display = bool(error)

    def action_back(self) -> None:
        self.app.switch_mode("chat")


def _resolved(path: Any) -> Path:
    try:
        return Path(path).expanduser().resolve()
    except OSError:
        return Path(path)


def _unique(models: list[Any]) -> list[Any]:
    """One entry per folder (the loaded model's folder may also be sparkchat's models folder)."""
    seen: set[Path] = set()
    out = []
    for m in models:
        key = _resolved(m.path)
        if key not in seen:
            seen.add(key)
            out.append(m)
    return out


def _yes_no(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "no")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _endpoint() -> str | None:
    """The Hub mirror from the settings file, if one is set (HF_ENDPOINT otherwise)."""
    from sparkchat.settings import SettingsError, load_settings

    try:
        return load_settings().hub_endpoint or None
    except SettingsError:
        return None

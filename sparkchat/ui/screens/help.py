"""Every key of the app, built from the bindings themselves so it cannot drift."""

from __future__ import annotations

from collections.abc import Iterable

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

# Keys that are not bindings (handled in key handlers or by the mouse).
EXTRA_KEYS = {
    "Anywhere": [("Ctrl+P", "Command palette (actions, themes)"), ("Ctrl+Q", "Quit")],
    "Prompt": [("Enter", "Send")],
    "Messages": [("click ⧉ copy", "Copy the message"), ("click a code block", "Copy that code block")],
    "Models": [("Enter", "Download (in the repo field)")],
}


def key_label(keys: str) -> str:
    """'ctrl+j,shift+enter' -> 'Ctrl+J / Shift+Enter'."""
    def one(key: str) -> str:
        parts = key.split("+")
        *mods, last = parts
        name = last.upper() if len(last) == 1 else last.capitalize()
        return "+".join([m.capitalize() for m in mods] + [name])

    return " / ".join(one(k.strip()) for k in keys.split(","))


def binding_rows(bindings: Iterable[BindingType]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for binding in bindings:
        if not isinstance(binding, Binding):
            binding = Binding(*binding)
        if binding.description:
            rows.append((key_label(binding.key), binding.description))
    # The nine "copy code block n" keys read as one row.
    merged: list[tuple[str, str]] = []
    for key, what in rows:
        if what.startswith("Copy code block "):
            if any(w == "Copy code block n" for _, w in merged):
                continue
            key, what = "1 … 9", "Copy code block n"
        merged.append((key, what))
    return merged


def help_sections() -> list[tuple[str, list[tuple[str, str]]]]:
    from sparkchat.ui.app import SparkchatApp
    from sparkchat.ui.screens.bench import BenchScreen
    from sparkchat.ui.screens.chat import ChatScreen
    from sparkchat.ui.screens.models import ModelsScreen, ModelTable
    from sparkchat.ui.widgets.message import AssistantMessage, MessageView, UserMessage
    from sparkchat.ui.widgets.prompt import PromptInput
    from sparkchat.ui.widgets.sidebar import HistoryList, HistorySidebar

    return [
        ("Anywhere", binding_rows(SparkchatApp.BINDINGS) + EXTRA_KEYS["Anywhere"]),
        ("Chat", binding_rows(ChatScreen.BINDINGS)),
        ("Prompt", EXTRA_KEYS["Prompt"] + binding_rows(PromptInput.BINDINGS)),
        ("Messages", binding_rows([*MessageView.BINDINGS, *UserMessage.BINDINGS,
                                                               *AssistantMessage.BINDINGS]) + EXTRA_KEYS["Messages"]),
        ("History sidebar", binding_rows([*HistoryList.BINDINGS, *HistorySidebar.BINDINGS])),
        ("Models (f3)", binding_rows([*ModelTable.BINDINGS, *ModelsScreen.BINDINGS]) + EXTRA_KEYS["Models"]),
        ("Bench (f4)", binding_rows(BenchScreen.BINDINGS)),
    ]


class HelpScreen(ModalScreen[None]):
    CSS_PATH = "help.tcss"
    BINDINGS = [Binding("escape,f1,q", "close", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="help-dialog"):
            yield Label("Keys", id="help-title")
            table: DataTable[str] = DataTable(id="help-table", cursor_type="row", zebra_stripes=True)
            table.add_columns("Where", "Key", "Action")
            for section, rows in help_sections():
                for i, (key, what) in enumerate(rows):
                    table.add_row(section if i == 0 else "", key, what)
            yield table
            yield Label("Tab or a click focuses a message for its keys · Ctrl+P: command palette and themes · "
                        "Esc closes", id="help-hint")

    def action_close(self) -> None:
        self.dismiss(None)

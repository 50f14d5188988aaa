"""The history sidebar: search, open, rename, delete, export conversations."""

from __future__ import annotations

from datetime import datetime

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from sparkchat.history import History, SearchHit


class ConversationAction(Message):
    """Open / rename / delete / export a conversation (handled by the chat screen)."""

    def __init__(self, action: str, conversation_id: int) -> None:
        super().__init__()
        self.action = action
        self.conversation_id = conversation_id


class HistoryList(OptionList):
    BINDINGS = [
        Binding("r", "act('rename')", "Rename"),
        Binding("d,delete", "act('delete')", "Delete"),
        Binding("e", "act('export')", "Export"),
    ]

    def action_act(self, action: str) -> None:
        option = self.highlighted_option
        if option is not None and option.id is not None:
            self.post_message(ConversationAction(action, int(option.id)))


class HistorySidebar(Vertical):
    BINDINGS = [Binding("escape", "close", "Close history", show=False)]

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.history: History | None = None
        self.current_id: int | None = None

    def compose(self) -> ComposeResult:
        yield Label("History", classes="sidebar-title")
        yield Input(placeholder="Search chats", id="history-search", compact=True)
        yield HistoryList(id="history-list")

    def refresh_list(self, history: History | None = None, current_id: int | None = None) -> None:
        if history is not None:
            self.history = history
        self.current_id = current_id
        if self.history is None:
            return
        query = self.query_one("#history-search", Input).value
        hits = self.history.search(query)
        options = [Option(self._label(hit), id=str(hit.conversation.id)) for hit in hits]
        olist = self.query_one(HistoryList)
        highlighted = olist.highlighted_option.id if olist.highlighted_option else None
        olist.clear_options()
        olist.add_options(options)
        if not options:
            olist.add_option(Option(Text("no chats" if not query else "no match", style="dim"), disabled=True))
            return
        ids = [o.id for o in options]
        keep = highlighted if highlighted in ids else (str(current_id) if str(current_id) in ids else None)
        olist.highlighted = ids.index(keep) if keep is not None else 0

    def _label(self, hit: SearchHit) -> Text:
        conv = hit.conversation
        text = Text(conv.title, style="bold" if conv.id == self.current_id else "", overflow="ellipsis",
                    no_wrap=True)
        when = datetime.fromtimestamp(conv.updated).strftime("%Y-%m-%d %H:%M")
        text.append("\n" + when, style="dim")
        if hit.snippet:
            text.append("\n" + hit.snippet.replace("\n", " ")[:60], style="italic dim")
        return text

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.refresh_list(current_id=self.current_id)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.query_one(HistoryList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id is not None:
            self.post_message(ConversationAction("open", int(event.option.id)))

    def action_close(self) -> None:
        self.screen.action_toggle_history()  # type: ignore[attr-defined]

    def focus_list(self) -> None:
        self.query_one(HistoryList).focus()

"""The multi-line prompt: Enter sends, Ctrl+J / Shift+Enter / Alt+Enter start a new line."""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea


NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter")


class PromptInput(TextArea):
    BINDINGS = [
        Binding(",".join(NEWLINE_KEYS), "newline", "New line", show=False),
        Binding("up", "up_or_edit", "Edit last prompt (in an empty prompt)", show=False),
    ]

    class Submitted(Message):
        def __init__(self, prompt: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

    class EditLast(Message):
        """Up in an empty prompt: bring back the last prompt to edit and resend."""

    def __init__(self, *, id: str | None = None, placeholder: str = "") -> None:
        super().__init__(id=id, placeholder=placeholder, soft_wrap=True, tab_behavior="focus",
                         show_line_numbers=False, highlight_cursor_line=False, compact=True)

    async def _on_key(self, event: events.Key) -> None:
        # Handled here, not by bindings, so they keep their order with typed characters in a fast burst.
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.action_newline()
            return
        await super()._on_key(event)

    def action_newline(self) -> None:
        start, end = self.selection
        result = self.replace("\n", start, end, maintain_selection_offset=False)
        self.move_cursor(result.end_location)

    def action_up_or_edit(self) -> None:
        if not self.text:
            self.post_message(self.EditLast())
        else:
            self.action_cursor_up()

"""One chat message: the user's prompt, or the model's reply (reasoning apart, answer, stats line)."""

from __future__ import annotations

from typing import Any

from textual import events
from textual.app import ComposeResult
from textual.await_complete import AwaitComplete
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widget import Widget
from textual.widgets import Collapsible, Label, Markdown, Static
from textual.widgets.markdown import MarkdownFence, MarkdownStream

from sparkchat.ui.format import code_blocks, split_thinking, summary_line


class SettlesInOnePass:
    """Mixin for widgets in the chat log: no second layout pass when their size changes.

    Textual lays the whole screen out again whenever a widget's virtual size changes, so that a
    container can show or hide its scrollbars. A growing answer changes the virtual size of its
    message, its Markdown and the log at each render, doubling the layout work per render, which on a
    small CPU is taken from the engine (docs/app-overhead.md). These widgets do not scroll, and the log's
    scrollbars request their own layout when they appear or go, so the first pass is all they need.
    (`_size_updated` is Textual's own hook, private: should it be renamed, this simply stops applying.)"""

    def _size_updated(self, size: Any, virtual_size: Any, container_size: Any, layout: bool = True) -> bool:
        return super()._size_updated(size, virtual_size, container_size, layout=False)  # type: ignore[misc]


class MessageView(SettlesInOnePass, Vertical):
    """Focusable (Tab, click) so its keys apply: copy it, copy a code block, edit or regenerate."""

    can_focus = True
    BINDINGS = [
        Binding("c", "copy_message", "Copy message"),
        *[Binding(str(n), f"copy_code({n - 1})", f"Copy code block {n}", show=False) for n in range(1, 10)],
        Binding("escape", "leave", "Back to prompt", show=False),
    ]
    role = "user"

    def __init__(self, text: str, *, message_id: int | None = None, classes: str = "") -> None:
        super().__init__(classes=f"message -{self.role} {classes}".strip())
        self.raw = text
        self.message_id = message_id

    def copy_text(self) -> str:
        return self.raw

    def code_text(self) -> str:
        return self.copy_text()

    def action_copy_message(self) -> None:
        self.app.copy_to_clipboard(self.copy_text())
        self.notify("Copied message", timeout=2)

    def action_copy_code(self, index: int) -> None:
        blocks = code_blocks(self.code_text())
        if not blocks:
            self.notify("No code block in this message", severity="warning", timeout=2)
            return
        if index >= len(blocks):
            self.notify(f"This message has {len(blocks)} code block(s)", severity="warning", timeout=2)
            return
        self.app.copy_to_clipboard(blocks[index])
        self.notify(f"Copied code block {index + 1}", timeout=2)

    def action_leave(self) -> None:
        self.screen.action_focus_prompt()  # type: ignore[attr-defined]

    def on_click(self, event: events.Click) -> None:
        node = event.widget
        while node is not None and node is not self:
            if isinstance(node, MarkdownFence):
                self.app.copy_to_clipboard(node.code)
                self.notify("Copied code block", timeout=2)
                event.stop()
                return
            if node.has_class("copy"):
                self.action_copy_message()
                event.stop()
                return
            node = node.parent

    def header(self, name: str) -> Horizontal:
        return Horizontal(Label(name, classes="who"), Static("⧉ copy", classes="copy"), classes="message-header")


class UserMessage(MessageView):
    role = "user"
    BINDINGS = [Binding("e", "screen.edit_last", "Edit last prompt")]

    def compose(self) -> ComposeResult:
        yield self.header("You")
        yield Static(self.raw, classes="body", markup=False)  # as typed: line breaks kept, no Markdown


class ChatMarkdown(SettlesInOnePass, Markdown):
    """Markdown whose last block, once the text is whole, carries the class `-last` (CSS drops its
    bottom margin). A class, not a `:last-child` rule: Textual restyles every child that has an order
    rule whenever a child is mounted, so such a rule makes each streamed block restyle all the blocks
    before it. While text streams in (`append`) the mark is left alone: moving it costs a layout."""

    BLOCKS = {name: type(block.__name__, (SettlesInOnePass, block), {}) for name, block in Markdown.BLOCKS.items()}

    def __init__(self, markdown: str | None = None, *, classes: str | None = None) -> None:
        super().__init__(markdown, classes=classes)
        self._last: Widget | None = None

    def update(self, markdown: str) -> AwaitComplete:
        pending = super().update(markdown)

        async def run() -> None:
            await pending
            self._mark_last()

        return AwaitComplete(run())

    def _mark_last(self) -> None:
        last = self.children[-1] if self.children else None
        if last is self._last:
            return
        if self._last is not None and self._last.parent is self:
            self._last.remove_class("-last")
        if last is not None:
            last.add_class("-last")
        self._last = last


class ChatLog(SettlesInOnePass, VerticalScroll):
    """The scrolling conversation."""


class _Part:
    """One streamed Markdown widget and what has been written to it."""

    def __init__(self, markdown: Markdown) -> None:
        self.markdown = markdown
        self.stream: MarkdownStream | None = None
        self.written = ""

    async def show(self, text: str) -> None:
        if text == self.written:
            return
        if text.startswith(self.written):
            if self.stream is None:
                self.stream = Markdown.get_stream(self.markdown)
            await self.stream.write(text[len(self.written):])
        else:  # what was shown changed (a late "</think>" moved text into the reasoning): redraw
            await self.stop()
            await self.markdown.update(text)
        self.written = text

    async def stop(self) -> None:
        if self.stream is not None:
            await self.stream.stop()
            self.stream = None

    async def final(self, text: str) -> None:
        # A stream appends block by block; one full update at the end fixes blocks that closed late.
        await self.stop()
        await self.markdown.update(text)
        self.written = text


class AssistantMessage(MessageView):
    role = "assistant"
    BINDINGS = [Binding("r", "screen.regenerate", "Regenerate")]

    def __init__(self, text: str = "", *, model: str = "Ling", message_id: int | None = None,
                 stats: object | None = None, finish_reason: str | None = None, streaming: bool = False,
                 reasoning_open: bool = False) -> None:
        super().__init__(text, message_id=message_id, classes="-streaming" if streaming else "")
        self.model = model
        self.stats = stats
        self.finish_reason = finish_reason
        self.error: str | None = None
        self._streaming = streaming
        self._reasoning_open = reasoning_open and streaming  # the prompt opened <think>: replies start in it

    def _split(self) -> tuple[str, str, bool]:
        return split_thinking(self.raw, final=not self._streaming, opened=self._reasoning_open)

    def compose(self) -> ComposeResult:
        think, answer, think_open = self._split()
        yield self.header(self.model)
        with Collapsible(title=self._reasoning_title(think, think_open), collapsed=True, classes="thinking"):
            yield ChatMarkdown(think, classes="thinking-body")
        yield ChatMarkdown(answer, classes="body")
        yield Static(self._summary_text(), classes="summary", markup=False)

    def on_mount(self) -> None:
        think, answer, think_open = self._split()
        self.query_one(".thinking").display = bool(think) or think_open
        self._think = _Part(self.query_one(".thinking-body", Markdown))
        self._answer = _Part(self.query_one(".body", Markdown))
        self._think.written, self._answer.written = think, answer

    @property
    def answer(self) -> str:
        return split_thinking(self.raw, opened=self._reasoning_open)[1]

    @property
    def thinking(self) -> str:
        return split_thinking(self.raw, opened=self._reasoning_open)[0]

    def copy_text(self) -> str:
        return self.answer

    def _summary_text(self, streaming: bool | None = None) -> str:
        if self._streaming if streaming is None else streaming:
            return "…"
        if self.error:
            return f"error: {self.error}"
        if self.stats is None:
            return FINISH_NOTE.get(self.finish_reason or "", "")
        return summary_line(self.stats, self.finish_reason)

    @staticmethod
    def _reasoning_title(think: str, think_open: bool) -> str:
        # no live count: a title that changes is a layout per render (the stats bar counts tokens)
        return "Reasoning…" if think_open else "Reasoning"

    async def feed(self, delta: str) -> None:
        """Add streamed text (reasoning and answer are routed apart as tags arrive)."""
        if not delta:
            return
        self.raw += delta
        think, answer, think_open = self._split()
        collapsible = self.query_one(".thinking", Collapsible)
        shown = bool(think) or think_open
        if collapsible.display != shown:  # (an empty reasoning block opened by the prompt goes)
            collapsible.display = shown
        collapsible.title = self._reasoning_title(think, think_open)
        if not collapsible.collapsed:  # folded reasoning is rendered when opened, or once at the end
            await self._think.show(think)
        await self._answer.show(answer)

    async def on_collapsible_expanded(self, event: Collapsible.Expanded) -> None:
        if self._streaming:
            await self._think.show(self._split()[0])

    async def finish(self, text: str, stats: object, finish_reason: str, error: str | None = None) -> None:
        """The answer ended: render the whole text once, show the stats line."""
        self.raw, self.stats, self.finish_reason, self.error = text, stats, finish_reason, error
        self._reasoning_open = False  # whole now: split as the history will (a reply stopped mid-reasoning is all answer)
        think, answer, _ = split_thinking(text)
        collapsible = self.query_one(".thinking", Collapsible)
        collapsible.display = bool(think)
        collapsible.title = "Reasoning"
        await self._think.final(think)
        await self._answer.final(answer)
        summary = self.query_one(".summary", Static)
        summary.update(self._summary_text(streaming=False))
        summary.set_class(finish_reason == "cancelled", "-stopped")
        summary.set_class(error is not None, "-error")
        self._streaming = False
        self.remove_class("-streaming")

    def mark_stopping(self) -> None:
        self.query_one(".summary", Static).update("stopping…")


FINISH_NOTE = {"cancelled": "interrupted", "error": "error"}

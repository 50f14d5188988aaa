"""The chat screen: history sidebar, the conversation, live stats, the prompt.

The engine runs in a thread worker (`_run_engine`, body in ui/streaming.py) that never touches widgets:
it fills the answer's StreamBuffer and posts StreamChunk wake-ups and one StreamDone. This screen drains
the buffer when the answer's RenderPacer allows (at most every FLUSH_S; with a CPU engine, as often as
the UI's CPU budget allows). One answer at a time; Esc sets the answer's cancel event.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Collapsible, Footer, Header, Static
from textual.worker import get_current_worker

from sparkchat.history import Conversation, Message
from sparkchat.ui.format import code_blocks, opens_reasoning, switches_line, title_from
from sparkchat.ui.messages import StreamChunk, StreamDone
from sparkchat.ui.prefs import ChatSettings
from sparkchat.ui.screens.dialogs import ConfirmScreen, TextPromptScreen, export_path_suggestion
from sparkchat.ui.streaming import Job, RateMeter, RenderPacer, render_budget, run_job
from sparkchat.ui.widgets.message import AssistantMessage, ChatLog, ChatMarkdown, MessageView, UserMessage
from sparkchat.ui.widgets.progress import format_size
from sparkchat.ui.widgets.prompt import PromptInput
from sparkchat.ui.widgets.sidebar import ConversationAction, HistorySidebar
from sparkchat.ui.widgets.stats_bar import StatsBar

if TYPE_CHECKING:
    from sparkchat.ui.app import SparkchatApp


# every kind of block an answer may hold (see ChatScreen._warm_up)
WARM_UP_MARKDOWN = """# A *heading*

A paragraph with **bold**, `code`, a [link](https://example.com), https://example.org and a@example.net.

- an item
  1. a nested one

> a quote

```python
print("code")
```

| a | b |
|---|---|
| 1 | 2 |

---
"""


@dataclass
class _Generation:
    id: int
    job: Job
    view: AssistantMessage
    message_id: int
    pacer: RenderPacer
    rates: RateMeter = field(default_factory=RateMeter)
    drain_timer: Timer | None = None
    stopping: bool = False


class ChatScreen(Screen[None]):
    CSS_PATH = "chat.tcss"
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+b", "toggle_history", "History"),
        Binding("f2", "settings", "Settings"),
        Binding("ctrl+o", "copy_answer", "Copy answer"),
        Binding("ctrl+l", "copy_code", "Copy last code block", show=False),
    ]

    app: SparkchatApp

    def __init__(self) -> None:
        super().__init__()
        self.conversation: Conversation | None = None
        self.settings = ChatSettings()
        self._gen: _Generation | None = None
        self._gen_counter = 0
        self._reset_pending = False

    # -- layout and state ----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="⚡")
        with Horizontal(id="body"):
            yield HistorySidebar(id="sidebar")
            with Vertical(id="main"):
                yield Static("", id="notice", markup=False)
                with ChatLog(id="log"):
                    yield Static("", id="empty")
                yield StatsBar(id="stats")
                yield PromptInput(id="prompt", placeholder="Message Ling  (enter sends · ctrl+j new line · f1 keys)")
        yield Footer()

    def on_mount(self) -> None:
        self.app.chat_screen = self
        self.settings = replace(self.app.prefs.chat)
        self.query_one("#log", VerticalScroll).anchor()
        self.query_one("#sidebar").display = False
        self.refresh_state()
        self.action_focus_prompt()
        self.set_timer(0.2, self._warm_up)  # after the first paint

    async def _warm_up(self) -> None:
        """Pay the first answer's one-time costs now, while nothing streams: Textual parses a widget
        class's CSS and restyles the screen the first time one is mounted (each kind of Markdown block
        included), and the Markdown parser and the code highlighter compile their patterns on first use.
        Done mid-answer, that took ~0.1-0.2 s of the UI thread (and of a CPU engine's cores)."""
        hidden = Vertical(Collapsible(ChatMarkdown(WARM_UP_MARKDOWN)), classes="warm-up")
        await self.mount(hidden)
        await hidden.remove()

    def on_unmount(self) -> None:
        if self._gen is not None:
            self._gen.job.cancel.set()

    @property
    def generating(self) -> bool:
        return self._gen is not None

    @property
    def log_view(self) -> VerticalScroll:
        return self.query_one("#log", VerticalScroll)

    def refresh_state(self) -> None:
        """Title, empty-state text and the idle stats line from the engine's status."""
        app = self.app
        self.title = self.conversation.title if self.conversation else "sparkchat"
        engine = app.engine
        if engine is not None:
            self.sub_title = f"{engine.name} · {switches_line(self.app.prefs.switches, _states(engine))}"
        else:
            self.sub_title = {"loading": f"loading model… {app.load_stage or ''}".rstrip(),
                              "failed": "model failed to load"}.get(app.engine_status, "no model loaded")
        notice = self.query_one("#notice", Static)
        notice.display = app.demo_model
        if notice.display:
            from sparkchat.cli.resolve import DEMO_ABOUT, DEMO_GET

            notice.update(f"{DEMO_ABOUT}\n{DEMO_GET}  (or here: f3, Download)")
        empty = self.query_one("#empty", Static)
        empty.update(self._empty_text())
        empty.display = not self.query(MessageView)
        if not self.generating and not self.query(AssistantMessage):
            self.query_one(StatsBar).show_idle(self._idle_text())

    def _empty_text(self) -> str:
        app = self.app
        if app.engine is not None:
            head = f"[b]{app.engine.name}[/b] is ready. Ask anything."
        elif app.engine_status == "loading":
            if app.load_stage:
                stage = f"\n{_escape(app.load_stage)}"
            elif app.load_progress:
                stage = f"\n{format_size(app.load_progress[0])} of {format_size(app.load_progress[1])} read"
            else:
                stage = ""
            head = f"[b]Loading {app.model_label or 'the model'}…[/b]{stage}\nYou can type while it loads."
        elif app.engine_status == "failed":
            head = f"[b $error]Could not load the model[/]\n{_escape(app.engine_error or '')}"
        else:
            why = app.no_model_reason or ("Start sparkchat with a model directory (or download "
                                          "Ling-3.0-flash first)")
            head = f"[b]No model loaded.[/b]\n{_escape(why)}. History and settings work without one."
        keys = "enter send · ctrl+j new line · esc stop · ctrl+b history · f2 settings · f1 all keys"
        return f"{head}\n\n[dim]{keys}[/dim]"

    def _idle_text(self) -> str:
        engine = self.app.engine
        if engine is None:
            return self.sub_title or ""
        return f"{engine.name} · {switches_line(self.app.prefs.switches, _states(engine))} · waiting for a prompt"

    def _mtp_active(self) -> bool:
        mtp = (_states(self.app.engine) or {}).get("mtp")
        return mtp.on if mtp is not None else self.app.prefs.switches.mtp

    def engine_changed(self) -> None:
        self._reset_pending = False
        self.refresh_state()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            # Only while answering; otherwise Esc goes on to the focused widget (closes the sidebar…).
            return self._gen is not None and not self._gen.stopping
        return True

    # -- sending -------------------------------------------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        if await self.send(event.text):
            event.prompt.clear()

    async def on_prompt_input_edit_last(self, event: PromptInput.EditLast) -> None:
        event.stop()
        await self.action_edit_last()

    async def send(self, text: str) -> bool:
        """Start an answer to `text`. False (and a notice) when it cannot be sent now."""
        text = text.strip()
        if not text:
            return False
        if not self._can_generate():
            return False
        history = self.app.history
        if self.conversation is None:
            self.conversation = history.create(title_from(text), model=self.app.engine.name,
                                               settings=self.settings.to_dict())
            self.refresh_state()
            self._refresh_sidebar()
        msg = history.append(self.conversation.id, "user", text)
        await self._mount_message(UserMessage(text, message_id=msg.id))
        await self._start_answer()
        return True

    def _can_generate(self) -> bool:
        if self.app.engine is None:
            why = {"loading": "The model is still loading.",
                   "failed": f"The model failed to load: {self.app.engine_error}"}.get(
                self.app.engine_status, "No model loaded.")
            self.notify(why, severity="error")
            return False
        if self._gen is not None:
            self.notify("Still answering; Esc stops it.", severity="warning")
            return False
        if self.app.bench_running:
            self.notify("The bench is running; ask again when it ends (f4 shows it).",
                        severity="warning")
            return False
        return True

    async def _mount_message(self, view: MessageView) -> None:
        self.query_one("#empty").display = False
        log = self.log_view
        await log.mount(view)
        log.anchor()

    def _engine_messages(self) -> list[dict[str, str]]:
        assert self.conversation is not None
        messages = []
        if self.settings.system_prompt.strip():
            messages.append({"role": "system", "content": self.settings.system_prompt})
        for msg in self.app.history.messages(self.conversation.id):
            if msg.role == "assistant" and not msg.content:
                continue  # stopped before its first token
            messages.append({"role": msg.role, "content": msg.content})
        return messages

    async def _start_answer(self) -> None:
        assert self.conversation is not None
        engine = self.app.engine
        messages = self._engine_messages()
        row = self.app.history.append(self.conversation.id, "assistant", "", status="streaming")
        pacer = RenderPacer(render_budget(engine))
        pacer.start()
        view = AssistantMessage(model=engine.name, message_id=row.id, streaming=True,
                                reasoning_open=self.settings.thinking and opens_reasoning(engine))
        await self._mount_message(view)
        self._gen_counter += 1
        job = Job(self._gen_counter, engine, messages, self.settings.sampling(), self.settings.thinking,
                  reset=self._reset_pending)
        self._reset_pending = False
        self._gen = _Generation(job.gen_id, job, view, row.id, pacer)
        self.query_one(StatsBar).show_prefill()
        # a steady cursor while answering: each blink is a render, taken from a CPU engine's cores
        self.query_one(PromptInput).cursor_blink = False
        self.refresh_bindings()
        # the engine starts once this screen has drawn the new messages and its footer: done while it
        # computes, that work would be taken from a CPU engine's cores
        self.call_after_refresh(self._run_engine, job, row.id)

    @work(thread=True, group="engine", exit_on_error=False)
    def _run_engine(self, job: Job, message_id: int) -> None:
        worker = get_current_worker()
        history = self.app.history

        def save(content: str, stats: dict[str, Any] | None = None, status: str | None = None) -> None:
            history.update_message(message_id, content, stats=stats, status=status)

        # on the app's engine thread, where every engine call runs (see SparkchatApp.on_engine_thread)
        self.app.on_engine_thread(run_job, job, self.post_message, save, is_cancelled=lambda: worker.is_cancelled)

    async def on_stream_chunk(self, message: StreamChunk) -> None:
        gen = self._gen
        if gen is None or message.gen_id != gen.id or gen.drain_timer is not None:
            return
        wait = gen.pacer.wait()
        if wait > 0:  # rendered a moment ago: take what has come by then
            gen.drain_timer = self.set_timer(wait, self._drain)
            return
        await self._drain()

    async def _drain(self) -> None:
        """Show what the engine produced since the last refresh."""
        gen = self._gen
        if gen is None:
            return
        gen.drain_timer = None
        gen.pacer.rendered()
        text, stats = gen.job.buffer.take()
        await gen.view.feed(text)
        if stats is not None:
            gen.rates.update(stats)
            if not gen.stopping:
                self.query_one(StatsBar).show(stats, gen.rates.samples, None, mtp_on=self._mtp_active())

    async def on_stream_done(self, message: StreamDone) -> None:
        gen = self._gen
        if gen is None or message.gen_id != gen.id:
            return
        self._gen = None
        self.query_one(PromptInput).cursor_blink = True
        if gen.drain_timer is not None:
            gen.drain_timer.stop()
        gen.rates.update(message.stats)
        self.query_one(StatsBar).show(message.stats, gen.rates.samples, message.finish_reason,
                                      mtp_on=self._mtp_active())
        await gen.view.finish(message.text, message.stats, message.finish_reason, message.error)
        if message.error:
            self.notify(message.error, title="Generation failed", severity="error")
        self.refresh_bindings()
        self._refresh_sidebar()

    # -- actions -------------------------------------------------------------------------------------

    def action_stop(self) -> None:
        gen = self._gen
        if gen is None:
            return
        gen.job.cancel.set()
        gen.stopping = True
        gen.view.mark_stopping()
        self.refresh_bindings()

    def action_focus_prompt(self) -> None:
        self.query_one(PromptInput).focus()

    async def action_new_chat(self) -> None:
        if self.generating:
            self.notify("Still answering; Esc stops it first.", severity="warning")
            return
        self.conversation = None
        await self.log_view.remove_children(MessageView)
        self.settings = replace(self.app.prefs.chat)
        self._reset_pending = True
        self.query_one(StatsBar).show_idle(self._idle_text())
        self.refresh_state()
        self._refresh_sidebar()
        self.action_focus_prompt()

    async def open_conversation(self, conversation_id: int) -> None:
        if self.generating:
            self.notify("Still answering; Esc stops it first.", severity="warning")
            return
        history = self.app.history
        conv = history.get(conversation_id)
        if conv is None:
            self.notify("That chat no longer exists.", severity="warning")
            self._refresh_sidebar()
            return
        self.conversation = conv
        self.settings = ChatSettings.from_dict(conv.settings) if conv.settings else replace(self.app.prefs.chat)
        self._reset_pending = True
        log = self.log_view
        await log.remove_children(MessageView)
        views = [self._view_for(m) for m in history.messages(conv.id)]
        if views:
            await log.mount_all(views)
        log.anchor()
        self.query_one(StatsBar).show_idle(self._idle_text())
        self.refresh_state()
        self._refresh_sidebar()

    def _view_for(self, msg: Message) -> MessageView:
        if msg.role == "assistant":
            finish = (msg.stats or {}).get("finish_reason")
            if msg.status == "interrupted":
                finish = "cancelled"
            return AssistantMessage(msg.content, model=(self.conversation.model if self.conversation else None)
                                    or "Ling", message_id=msg.id, stats=msg.stats, finish_reason=finish)
        return UserMessage(msg.content, message_id=msg.id)

    async def action_regenerate(self) -> None:
        if self.conversation is None:
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        if not self._can_generate():
            return
        messages = self.app.history.messages(self.conversation.id)
        if not messages:
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        last = messages[-1]
        if last.role == "assistant":
            self.app.history.delete_messages_from(last.id)
            await self._remove_views_from(last.id)
        await self._start_answer()

    async def action_edit_last(self) -> None:
        if self.generating:
            self.notify("Still answering; Esc stops it first.", severity="warning")
            return
        prompt = self.query_one(PromptInput)
        if self.conversation is None:
            return
        user = next((m for m in reversed(self.app.history.messages(self.conversation.id)) if m.role == "user"), None)
        if user is None:
            return
        if prompt.text.strip():
            self.notify("Clear the prompt first to edit the last one.", severity="warning")
            return
        self.app.history.delete_messages_from(user.id)
        await self._remove_views_from(user.id)
        prompt.text = user.content
        prompt.move_cursor(prompt.document.end)
        prompt.focus()
        self.refresh_state()

    async def _remove_views_from(self, message_id: int) -> None:
        views = [v for v in self.query(MessageView) if v.message_id is not None and v.message_id >= message_id]
        if views:
            await self.log_view.remove_children(views)

    def _last_answer(self) -> AssistantMessage | None:
        answers = list(self.query(AssistantMessage))
        return answers[-1] if answers else None

    def action_copy_answer(self) -> None:
        view = self._last_answer()
        if view is None or not view.answer:
            self.notify("No answer to copy yet.", severity="warning")
            return
        self.app.copy_to_clipboard(view.answer)
        self.notify("Copied the last answer", timeout=2)

    def action_copy_code(self) -> None:
        for view in reversed(list(self.query(AssistantMessage))):
            blocks = code_blocks(view.answer)
            if blocks:
                self.app.copy_to_clipboard(blocks[-1])
                self.notify("Copied the last code block", timeout=2)
                return
        self.notify("No code block to copy.", severity="warning")

    def action_toggle_history(self) -> None:
        sidebar = self.query_one(HistorySidebar)
        sidebar.display = not sidebar.display
        if sidebar.display:
            self._refresh_sidebar()
            sidebar.focus_list()
        else:
            self.action_focus_prompt()

    def _refresh_sidebar(self) -> None:
        sidebar = self.query_one(HistorySidebar)
        if sidebar.display:
            sidebar.refresh_list(self.app.history, self.conversation.id if self.conversation else None)

    def action_settings(self) -> None:
        from sparkchat.ui.screens.settings import SettingsScreen

        engine = self.app.engine
        note = "" if engine is not None else "No model loaded: these apply when one loads."
        self.app.push_screen(SettingsScreen(self.settings, self.app.prefs.switches, _states(engine), note=note),
                             self._apply_settings)

    def _apply_settings(self, result: Any) -> None:
        if result is None:
            return
        self.settings = result.chat
        self.app.prefs.chat = replace(result.chat)
        self.app.prefs.switches = result.switches
        self.app.save_prefs()
        self.app.apply_switches()
        if self.conversation is not None:
            self.app.history.update_settings(self.conversation.id, result.chat.to_dict())
        self.refresh_state()
        self.notify("Settings saved; they apply from the next answer.", timeout=3)

    def action_export(self, conversation_id: int | None = None) -> None:
        conv_id = conversation_id if conversation_id is not None else (
            self.conversation.id if self.conversation else None)
        if conv_id is None:
            self.notify("No chat to export yet.", severity="warning")
            return
        conv = self.app.history.get(conv_id)
        if conv is None:
            return

        def write(path: str | None) -> None:
            if not path:
                return
            target = Path(path).expanduser()
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(self.app.history.export_markdown(conv_id))
            except OSError as exc:
                self.notify(f"Could not write {target}: {exc.strerror or exc}", severity="error")
                return
            self.notify(f"Exported to {target}", timeout=4)

        suggestion = export_path_suggestion(conv.title, conv.id)
        self.app.push_screen(TextPromptScreen("Export chat as Markdown to", suggestion), write)

    # -- sidebar actions -----------------------------------------------------------------------------

    async def on_conversation_action(self, message: ConversationAction) -> None:
        message.stop()
        cid = message.conversation_id
        history = self.app.history
        conv = history.get(cid)
        if conv is None:
            self._refresh_sidebar()
            return
        if message.action == "open":
            await self.open_conversation(cid)
            self.action_focus_prompt()
        elif message.action == "rename":
            def rename(title: str | None) -> None:
                if title:
                    history.rename(cid, title)
                    if self.conversation is not None and self.conversation.id == cid:
                        self.conversation.title = title
                    self.refresh_state()
                    self._refresh_sidebar()

            self.app.push_screen(TextPromptScreen("Rename chat", conv.title), rename)
        elif message.action == "delete":
            if self.generating and self.conversation is not None and self.conversation.id == cid:
                self.notify("Still answering in this chat; Esc stops it first.", severity="warning")
                return

            async def delete(yes: bool | None) -> None:
                if not yes:
                    return
                history.delete(cid)
                if self.conversation is not None and self.conversation.id == cid:
                    await self.action_new_chat()
                    self.query_one(HistorySidebar).focus_list()
                self._refresh_sidebar()

            self.app.push_screen(ConfirmScreen(f"Delete “{conv.title}”?"), delete)
        elif message.action == "export":
            self.action_export(cid)


def _states(engine: Any) -> dict[str, Any] | None:
    if engine is None:
        return None
    try:
        return engine.switch_states()
    except Exception:
        return None


def _escape(text: str) -> str:
    return text.replace("[", r"\[")

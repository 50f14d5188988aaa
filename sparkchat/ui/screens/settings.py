"""Settings: the engine's optimization switches, sampling, system prompt, thinking."""

from __future__ import annotations

from dataclasses import dataclass, replace

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.validation import Integer, Number
from textual.widgets import Button, Input, Label, Select, Switch, TextArea

from sparkchat.engine.events import Switches, SwitchState
from sparkchat.ui.prefs import DRAFT_STEPS, ChatSettings

# name, label, what it does
SWITCHES = [
    ("mxfp4_kernels", "MXFP4 kernels", "experts read 4-bit weights straight from memory"),
    ("fp8_head", "FP8 head", "the vocabulary projection in FP8"),
    ("mtp", "MTP", "the model drafts tokens ahead and verifies them in one step"),
    ("truncated_draft_head", "Top-N draft", "the draft's head covers only the most frequent tokens"),
    ("cuda_graphs", "CUDA graphs", "each decode step replayed as one graph launch"),
]


@dataclass
class SettingsResult:
    chat: ChatSettings
    switches: Switches


class SettingsScreen(ModalScreen[SettingsResult | None]):
    CSS_PATH = "settings.tcss"
    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+s", "save", "Save"),
    ]

    def __init__(self, chat: ChatSettings, switches: Switches, states: dict[str, SwitchState] | None = None,
                 *, note: str = "") -> None:
        super().__init__()
        self.chat = chat
        self.switches = switches
        self.states = states or {}
        self.note = note

    def _state(self, name: str) -> SwitchState:
        state = self.states.get(name)
        if state is None and self.states:  # an engine that does not know this switch (a remote one)
            return SwitchState(on=False, available=False, reason="not offered by this engine")
        if state is None:  # no engine yet: the choice is kept and applied when a model loads
            return SwitchState(on=bool(getattr(self.switches, name)), available=True)
        return state

    def compose(self) -> ComposeResult:
        with Vertical(id="settings-dialog"):
            yield Label("Settings", id="settings-title")
            with VerticalScroll(id="settings-body"):
                yield Label("Engine optimizations · applied at the next answer, no reload", classes="section")
                if self.note:
                    yield Label(self.note, classes="note")
                for name, label, what in SWITCHES:
                    state = self._state(name)
                    wanted = bool(getattr(self.switches, name))
                    with Horizontal(classes="row switch-row", id=f"row-{name}"):
                        yield Switch(wanted and state.available, id=f"sw-{name}", disabled=not state.available)
                        yield Label(label, classes="name")
                        if state.available:
                            note = f"{what} · {state.reason}" if state.reason else what
                            yield Label(note, classes="what")
                        else:
                            yield Label(f"unavailable: {state.reason or 'not supported here'}", classes="reason")
                mtp = self._state("mtp")
                with Horizontal(classes="row"):
                    yield Label("Draft steps", classes="field-label")
                    yield Select([(str(n), n) for n in DRAFT_STEPS], value=self.switches.draft_steps,
                                 allow_blank=False, id="draft-steps", compact=True,
                                 disabled=not (mtp.available and self.switches.mtp))
                    yield Label("tokens the MTP layer drafts per step (1–4)", classes="what")
                yield Label("Sampling", classes="section")
                c = self.chat
                yield from self._field("temperature", "Temperature", f"{c.temperature:g}", "0 = greedy",
                                       Number(minimum=0), "number")
                yield from self._field("top-p", "Top-p", f"{c.top_p:g}", "nucleus cut, (0, 1]",
                                       Number(minimum=0, maximum=1), "number")
                yield from self._field("top-k", "Top-k", str(c.top_k), "0 = off",
                                       Integer(minimum=0), "integer")
                yield from self._field("max-tokens", "Max tokens", str(c.max_tokens), "per answer",
                                       Integer(minimum=1), "integer")
                yield from self._field("seed", "Seed", "" if c.seed is None else str(c.seed),
                                       "blank = random", Integer(minimum=0), "integer")
                yield Label("Chat", classes="section")
                with Horizontal(classes="row switch-row"):
                    yield Switch(c.thinking, id="sw-thinking")
                    yield Label("Thinking", classes="name")
                    yield Label("reason before answering (shown apart, collapsed)", classes="what")
                yield Label("System prompt", classes="field-label", id="system-prompt-label")
                yield TextArea(c.system_prompt, id="system-prompt", soft_wrap=True, compact=True)
            with Horizontal(id="settings-buttons"):
                yield Button("Save  ^s", variant="primary", id="save", compact=True)
                yield Button("Cancel  esc", id="cancel", compact=True)

    def _field(self, id: str, label: str, value: str, hint: str, validator: object, kind: str) -> ComposeResult:
        with Horizontal(classes="row"):
            yield Label(label, classes="field-label")
            yield Input(value, id=id, type=kind, validators=[validator] if validator else [],  # type: ignore[list-item]
                        classes="field", compact=True)
            yield Label(hint, classes="what")

    def on_switch_changed(self, event: Switch.Changed) -> None:
        if event.switch.id == "sw-mtp":
            self.query_one("#draft-steps", Select).disabled = not event.value

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.action_cancel()

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_save(self) -> None:
        try:
            result = self.result()
        except ValueError as exc:
            self.notify(str(exc), title="Not saved", severity="error")
            return
        self.dismiss(result)

    def result(self) -> SettingsResult:
        """The form's values; raises ValueError with a readable message on a bad field."""
        def number(id: str, cast: type, label: str) -> float | int:
            text = self.query_one(f"#{id}", Input).value.strip()
            try:
                return cast(text)
            except ValueError:
                raise ValueError(f"{label}: '{text}' is not a valid number") from None

        seed_text = self.query_one("#seed", Input).value.strip()
        chat = ChatSettings(
            temperature=float(number("temperature", float, "Temperature")),
            top_p=float(number("top-p", float, "Top-p")),
            top_k=int(number("top-k", int, "Top-k")),
            max_tokens=int(number("max-tokens", int, "Max tokens")),
            seed=int(number("seed", int, "Seed")) if seed_text else None,
            system_prompt=self.query_one("#system-prompt", TextArea).text,
            thinking=self.query_one("#sw-thinking", Switch).value,
        )
        values = {}
        for name, _, _ in SWITCHES:
            switch = self.query_one(f"#sw-{name}", Switch)
            # An unavailable switch keeps the user's choice, for a machine where it works.
            values[name] = getattr(self.switches, name) if switch.disabled else switch.value
        steps = self.query_one("#draft-steps", Select).value
        switches = replace(self.switches, **values,
                           draft_steps=int(steps) if isinstance(steps, int) else self.switches.draft_steps)
        return SettingsResult(chat, switches)

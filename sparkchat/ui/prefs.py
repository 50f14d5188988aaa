"""What the app remembers between runs, kept in the user's settings file (`sparkchat.settings`,
settings.toml): chat defaults (sampling, system prompt, thinking), the engine switches and the theme,
and the model last switched to on the models screen. Other settings in that file (device, …) are left
as they are.

Each conversation also keeps its own copy of the chat settings (History conversation `settings`), so a
resumed chat answers the way it did before.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from sparkchat.engine.events import SamplingParams, Switches
from sparkchat.settings import (DEFAULT_MODEL, MAX_DRAFT_STEPS, Settings, SettingsError, load_settings,
                                save_settings)

DRAFT_STEPS = tuple(range(1, MAX_DRAFT_STEPS + 1))


@dataclass
class ChatSettings:
    """Sampling, system prompt and thinking: the settings that belong to a chat."""

    temperature: float = SamplingParams.temperature
    top_p: float = SamplingParams.top_p
    top_k: int = SamplingParams.top_k  # 0: no top-k cut
    max_tokens: int = SamplingParams.max_tokens
    seed: int | None = None  # None: a fresh seed each answer
    system_prompt: str = ""
    thinking: bool = True

    def __post_init__(self) -> None:
        self.sampling()  # ValueError, one line, for a value out of range (the check `ask` uses too)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChatSettings:
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except (TypeError, ValueError):
            return cls()

    @classmethod
    def from_settings(cls, s: Settings) -> ChatSettings:
        p = s.sampling
        return cls(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens, seed=p.seed,
                   system_prompt=s.system_prompt, thinking=s.thinking)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def sampling(self) -> SamplingParams:
        """These settings as the engine takes them, range-checked (ValueError)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, max_tokens=self.max_tokens).validate()


@dataclass
class Prefs:
    chat: ChatSettings = field(default_factory=ChatSettings)
    switches: Switches = field(default_factory=Switches)
    theme: str = Settings.theme
    load_error: str | None = None  # the settings file could not be read: defaults are in use


def load(path: str | Path | None = None) -> Prefs:
    """The saved prefs; defaults (and `load_error`) when the settings file cannot be read."""
    try:
        s = load_settings(path)
    except SettingsError as exc:
        return Prefs(load_error=str(exc))
    return Prefs(ChatSettings.from_settings(s), Switches(**asdict(s.switches)), s.theme)


def save(prefs: Prefs, path: str | Path | None = None) -> None:
    """Write the app's part into the settings file, keeping the rest of it. Raises SettingsError."""
    s = load_settings(path)  # re-read: another sparkchat command may have changed other keys
    c = prefs.chat
    s.sampling = SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, seed=c.seed,
                                max_tokens=c.max_tokens, ignore_eos=s.sampling.ignore_eos)
    s.system_prompt, s.thinking = c.system_prompt, c.thinking
    s.switches = Switches(**asdict(prefs.switches))
    s.theme = prefs.theme
    save_settings(s, path)


def save_default_model(model: str, path: str | Path | None = None) -> None:
    """Make `model` (a folder, or a downloaded Hub repo id) the one `sparkchat` opens next time; the
    built-in demo resets the setting, so that the real model is opened once it is downloaded. Keeps
    the rest of the file. Raises SettingsError."""
    from sparkchat.cli.resolve import is_demo

    s = load_settings(path)
    s.model = DEFAULT_MODEL if is_demo(model) else model
    save_settings(s, path)

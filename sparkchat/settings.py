"""User settings: one TOML file in the platform config dir, plus the data dir for history and models.

    settings = load_settings()                       # defaults when the file does not exist yet
    settings = apply_overrides(settings, {"temperature": 0.7, "mtp": None})   # None = flag not given
    save_settings(settings)

The file is flat scalars plus two one-level tables, `[switches]` and `[sampling]`; we read it with
`tomllib` and write it with the tiny writer below (no TOML dependency). `SPARKCHAT_CONFIG_DIR` and
`SPARKCHAT_DATA_DIR` override the platform dirs (tests use them).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from sparkchat.engine.errors import SparkchatError
from sparkchat.engine.events import SamplingParams, Switches, sampling_problem

APP_NAME = "sparkchat"
SETTINGS_FILE = "settings.toml"
DEFAULT_MODEL = "inclusionAI/Ling-3.0-flash-fp4"
DEVICES = ("auto", "cpu", "cuda")  # also "cuda:N"
MAX_DRAFT_STEPS = 4
MIN_DRAFT_VOCAB = 64  # rows of the truncated draft head, the chat format's own tokens among them
_INT_SWITCHES = ("draft_steps", "draft_vocab")  # the other switches are on/off
DTYPES = ("auto", "bfloat16", "float16", "float32")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


class SettingsError(SparkchatError):
    """A settings file that cannot be read, or a setting value that is not allowed."""


def config_dir() -> Path:
    """Where settings.toml lives: $SPARKCHAT_CONFIG_DIR, else the platform's user config dir."""
    env = os.environ.get("SPARKCHAT_CONFIG_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_config_dir

    return Path(user_config_dir(APP_NAME, appauthor=False))


def data_dir() -> Path:
    """Where history, downloaded models etc. live: $SPARKCHAT_DATA_DIR, else the platform's user data dir."""
    env = os.environ.get("SPARKCHAT_DATA_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir(APP_NAME, appauthor=False))


def settings_path() -> Path:
    return config_dir() / SETTINGS_FILE


@dataclass
class Settings:
    model: str = DEFAULT_MODEL  # a Hub repo id, a local model name or a path
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32 (for the parts kept in high precision)
    system_prompt: str = ""
    thinking: bool = True
    theme: str = "textual-dark"
    endpoint: str = ""  # an OpenAI-compatible server to use instead of the embedded engine; empty = embedded
    hub_endpoint: str = ""  # Hub endpoint (a mirror) for downloads; empty = $HF_ENDPOINT or huggingface.co
    switches: Switches = field(default_factory=Switches)
    sampling: SamplingParams = field(default_factory=SamplingParams)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "settings") -> "Settings":
        """Build from parsed TOML; unknown keys are ignored, bad values raise SettingsError."""
        s = cls()
        for key, spec in _SPECS.items():
            section = d.get(spec.section, {}) if spec.section else d
            if not isinstance(section, Mapping):
                raise SettingsError(f"{source}: [{spec.section}] must be a table")
            if spec.name in section:
                _assign(s, spec, _check(spec, section[spec.name], source))
        return s

    def to_dict(self) -> dict[str, Any]:
        """Top-level scalars plus one dict per table; None values are left out (TOML has no null)."""
        out: dict[str, Any] = {}
        for spec in _SPECS.values():
            value = _get(self, spec)
            if value is None:
                continue
            if spec.section:
                out.setdefault(spec.section, {})[spec.name] = value
            else:
                out[spec.name] = value
        return out

    def get(self, key: str) -> Any:
        return _get(self, _spec(key))

    def flat(self) -> dict[str, Any]:
        """Every setting by its dotted key (`sampling.temperature`), None included."""
        return {k: _get(self, spec) for k, spec in _SPECS.items()}


@dataclass(frozen=True)
class _Spec:
    section: str  # "" for top level
    name: str
    kind: type  # str | bool | int | float
    optional: bool = False  # may be None (left out of the file)


_SPECS: dict[str, _Spec] = {}
for _name, _kind in (("model", str), ("device", str), ("dtype", str), ("system_prompt", str),
                     ("thinking", bool), ("theme", str), ("endpoint", str),
                     ("hub_endpoint", str)):
    _SPECS[_name] = _Spec("", _name, _kind)
for _f in fields(Switches):
    _SPECS[f"switches.{_f.name}"] = _Spec("switches", _f.name, int if _f.name in _INT_SWITCHES else bool)
for _name, _kind in (("temperature", float), ("top_p", float), ("top_k", int), ("max_tokens", int),
                     ("seed", int)):
    _SPECS[f"sampling.{_name}"] = _Spec("sampling", _name, _kind, optional=_name == "seed")


def keys() -> list[str]:
    """All settable keys, dotted (`sampling.temperature`); the short form (`temperature`) works too."""
    return list(_SPECS)


def _spec(key: str) -> _Spec:
    if key in _SPECS:
        return _SPECS[key]
    matches = [spec for spec in _SPECS.values() if spec.name == key]
    if len(matches) == 1:
        return matches[0]
    raise SettingsError(f"unknown setting {key!r}; known: {', '.join(_SPECS)}")


def _dotted(spec: _Spec) -> str:
    return f"{spec.section}.{spec.name}" if spec.section else spec.name


def _get(s: Settings, spec: _Spec) -> Any:
    return getattr(getattr(s, spec.section) if spec.section else s, spec.name)


def _assign(s: Settings, spec: _Spec, value: Any) -> None:
    setattr(getattr(s, spec.section) if spec.section else s, spec.name, value)


def _check(spec: _Spec, value: Any, source: str) -> Any:
    """Type- and range-check one value; returns it normalized (ints accepted for floats)."""
    key = _dotted(spec)
    if value is None:
        if spec.optional:
            return None
        raise SettingsError(f"{source}: {key} cannot be empty")
    if spec.kind is bool:
        if not isinstance(value, bool):
            raise SettingsError(f"{source}: {key} must be true or false, got {value!r}")
    elif spec.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingsError(f"{source}: {key} must be an integer, got {value!r}")
    elif spec.kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SettingsError(f"{source}: {key} must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise SettingsError(f"{source}: {key} must be a finite number, got {value!r}")
    elif not isinstance(value, str):
        raise SettingsError(f"{source}: {key} must be a string, got {value!r}")
    elif key == "dtype":
        value = _DTYPE_ALIASES.get(value.lower(), value.lower())
    problem = _range_problem(key, value)
    if problem:
        raise SettingsError(f"{source}: {key} {problem}")
    return value


def _range_problem(key: str, v: Any) -> str | None:
    if key == "device" and not (v in DEVICES or re.fullmatch(r"cuda:\d+", v)):
        return f"must be auto, cpu, cuda or cuda:N, got {v!r}"
    if key == "dtype" and v not in DTYPES:
        return f"must be one of {', '.join(DTYPES)}, got {v!r}"
    if key == "model" and not v.strip():
        return "cannot be empty"
    if key in ("endpoint", "hub_endpoint") and v and not re.match(r"https?://", v):
        return f"must be an http(s) URL or empty, got {v!r}"
    if key == "switches.draft_steps" and not 1 <= v <= MAX_DRAFT_STEPS:
        return f"must be between 1 and {MAX_DRAFT_STEPS}, got {v}"
    if key == "switches.draft_vocab" and v < MIN_DRAFT_VOCAB:
        return f"must be at least {MIN_DRAFT_VOCAB}, got {v}"
    if key.startswith("sampling."):
        problem = sampling_problem(key.split(".", 1)[1], v)  # the same check as `ask` and the app
        return f"{problem}, got {v}" if problem else None
    return None


def _theme_problem(theme: str) -> str | None:
    """The app offers Textual's built-in themes (it registers none of its own). Checked on `config set`
    only: a file naming a theme a newer Textual had still loads, and the app keeps its default then."""
    from textual.theme import BUILTIN_THEMES  # late: Textual is a heavy import

    if theme in BUILTIN_THEMES:
        return None
    return f"theme must be one of {', '.join(sorted(BUILTIN_THEMES))}, got {theme!r}"


# --- reading and writing ------------------------------------------------------------------------------

def load_settings(path: str | Path | None = None) -> Settings:
    """Read settings.toml (defaults when it does not exist). Bad TOML → SettingsError naming file and line."""
    import tomllib

    p = Path(path) if path is not None else settings_path()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Settings()
    except (OSError, UnicodeDecodeError) as e:
        raise SettingsError(f"cannot read {p}: {e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        where = f", line {m.group(1)}" if m else (", end of file" if "end of document" in msg else "")
        msg = re.sub(r"\s*\(at (line \d+, column \d+|end of document)\)", "", msg).strip()
        raise SettingsError(f"{p}{where}: invalid TOML: {msg}") from None
    return Settings.from_dict(data, source=str(p))


def save_settings(settings: Settings, path: str | Path | None = None) -> Path:
    """Write settings.toml atomically; returns its path."""
    p = Path(path) if path is not None else settings_path()
    # validate everything before touching the file
    Settings.from_dict(settings.to_dict(), source="settings")
    text = dumps_toml(settings.to_dict())
    tmp = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".settings.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException as e:
        if tmp is not None:  # a full disk leaves it empty or half written: never leave it behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError):
            raise SettingsError(f"cannot write {p}: {e}") from None
        raise
    return p


def dumps_toml(data: Mapping[str, Any]) -> str:
    """TOML for our schema: scalars first, then one-level tables. Keys must be bare (a-z, 0-9, _ and -)."""
    lines = ["# sparkchat settings: edit freely, or use `sparkchat config set KEY VALUE`"]
    tables = []
    for k, v in data.items():
        if isinstance(v, Mapping):
            tables.append((k, v))
        else:
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
    for name, table in tables:
        lines.append("")
        lines.append(f"[{_toml_key(name)}]")
        for k, v in table.items():
            if isinstance(v, Mapping):
                raise TypeError("only one level of tables is supported")
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _toml_key(k: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", k):
        raise ValueError(f"not a bare TOML key: {k!r}")
    return k


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)  # always has '.' or an exponent, both valid TOML
    if isinstance(v, str):
        out = []
        for ch in v:
            if ch in _ESCAPES:
                out.append(_ESCAPES[ch])
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04X}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


# --- changing values ----------------------------------------------------------------------------------

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def parse_value(key: str, text: str) -> Any:
    """Turn command-line text into a checked value for `key` (e.g. `config set temperature 0.7`)."""
    spec = _spec(key)
    t = text.strip()
    if spec.optional and t.lower() in ("none", "null", ""):
        return None
    value: Any = text
    try:
        if spec.kind is bool:
            if t.lower() not in _TRUE | _FALSE:
                raise ValueError
            value = t.lower() in _TRUE
        elif spec.kind is int:
            value = int(t)
        elif spec.kind is float:
            value = float(t)
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a number"}[spec.kind]
        raise SettingsError(f"{_dotted(spec)} must be {kind}, got {text!r}") from None
    return _check(spec, value, "setting")


def set_value(settings: Settings, key: str, value: Any) -> Settings:
    """A copy of `settings` with one value changed (strings are parsed for the key's type)."""
    spec = _spec(key)
    if isinstance(value, str) and spec.kind is not str:
        value = parse_value(key, value)
    else:
        value = _check(spec, value, "setting")
    if spec.name == "theme" and (problem := _theme_problem(value)):
        raise SettingsError(problem)
    out = copy.deepcopy(settings)
    _assign(out, spec, value)
    return out


def reset_value(settings: Settings, key: str) -> Settings:
    """A copy of `settings` with one key back to its default."""
    spec = _spec(key)
    out = copy.deepcopy(settings)
    _assign(out, spec, _get(Settings(), spec))
    return out


def apply_overrides(settings: Settings, overrides: Mapping[str, Any]) -> Settings:
    """Command-line flags over file values: keys short (`temperature`) or dotted; None means 'not given'.

    Unknown keys raise SettingsError so a typo in a caller is caught in tests."""
    out = settings
    for key, value in overrides.items():
        if value is not None:
            out = set_value(out, key, value)
    return out


# argparse attribute names (as `sparkchat ask` spells its flags) that differ from setting names
ARG_ALIASES = {"think": "thinking", "system": "system_prompt"}


def overrides_from_args(args: Any) -> dict[str, Any]:
    """Setting overrides from an argparse Namespace: attributes named like a setting (or an ARG_ALIASES
    key) whose value is not None, i.e. flags the user gave."""
    out: dict[str, Any] = {}
    for attr, value in vars(args).items():
        name = ARG_ALIASES.get(attr, attr)
        if value is not None and any(spec.name == name for spec in _SPECS.values()):
            out[name] = value
    return out

"""sparkchat.settings: TOML round trip, errors with file and line, overrides."""

from __future__ import annotations

import argparse
import re
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from sparkchat import settings as st
from sparkchat.cli.ask import sampling_from
from sparkchat.engine.events import SAMPLING_RULES, SamplingParams, sampling_problem
from sparkchat.settings import Settings, SettingsError, set_value
from sparkchat.ui.prefs import ChatSettings


@pytest.fixture(autouse=True)
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPARKCHAT_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("SPARKCHAT_DATA_DIR", str(tmp_path / "data"))
    return tmp_path


def test_dirs_follow_env(dirs: Path):
    assert st.settings_path() == dirs / "cfg" / "settings.toml"
    assert st.data_dir() == dirs / "data"


def test_defaults_without_file():
    s = st.load_settings()
    assert s == Settings()
    assert s.sampling.seed is None and s.switches.mtp is True


def test_round_trip_keeps_every_value(dirs: Path):
    s = Settings(model="/models/ling", device="cuda:1", dtype="bfloat16", thinking=False, theme="nord",
                 endpoint="https://hf-mirror.example", system_prompt='Say "hi" \\ then\n\ttab \x01 é ✓')
    s.switches.mtp = False
    s.switches.draft_steps = 2
    s.switches.cuda_graphs = False
    s.sampling.temperature = 0.7
    s.sampling.top_p = 0.95
    s.sampling.top_k = 40
    s.sampling.max_tokens = 1024
    s.sampling.seed = 1234
    path = st.save_settings(s)
    assert path == dirs / "cfg" / "settings.toml"
    assert st.load_settings() == s
    raw = tomllib.loads(path.read_text())
    assert raw["sampling"]["temperature"] == 0.7 and raw["switches"]["draft_steps"] == 2
    assert raw["system_prompt"] == s.system_prompt


def test_none_seed_is_left_out():
    path = st.save_settings(Settings())
    raw = tomllib.loads(path.read_text())
    assert "seed" not in raw["sampling"]
    assert st.load_settings().sampling.seed is None


@pytest.mark.parametrize("value", [1e-5, 0.1, 2.0, 1e20])
def test_floats_written_as_toml_floats(value: float):
    s = Settings()
    s.sampling.temperature = value
    st.save_settings(s)
    assert st.load_settings().sampling.temperature == value


def test_bad_toml_names_file_and_line(dirs: Path):
    path = dirs / "cfg" / "settings.toml"
    path.parent.mkdir(parents=True)
    path.write_text('model = "x"\n\ntemperature 0.7\n')
    with pytest.raises(SettingsError) as e:
        st.load_settings()
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "line 3" in msg


@pytest.mark.parametrize("text, words", [
    ("[sampling]\ntemperature = \"hot\"\n", "sampling.temperature must be a number"),
    ("[sampling]\ntop_p = 1.5\n", "sampling.top_p"),
    ("[switches]\nmtp = 1\n", "switches.mtp must be true or false"),
    ("[switches]\ndraft_steps = 9\n", "switches.draft_steps"),
    ("device = \"tpu\"\n", "device"),
    ("switches = 3\n", "[switches] must be a table"),
])
def test_bad_values_name_the_key(dirs: Path, text: str, words: str):
    path = dirs / "cfg" / "settings.toml"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(SettingsError) as e:
        st.load_settings()
    assert words in str(e.value) and str(path) in str(e.value)


def test_unknown_keys_ignored_and_ints_accepted_for_floats(dirs: Path):
    path = dirs / "cfg" / "settings.toml"
    path.parent.mkdir(parents=True)
    path.write_text('future_key = 1\ndtype = "bf16"\n[sampling]\ntemperature = 1\n[other]\nx = 2\n')
    s = st.load_settings()
    assert s.sampling.temperature == 1.0 and isinstance(s.sampling.temperature, float)
    assert s.dtype == "bfloat16"


def test_overrides_win_and_none_means_not_given():
    s = st.load_settings()
    out = st.apply_overrides(s, {"temperature": 0.5, "sampling.top_k": 7, "mtp": False, "seed": None,
                                 "model": None})
    assert out.sampling.temperature == 0.5 and out.sampling.top_k == 7 and out.switches.mtp is False
    assert out.model == s.model and out.sampling.seed is None
    assert s.sampling.temperature == 0.0  # the original is untouched
    with pytest.raises(SettingsError):
        st.apply_overrides(s, {"temprature": 0.5})
    with pytest.raises(SettingsError):
        st.apply_overrides(s, {"top_p": 0})


def test_overrides_from_argparse_namespace():
    args = argparse.Namespace(command="ask", temperature=0.3, top_p=None, think=False, system="be brief",
                              draft_steps=2, json=True, prompt=["hi"], model=None)
    over = st.overrides_from_args(args)
    assert over == {"temperature": 0.3, "thinking": False, "system_prompt": "be brief", "draft_steps": 2}
    s = st.apply_overrides(Settings(), over)
    assert s.thinking is False and s.system_prompt == "be brief" and s.switches.draft_steps == 2


@pytest.mark.parametrize("key, text, value", [
    ("temperature", "0.7", 0.7), ("sampling.top_k", "40", 40), ("mtp", "off", False),
    ("thinking", "yes", True), ("seed", "none", None), ("seed", "42", 42), ("theme", "nord", "nord"),
])
def test_parse_value(key: str, text: str, value):
    assert st.parse_value(key, text) == value


@pytest.mark.parametrize("key, text", [("temperature", "hot"), ("mtp", "maybe"), ("top_k", "1.5"),
                                        ("max_tokens", "0"), ("nope", "1")])
def test_parse_value_rejects(key: str, text: str):
    with pytest.raises(SettingsError) as e:
        st.parse_value(key, text)
    assert "\n" not in str(e.value)


def test_set_and_reset_value():
    s = st.set_value(Settings(), "top_p", "0.9")
    assert s.sampling.top_p == 0.9
    assert st.reset_value(s, "sampling.top_p").sampling.top_p == Settings().sampling.top_p


def test_save_refuses_invalid_settings(dirs: Path):
    s = Settings()
    s.sampling.top_k = -1
    with pytest.raises(SettingsError):
        st.save_settings(s)
    assert not (dirs / "cfg" / "settings.toml").exists()


def test_dumps_toml_escapes_and_rejects_nesting():
    text = st.dumps_toml({"a": 'q"\\\n\x7f', "t": {"b": True, "c": -3}})
    assert tomllib.loads(text) == {"a": 'q"\\\n\x7f', "t": {"b": True, "c": -3}}
    with pytest.raises(TypeError):
        st.dumps_toml({"t": {"u": {"v": 1}}})
    with pytest.raises(ValueError):
        st.dumps_toml({"bad key": 1})


@pytest.mark.parametrize("name,value", [("temperature", -0.1), ("temperature", float("nan")),
                                        ("temperature", float("inf")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
                                        ("max_tokens", 0), ("seed", -3)])
def test_one_sampling_check_for_ask_the_app_and_the_settings_file(name, value):
    label, rule, _ = SAMPLING_RULES[name]
    if value != value or value in (float("inf"), float("-inf")):  # every path says it the same way
        rule = "must be a finite number"
    assert sampling_problem(name, value) == rule
    with pytest.raises(ValueError) as shared:
        replace(SamplingParams(), **{name: value}).validate()
    assert str(shared.value) == f"{label} {rule}, got {value}"
    # `sparkchat ask` (and `serve`): the same check, naming the flag
    args = argparse.Namespace(temperature=None, top_p=None, top_k=None, seed=None, max_tokens=None)
    setattr(args, name, value)
    with pytest.raises(ValueError) as cli:
        sampling_from(args)
    assert str(cli.value) == f"--{name.replace('_', '-')} {rule}, got {value}"
    # the app's settings form and saved chat settings
    with pytest.raises(ValueError) as app:
        ChatSettings(**{name: value})
    assert str(app.value) == str(shared.value)
    # settings.toml / `sparkchat config set` (a NaN is refused earlier, as not finite)
    with pytest.raises(SettingsError, match=re.escape(rule)):
        set_value(Settings(), f"sampling.{name}", value)


def test_sampling_limits_themselves_are_allowed():
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, max_tokens=1)
    assert params.validate() is params
    assert sampling_problem("seed", None) is None  # no seed: a fresh one each answer
    assert sampling_problem("ignore_eos", True) is None  # not a range-checked field


@pytest.mark.parametrize("failing", ["replace", "write"])
def test_a_failed_save_leaves_no_temp_file_and_the_old_file_intact(dirs: Path, monkeypatch, failing):
    path = st.save_settings(st.set_value(Settings(), "temperature", "0.5"))
    before = path.read_text()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if failing == "replace":
        monkeypatch.setattr(st.os, "replace", full_disk)
    else:
        real_fdopen = st.os.fdopen

        class FullFile:
            def __init__(self, fd: int, *args, **kwargs) -> None:
                self.f = real_fdopen(fd, *args, **kwargs)

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                self.f.close()

            write = full_disk

        monkeypatch.setattr(st.os, "fdopen", FullFile)
    with pytest.raises(SettingsError, match="cannot write .*No space left on device"):
        st.save_settings(st.set_value(Settings(), "temperature", "0.9"))
    assert sorted(p.name for p in path.parent.iterdir()) == ["settings.toml"]
    assert path.read_text() == before


def test_theme_must_be_one_the_app_offers(dirs: Path):
    from textual.theme import BUILTIN_THEMES

    assert st.set_value(Settings(), "theme", "nord").theme == "nord"
    assert Settings().theme in BUILTIN_THEMES
    with pytest.raises(SettingsError, match=r"theme must be one of .*textual-dark.*, got 'nope'"):
        st.set_value(Settings(), "theme", "nope")
    # a file naming a theme this Textual lacks still loads: the app keeps its default theme then
    path = dirs / "cfg" / "settings.toml"
    path.parent.mkdir(parents=True)
    path.write_text('theme = "from-a-newer-textual"\n')
    assert st.load_settings().theme == "from-a-newer-textual"


def test_seed_must_fit_torchs_generator(dirs: Path):
    import torch

    assert st.set_value(Settings(), "seed", str(2**64 - 1)).sampling.seed == 2**64 - 1
    torch.Generator().manual_seed(2**64 - 1)  # the largest seed torch takes
    for text in (str(2**64), "99999999999999999999999"):
        with pytest.raises(SettingsError, match=rf"sampling.seed must be from 0 to 2\*\*64 - 1, got {text}"):
            st.set_value(Settings(), "seed", text)
    path = dirs / "cfg" / "settings.toml"
    path.parent.mkdir(parents=True)
    path.write_text(f"[sampling]\nseed = {2**64}\n")  # a file edited by hand
    with pytest.raises(SettingsError, match="sampling.seed must be from 0 to"):
        st.load_settings()

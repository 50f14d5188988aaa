import pytest

from sparkchat.engine.events import SamplingParams, Switches
from sparkchat.settings import Settings, load_settings, save_settings
from sparkchat.ui import prefs
from sparkchat.ui.prefs import ChatSettings, Prefs


def test_roundtrip_through_the_settings_file(tmp_path):
    path = tmp_path / "settings.toml"
    p = Prefs(ChatSettings(temperature=0.1, top_k=5, seed=7, system_prompt='be "terse"\nplease', thinking=False),
              Switches(mtp=False, draft_steps=2), theme="nord")
    prefs.save(p, path)
    assert prefs.load(path) == p


def test_other_settings_are_kept(tmp_path):
    path = tmp_path / "settings.toml"
    save_settings(Settings(model="/models/ling", device="cuda:1", endpoint="https://mirror.example"), path)
    prefs.save(Prefs(ChatSettings(temperature=0.3)), path)
    s = load_settings(path)
    assert (s.model, s.device, s.endpoint, s.sampling.temperature) == (
        "/models/ling", "cuda:1", "https://mirror.example", 0.3)


def test_defaults_follow_the_settings_module(tmp_path):
    p = prefs.load(tmp_path / "missing.toml")
    assert p.load_error is None
    assert p.chat.sampling() == SamplingParams()
    assert p.switches == Switches() and p.theme == Settings().theme


def test_unreadable_file_gives_defaults_and_is_never_overwritten(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text("temperature = [oops\n")
    p = prefs.load(path)
    assert p.load_error and "settings.toml" in p.load_error
    assert p.chat == ChatSettings()
    with pytest.raises(prefs.SettingsError):
        prefs.save(p, path)
    assert path.read_text() == "temperature = [oops\n"


def test_default_path_in_config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKCHAT_CONFIG_DIR", str(tmp_path))
    prefs.save(Prefs(theme="nord"))
    assert (tmp_path / "settings.toml").exists()
    assert prefs.load().theme == "nord"


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1},
                                    {"max_tokens": 0}, {"seed": -3}])
def test_chat_settings_validation(kwargs):
    with pytest.raises(ValueError):
        ChatSettings(**kwargs)


def test_chat_settings_from_a_conversation():
    assert ChatSettings.from_dict({"temperature": 0.5, "unknown": 1}).temperature == 0.5
    assert ChatSettings.from_dict({"top_p": 7}) == ChatSettings()  # a bad stored value: defaults


def test_sampling_params():
    params = ChatSettings(temperature=0.3, top_p=0.9, top_k=40, max_tokens=99, seed=1).sampling()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed) == (0.3, 0.9, 40, 99, 1)

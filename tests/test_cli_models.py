"""`sparkchat download / models / rm / info / config` end to end against the fake Hub."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest

from sparkchat import settings as st
from tests.hub_server import FakeRepo, serve_fake_hub, tiny_model_files

REPO = "org/tiny"


def run(argv: list[str]) -> int:
    """Through sparkchat.cli.main once the lead registers the module; a local parser until then."""
    from sparkchat import cli
    from sparkchat.cli import models

    if models in getattr(cli, "_COMMAND_MODULES", []):
        return cli.main(argv)
    parser = argparse.ArgumentParser(prog="sparkchat")
    models.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    server = serve_fake_hub(tmp_path, monkeypatch, {REPO: FakeRepo(tiny_model_files())})
    yield server
    server.stop()


def error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sparkchat: ") and "Traceback" not in err, err
    return lines[0]


def test_download_prints_path_and_progress(fake, capsys: pytest.CaptureFixture, tmp_path: Path):
    assert run(["download", REPO]) == 0
    out, err = capsys.readouterr()
    path = Path(out.strip())
    assert path.is_dir() and (path / "config.json").is_file() and path.is_relative_to(tmp_path)
    assert "org/tiny: 9.1 kB downloaded" in err
    assert run(["download", REPO]) == 0
    assert "already downloaded" in capsys.readouterr().err


def test_download_errors_are_one_line(fake, capsys: pytest.CaptureFixture):
    assert run(["download", "org/nope"]) == 3
    assert "not found" in error_line(capsys.readouterr().err)
    fake.token = "t"
    assert run(["download", REPO]) == 3
    assert "HF_TOKEN" in error_line(capsys.readouterr().err)
    assert run(["download", REPO, "--offline"]) == 3
    assert "not in the cache" in error_line(capsys.readouterr().err)


def test_download_uses_endpoint_from_settings(fake, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HF_ENDPOINT")
    s = st.Settings(hub_endpoint=fake.url)
    st.save_settings(s)
    assert run(["download", REPO]) == 0
    assert fake.log


def test_models_table_and_json(fake, capsys: pytest.CaptureFixture):
    assert run(["models"]) == 0
    assert "no local models" in capsys.readouterr().out
    run(["download", REPO])
    capsys.readouterr()
    assert run(["models"]) == 0
    out = capsys.readouterr().out
    assert REPO in out and "bf16" in out
    assert run(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == [REPO] and rows[0]["format"] == "bf16" and rows[0]["has_mtp"] is True


def test_rm(fake, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    run(["download", REPO])
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert run(["rm", REPO]) == 2  # no --yes and no terminal to ask on
    assert "--yes" in error_line(capsys.readouterr().err)
    assert run(["rm", REPO, "--yes"]) == 0
    assert "removed org/tiny" in capsys.readouterr().out
    assert run(["rm", REPO, "--yes"]) == 3
    assert "no local model" in error_line(capsys.readouterr().err)


def test_rm_asks_on_a_terminal(fake, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    run(["download", REPO])

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Tty("n\n"))
    assert run(["rm", REPO]) == 0
    from sparkchat import hub

    assert hub.find_local_model(REPO) is not None
    monkeypatch.setattr("sys.stdin", Tty("y\n"))
    assert run(["rm", REPO]) == 0
    assert hub.find_local_model(REPO) is None


def test_info(fake, capsys: pytest.CaptureFixture):
    assert run(["info"]) == 0
    out = capsys.readouterr().out
    for word in ("device", "memory", "torch", "triton", "mxfp4_kernels", "fp8_head", "mtp", "cuda_graphs",
                 "truncated_draft_head"):
        assert word in out
    assert run(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["optimizations"]) == {"mxfp4_kernels", "fp8_head", "mtp", "cuda_graphs", "truncated_draft_head"}
    assert data["optimizations"]["mtp"]["available"] is None  # default model not downloaded
    st.save_settings(st.Settings(model=REPO))
    run(["download", REPO])
    capsys.readouterr()
    run(["info", "--json"])
    assert json.loads(capsys.readouterr().out)["optimizations"]["mtp"]["available"] is True


def test_config_show_set_unset(fake, capsys: pytest.CaptureFixture, tmp_path: Path):
    assert run(["config"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "config" / "settings.toml") in out and "not created yet" in out
    assert "sampling.temperature = 0.0" in out

    assert run(["config", "set", "temperature", "0.7"]) == 0
    assert st.load_settings().sampling.temperature == 0.7
    capsys.readouterr()
    run(["config"])
    assert "sampling.temperature = 0.7  # changed" in capsys.readouterr().out

    assert run(["config", "unset", "temperature"]) == 0
    assert st.load_settings().sampling.temperature == 0.0


@pytest.mark.parametrize("argv, words", [
    (["config", "set", "temperature", "hot"], "must be a number"),
    (["config", "set", "nonsense", "1"], "unknown setting"),
    (["config", "set", "draft_steps", "99"], "between 1 and"),
])
def test_config_set_rejects(fake, capsys: pytest.CaptureFixture, argv: list[str], words: str):
    assert run(argv) == 2
    assert words in error_line(capsys.readouterr().err)


def test_config_with_broken_file(fake, capsys: pytest.CaptureFixture, tmp_path: Path):
    path = tmp_path / "config" / "settings.toml"
    path.parent.mkdir(parents=True)
    path.write_text("model = \n")
    for argv in (["config"], ["config", "set", "top_k", "3"], ["download", REPO]):
        assert run(argv) == 2
        line = error_line(capsys.readouterr().err)
        assert str(path) in line and "line 1" in line

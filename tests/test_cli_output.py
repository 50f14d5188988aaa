"""Where the output goes wrong: a reader that goes away (`| head`) ends the command quietly, a full disk
is one line; neither is a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sparkchat.cli import main


def _run_into(stdout, *args: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPARKCHAT_CONFIG_DIR=str(tmp_path / "cfg"), SPARKCHAT_DATA_DIR=str(tmp_path / "data"),
               HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "sparkchat", *args], stdout=stdout, stderr=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, text=True, env=env, timeout=300)


def _closed_pipe(*args: str, tmp_path) -> subprocess.CompletedProcess:
    """The command writing into a pipe whose reader has already gone (`| head -n1` after its line)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return _run_into(write, *args, tmp_path=tmp_path)
    finally:
        os.close(write)


def _ask(model_dir) -> list[str]:
    return ["ask", "hi", "--model", str(model_dir), "--device", "cpu", "--max-tokens", "4"]


@pytest.mark.parametrize("command", ["config", "ask", "ask --json"])
def test_a_closed_pipe_ends_quietly(tiny_model_dir, tmp_path, command):
    args = ["config"] if command == "config" else _ask(tiny_model_dir) + command.split()[1:]
    r = _closed_pipe(*args, tmp_path=tmp_path)
    assert r.returncode == 141 and r.stderr == ""  # 128 + SIGPIPE, as a shell shows `yes | head`


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", ["config", "ask", "ask --json"])
def test_a_full_disk_is_one_line(tiny_model_dir, tmp_path, command):
    args = ["config"] if command == "config" else _ask(tiny_model_dir) + command.split()[1:]
    with open("/dev/full", "w") as full:
        r = _run_into(full, *args, tmp_path=tmp_path)
    assert r.returncode == 1
    assert r.stderr == "sparkchat: error: cannot write the output: No space left on device\n"


def test_other_os_errors_are_not_called_output_errors(monkeypatch):
    from sparkchat.cli import models

    def unreadable(args):
        raise PermissionError(13, "Permission denied", "/some/file")

    monkeypatch.setattr(models, "cmd_config_show", unreadable)
    with pytest.raises(PermissionError):  # a bug to see, not "cannot write the output"
        main(["config"])

"""Every command-line flag is documented, and no bad input — fuzzed flags, values and prompts — ends in
a traceback: each ends with an exit code and at most a one-line message."""

from __future__ import annotations

import io
import random
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from sparkchat.cli import build_parser, main

README = (Path(__file__).parent.parent / "README.md").read_text()


def _flags(parser) -> set[str]:
    out = set()
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and opt != "--help":
                out.add(opt)
    return out


def _subparsers():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return parser, sub.choices


def test_every_flag_is_in_help_and_in_the_readme():
    parser, commands = _subparsers()
    for name, sp in [("sparkchat", parser), *commands.items()]:
        helptext = sp.format_help()
        for flag in _flags(sp):
            base = "--" + flag[len("--no-"):] if flag.startswith("--no-") else flag
            assert flag in helptext or base in helptext, (name, flag)
            assert base in README, f"`sparkchat {name} {base}` is not documented in the README"
        if name != "sparkchat":
            assert f"sparkchat {name}" in README, f"`sparkchat {name}` is not documented in the README"


def _run(argv: list[str]) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse usage errors
            code = e.code if isinstance(e.code, int) else 2
    return code, err.getvalue()


JUNK = ["", "-1", "0", "1e309", "nan", "abc", "--", "/nonexistent/dir", "9" * 30, "\x00", "ünïcode", "-5.5"]


@pytest.mark.parametrize("seed", range(3))
def test_fuzzed_flags_never_raise(tiny_model_dir, tmp_path, monkeypatch, seed):
    monkeypatch.setenv("SPARKCHAT_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("SPARKCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    rng = random.Random(seed)
    _, commands = _subparsers()
    ask_flags = sorted(_flags(commands["ask"]) - {"--endpoint"})
    for _ in range(8):
        argv = ["ask", rng.choice(["hi", "", "x" * 500, "\u2603 ünï", "--"]), "--model", str(tiny_model_dir),
                "--max-tokens", "2", "--max-context", "64"]
        for flag in rng.sample(ask_flags, 3):
            argv.append(flag)
            if rng.random() < 0.8:
                argv.append(rng.choice(JUNK + [str(tiny_model_dir)]))
        code, err = _run(argv)
        assert isinstance(code, int), argv
        assert "Traceback" not in err, (argv, err)
        if code not in (0, 2):  # usage errors are argparse's own two lines
            assert len([line for line in err.splitlines() if line.strip()]) <= 1, (argv, err)
    for argv in (["config", "set", "temperature", "hot"], ["config", "set", "nope", "1"], ["rm", "nothing", "-y"],
                 ["download", "not a repo", "--offline"], ["bench", "--context", "-3"], ["models", "--json"]):
        code, err = _run(argv)
        assert isinstance(code, int) and "Traceback" not in err, (argv, err)
        if code not in (0, 2):
            assert len([line for line in err.splitlines() if line.strip()]) <= 1, (argv, err)
        assert not re.search(r"File \".*\", line \d+", err)

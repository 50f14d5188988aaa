"""`sparkchat ask`: the JSON contract, piping, and one readable line for every bad input."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparkchat.cli import main


def run_cli(*args: str, stdin: str | None = None, **env_extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
    return subprocess.run([sys.executable, "-m", "sparkchat.cli", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=300)


def test_ask_json_contract(tiny_model_dir):
    r = run_cli("ask", "hello", "--model", str(tiny_model_dir), "--json", "--max-tokens", "8", "--no-think")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("text", "token_ids", "prompt_token_ids", "finish_reason", "stats", "model", "switches"):
        assert key in out
    assert out["finish_reason"] in ("stop", "length")
    assert 1 <= len(out["token_ids"]) <= 8
    s = out["stats"]
    assert s["prompt_tokens"] == len(out["prompt_token_ids"]) and s["generated_tokens"] == len(out["token_ids"])
    assert s["ttft_s"] > 0 and s["prefill_s"] > 0
    assert out["prompt_token_ids"][-2:] != []


def test_ask_streams_and_pipes_stdin(tiny_model_dir, capsys, monkeypatch):
    r = run_cli("ask", "summarize", "--model", str(tiny_model_dir), "--json", "--max-tokens", "3",
                stdin="some piped text")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    plain = run_cli("ask", "summarize", "--model", str(tiny_model_dir), "--json", "--max-tokens", "3")
    assert len(out["prompt_token_ids"]) > len(json.loads(plain.stdout)["prompt_token_ids"])
    streamed = run_cli("ask", "hello", "--model", str(tiny_model_dir), "--max-tokens", "5", "--stats",
                       "--temperature", "0.8", "--seed", "3")
    assert streamed.returncode == 0 and "tok/s" in streamed.stderr
    assert "% of limit " in streamed.stderr and " MB/tok" in streamed.stderr  # the bytes a token reads and the memory's limit


def test_ask_sampling_is_reproducible_with_a_seed(tiny_model_dir):
    a = run_cli("ask", "hi", "--model", str(tiny_model_dir), "--json", "--max-tokens", "12", "--temperature",
                "1.0", "--seed", "5")
    b = run_cli("ask", "hi", "--model", str(tiny_model_dir), "--json", "--max-tokens", "12", "--temperature",
                "1.0", "--seed", "5")
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


def _one_line_error(r: subprocess.CompletedProcess, code: int, needle: str) -> None:
    assert r.returncode == code
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_bad_inputs_give_one_line(tiny_model_dir, tmp_path):
    _one_line_error(run_cli("ask", "hi", "--model", str(tmp_path / "nope")), 3, "not found")
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _one_line_error(run_cli("ask", "hi", "--model", str(other)), 3, "unsupported model_type 'llama'")
    # a truncated safetensors file
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    for f in tiny_model_dir.iterdir():
        (trunc / f.name).write_bytes(f.read_bytes())
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    _one_line_error(run_cli("ask", "hi", "--model", str(trunc)), 3, "truncated")
    _one_line_error(run_cli("ask", "--model", str(tiny_model_dir), stdin=""), 2, "no prompt")
    _one_line_error(run_cli("ask", "hi", "--model", str(tiny_model_dir), "--max-tokens", "0"), 2, "--max-tokens")
    _one_line_error(run_cli("ask", "hi", "--model", str(tiny_model_dir), "--max-context", "40",
                            stdin="a long piece of text " * 30), 3, "context holds 40")


def test_missing_and_misshapen_tensors_are_named(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from sparkchat.engine.errors import ModelError
    from sparkchat.engine.session import Engine

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    t = load_file(str(broken / "model.safetensors"))
    del t["model.layers.0.attention.q_proj.weight"]
    save_file(t, str(broken / "model.safetensors"))
    with pytest.raises(ModelError, match=r"model.layers.0.attention.q_proj.weight is missing"):
        Engine.load(broken, device="cpu")
    t["model.layers.0.attention.q_proj.weight"] = t["model.layers.0.attention.k_proj.weight"][:5].clone()
    save_file(t, str(broken / "model.safetensors"))
    with pytest.raises(ModelError, match=r"q_proj.weight in model.safetensors has shape \[5, 64\]"):
        Engine.load(broken, device="cpu")


def test_help_lists_every_ask_flag(capsys):
    with pytest.raises(SystemExit):
        main(["ask", "--help"])
    text = capsys.readouterr().out
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for flag in ("--model", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--device",
                 "--dtype", "--system", "--json", "--stats", "--think", "--max-context", "--mtp",
                 "--draft-steps", "--fp8-head", "--mxfp4-kernels"):
        assert flag in text
        assert flag in readme, f"{flag} is not documented in the README"


def test_demo_model_is_the_default_when_nothing_is_configured(tmp_path):
    env = dict(SPARKCHAT_CONFIG_DIR=str(tmp_path / "cfg"), SPARKCHAT_DATA_DIR=str(tmp_path / "data"),
               HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"), HF_HUB_OFFLINE="1")
    r = run_cli("ask", "What does str.split do?", "--json", "--max-tokens", "12", **env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["model"] == "demo" and out["stats"]["generated_tokens"] >= 1
    assert "demo model" in r.stderr and "sparkchat download inclusionAI/Ling-3.0-flash-fp4" in r.stderr
    # a model the user configured but does not have is an error, not a silent fallback to the demo
    (tmp_path / "cfg").mkdir(exist_ok=True)
    (tmp_path / "cfg" / "settings.toml").write_text('model = "someone/missing-model"\n')
    r = run_cli("ask", "hi", "--json", **env)
    _one_line_error(r, 3, "someone/missing-model")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_sees_the_load_in_bytes_and_a_script_sees_nothing(tiny_model_dir, monkeypatch):
    import argparse

    from sparkchat.cli.ask import load_engine, terminal_load_progress

    with terminal_load_progress("m") as progress:  # pytest's stderr is no terminal
        assert progress is None
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    args = argparse.Namespace(model=str(tiny_model_dir), device="cpu", dtype=None, max_context=64)
    engine = load_engine(args)
    assert engine.name == tiny_model_dir.name
    shown = term.getvalue()
    assert f"loading {tiny_model_dir.name}" in shown
    assert re.search(r"[\d.]+/[\d.]+ [kMG]?B", shown)  # rich's byte column: done/total


def _ask_in_process(argv: list[str], capsys, monkeypatch, stdin: str = "") -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(["ask", "--device", "cpu", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("events_before", [3, 0])
def test_ctrl_c_keeps_the_answer_so_far_as_json(tiny_model_dir, capsys, monkeypatch, events_before):
    from sparkchat.cli import ask

    real_load = ask.load_engine

    def load_then_interrupt(args):
        engine = real_load(args)
        generate = engine.generate_ids

        def interrupted(prompt_ids, params, **kwargs):
            params.ignore_eos = True  # a random model may stop at once
            for i, event in enumerate(generate(prompt_ids, params, **kwargs)):
                if i == events_before:
                    raise KeyboardInterrupt  # what Ctrl-C raises mid-answer
                yield event

        engine.generate_ids = interrupted
        return engine

    monkeypatch.setattr(ask, "load_engine", load_then_interrupt)
    code, out, err = _ask_in_process(["hi", "--model", str(tiny_model_dir), "--json", "--max-tokens", "50"],
                                     capsys, monkeypatch)
    assert code == 130 and err == "sparkchat: interrupted\n"
    answer = json.loads(out)
    for key in ("text", "answer", "reasoning", "token_ids", "prompt_token_ids", "finish_reason", "stats", "model",
                "switches"):
        assert key in answer
    assert answer["finish_reason"] == "cancelled"  # the engine's word for an answer stopped mid-way
    assert answer["stats"]["prompt_tokens"] == len(answer["prompt_token_ids"]) > 0
    if events_before:
        assert 3 <= len(answer["token_ids"]) < 50  # (a random model's first bytes may not be text yet)
    else:  # interrupted in the prefill: nothing yet, still one object
        assert answer["token_ids"] == [] and answer["text"] == ""


def test_seeds_torch_cannot_take_are_refused(tiny_model_dir, capsys, monkeypatch):
    for seed in (str(2**64), "99999999999999999999999"):
        code, _, err = _ask_in_process(["hi", "--model", str(tiny_model_dir), "--seed", seed, "-t", "1"],
                                       capsys, monkeypatch)
        assert code == 2 and err == f"sparkchat: error: --seed must be from 0 to 2**64 - 1, got {seed}\n"
    # the largest one works
    code, out, err = _ask_in_process(["hi", "--model", str(tiny_model_dir), "--seed", str(2**64 - 1), "-t", "1",
                                      "--max-tokens", "2", "--json"], capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out)["stats"]["generated_tokens"] >= 1


@pytest.mark.parametrize("flags,name,value", [(["--temperature", "inf"], "--temperature", "inf"),
                                              (["-t", "nan"], "--temperature", "nan"),
                                              (["--temperature=-inf"], "--temperature", "-inf"),
                                              (["--top-p", "inf"], "--top-p", "inf"),
                                              (["--top-p", "nan"], "--top-p", "nan")])
def test_infinite_sampling_values_say_finite(tiny_model_dir, capsys, monkeypatch, flags, name, value):
    code, _, err = _ask_in_process(["hi", "--model", str(tiny_model_dir), *flags], capsys, monkeypatch)
    assert code == 2 and err == f"sparkchat: error: {name} must be a finite number, got {float(value)}\n"


def test_a_prompt_past_the_models_positions_names_the_model_limit(tiny_model_dir, capsys, monkeypatch):
    long_text = "a long piece of text " * 1200  # past the tiny model's 4096 positions
    code, _, err = _ask_in_process(["summarize", "--model", str(tiny_model_dir), "--max-context", "100000"],
                                   capsys, monkeypatch, stdin=long_text)
    assert code == 3 and err.count("\n") == 1
    assert "but the model takes at most 4096 positions; shorten the prompt" in err
    assert "--max-context" not in err  # raising it cannot help
    # below the model's limit, --max-context is what binds, and the message says to raise it
    code, _, err = _ask_in_process(["summarize", "--model", str(tiny_model_dir), "--max-context", "1000"],
                                   capsys, monkeypatch, stdin=long_text)
    assert code == 3 and "context holds 1000; start a new chat or raise --max-context" in err

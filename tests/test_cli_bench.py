"""`sparkchat bench`: every bad number is one readable line before anything is built or measured."""

from __future__ import annotations

import pytest
import torch

from sparkchat.cli import main


def _error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("sparkchat") and "Traceback" not in err, err
    return lines[0]


def _bench(config, *flags: str) -> int:
    return main(["bench", "--config", str(config), "--device", "cpu", "--iters", "1", *flags])


@pytest.mark.parametrize("flags,words", [
    (["--layers", "0"], "argument --layers: must be at least 1, got 0"),
    (["--layers", "-1"], "argument --layers: must be at least 1, got -1"),
    (["--prefill", "-3"], "argument --prefill: must be at least 0, got -3"),
    (["--context", "0"], "argument --context: must be at least 1, got 0"),
    (["--iters", "x"], "argument --iters: must be an integer, got 'x'"),
])
def test_bad_numbers_are_usage_errors(tiny_model_dir, capsys, flags, words):
    with pytest.raises(SystemExit) as e:
        _bench(tiny_model_dir / "config.json", *flags)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--context", "--prefill"])
def test_more_positions_than_the_model_has(tiny_model_dir, capsys, flag):
    assert _bench(tiny_model_dir / "config.json", flag, "5000") == 2  # the tiny model has 4096
    line = _error_line(capsys)
    assert f"{flag} 5000 is more than the model's 4096 positions allow (at most 3968" in line


@pytest.mark.parametrize("text,kind", [("[1, 2]", "list"), ('"x"', "str"), ("null", "NoneType")])
def test_a_config_that_is_not_a_json_object(tmp_path, capsys, text, kind):
    path = tmp_path / "c.json"
    path.write_text(text)
    assert _bench(path) == 3
    assert f"must hold a JSON object (a model's config.json), not a JSON {kind}" in _error_line(capsys)


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 40000000000 bytes. Error code 12 (Cannot allocate memory)"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 37.25 GiB. GPU 0 has a total capacity of "
                           "79.19 GiB of which 1.2 GiB is free.\nSee documentation for Memory Management"),
])
def test_running_out_of_memory_is_one_line(tiny_model_dir, capsys, monkeypatch, error):
    def no_memory(*args, **kwargs):
        raise error

    monkeypatch.setattr("sparkchat.engine.bench.run_bench", no_memory)
    assert _bench(tiny_model_dir / "config.json", "--context", "16") == 1
    line = _error_line(capsys)
    assert line.startswith("sparkchat: error: out of memory (tried to allocate ") and "shorter context" in line


def test_other_runtime_errors_are_not_called_out_of_memory(tiny_model_dir, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr("sparkchat.engine.bench.run_bench", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        _bench(tiny_model_dir / "config.json", "--context", "16")


def test_the_context_limit_itself_is_allowed(tiny_model_dir, monkeypatch):
    seen: dict[str, int] = {}

    def record(model, *, context: int, **kwargs) -> None:
        seen["context"], seen["positions"] = context, model.rotary.cos.shape[0]
        raise KeyboardInterrupt  # stop before measuring anything

    monkeypatch.setattr("sparkchat.engine.bench.run_bench", record)
    assert _bench(tiny_model_dir / "config.json", "--context", "3968") == 130
    assert seen == {"context": 3968, "positions": 4096}

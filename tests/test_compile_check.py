"""The compile probe behind the kernels switch: a GPU Triton cannot build for gets a one-line reason."""

from __future__ import annotations

import stat

import pytest
import torch

triton = pytest.importorskip("triton")

from sparkchat.engine import fastpath  # noqa: E402
from sparkchat.engine.kernels import compile_check  # noqa: E402
from sparkchat.engine.kernels.compile_check import compile_failure  # noqa: E402

OLD_PTXAS = """#!/bin/sh
# answers as CUDA 12.8's ptxas does, which predates sm_121a
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 12.8, V12.8.93"; exit 0; fi
echo "ptxas fatal   : Value 'sm_121a' is not defined for option 'gpu-name'" >&2
exit 1
"""


@pytest.fixture
def fresh_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))  # compile again, not from disk
    compile_failure.cache_clear()
    yield
    compile_failure.cache_clear()


@pytest.mark.parametrize("arch", [90, 121])  # the H200 we measure on; the DGX Spark's GB10
def test_the_installed_triton_compiles_for_the_hopper_and_the_spark(arch, fresh_probe):
    assert compile_failure(arch) is None


def test_a_ptxas_without_sm_121a_is_a_one_line_reason_naming_the_fix(tmp_path, monkeypatch, fresh_probe):
    ptxas = tmp_path / "ptxas"
    ptxas.write_text(OLD_PTXAS)
    ptxas.chmod(ptxas.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("TRITON_PTXAS_BLACKWELL_PATH", str(ptxas))
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(ptxas))
    why = compile_failure(121)
    assert why is not None and "\n" not in why
    assert why.startswith("Triton cannot compile for sm_121 (ptxas fatal")
    assert "'sm_121a' is not defined" in why and "TRITON_PTXAS_BLACKWELL_PATH" in why


def test_the_advice_for_a_triton_without_a_blackwell_ptxas():
    assert "TRITON_PTXAS_PATH" in compile_check._advice(90) and "3.6" in compile_check._advice(90)


def test_the_kernels_switch_and_the_compiled_torch_path_follow_the_probe(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 1))
    monkeypatch.setattr(compile_check, "compile_failure", lambda arch: f"no sm_{arch}")
    assert fastpath.kernels_unavailable_reason(torch.device("cuda"), torch.bfloat16) == "no sm_121"
    from sparkchat.engine import session

    assert not session._triton_builds_here(torch.device("cuda"))  # nor Inductor's or fla-core's kernels
    monkeypatch.setattr(compile_check, "compile_failure", lambda arch: None)
    assert fastpath.kernels_unavailable_reason(torch.device("cuda"), torch.bfloat16) is None
    assert session._triton_builds_here(torch.device("cuda"))

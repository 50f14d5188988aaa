"""When the decode kernels launch with programmatic dependent launch (kernels/pdl.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparkchat.engine.kernels import pdl  # noqa: E402


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of a chosen compute capability, as far as pdl_enabled can tell."""
    def install(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        monkeypatch.setattr(pdl, "_ENABLED", {})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("SPARKCHAT_PDL", raising=False)
    return install


@pytest.mark.parametrize("capability, enabled", [((8, 0), False), ((8, 9), False), ((9, 0), True),
                                                 ((12, 1), True)])
def test_pdl_needs_sm90_or_newer(fake_gpu, capability, enabled):
    fake_gpu(capability)
    assert pdl.pdl_enabled("cuda") is enabled
    assert pdl.pdl_args("cuda") == ({"PDL": True, "launch_pdl": True} if enabled else {})


def test_pdl_is_off_on_the_cpu_under_the_interpreter_and_when_switched_off(fake_gpu, monkeypatch):
    fake_gpu((9, 0))
    assert pdl.pdl_enabled("cpu") is False
    monkeypatch.setenv("SPARKCHAT_PDL", "0")
    assert pdl.pdl_enabled("cuda") is False
    monkeypatch.delenv("SPARKCHAT_PDL")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.pdl_enabled("cuda") is False
    monkeypatch.delenv("TRITON_INTERPRET")
    assert pdl.pdl_enabled("cuda") is True

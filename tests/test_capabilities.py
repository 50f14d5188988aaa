"""sparkchat.engine.capabilities: the availability table and detection on this machine."""

from __future__ import annotations

import pytest

from sparkchat.engine import capabilities as caps


def test_cpu_machine_table():
    t = caps.optimizations(cuda=False, compute_capability=None, triton_ok=True)
    assert list(t) == list(caps.OPTIMIZATIONS)
    assert t["mxfp4_kernels"].available is False and "CUDA" in t["mxfp4_kernels"].reason
    assert t["fp8_head"].available is True and "reference path on CPU" in t["fp8_head"].reason
    assert t["cuda_graphs"].available is False
    assert t["mtp"].available is None and "model" in t["mtp"].reason
    assert t["truncated_draft_head"].available is None and "MTP" in t["truncated_draft_head"].reason
    cpu = caps.optimizations(cuda=False, compute_capability=None, triton_ok=True, has_mtp=True)
    assert cpu["truncated_draft_head"].available is True and "CPU" in cpu["truncated_draft_head"].reason


@pytest.mark.parametrize("has_mtp, available", [(True, True), (False, False), (None, None)])
def test_mtp_follows_the_model(has_mtp, available):
    t = caps.optimizations(cuda=True, compute_capability=(12, 1), triton_ok=True, has_mtp=has_mtp)
    assert t["mtp"].available is available
    assert t["truncated_draft_head"].available is available  # it drafts with the MTP layer


def test_gb10_everything_available():
    t = caps.optimizations(cuda=True, compute_capability=(12, 1), triton_ok=True, has_mtp=True)
    assert all(a.available and a.reason is None for a in t.values())


def test_cuda_without_triton_or_old_gpu():
    t = caps.optimizations(cuda=True, compute_capability=(12, 1), triton_ok=False, triton_error="Triton is missing")
    assert t["mxfp4_kernels"].available is False and t["mxfp4_kernels"].reason == "Triton is missing"
    old = caps.optimizations(cuda=True, compute_capability=(7, 5), triton_ok=True)
    assert old["mxfp4_kernels"].available is False and "7.5" in old["mxfp4_kernels"].reason
    assert "dequantized" in old["fp8_head"].reason and old["cuda_graphs"].available


def test_a_gpu_triton_cannot_compile_for_turns_the_kernels_and_graphs_off_with_the_reason():
    why = "Triton cannot compile for sm_121 (ptxas fatal : ...); point TRITON_PTXAS_BLACKWELL_PATH at ..."
    t = caps.optimizations(cuda=True, compute_capability=(12, 1), triton_ok=True, has_mtp=True, compile_error=why)
    assert t["mxfp4_kernels"].available is False and t["mxfp4_kernels"].reason == why
    assert t["cuda_graphs"].available is False and t["cuda_graphs"].reason.endswith(why)
    assert t["fp8_head"].available and t["mtp"].available  # the torch path keeps these


def test_no_torch_makes_everything_unavailable():
    t = caps.optimizations(cuda=False, compute_capability=None, triton_ok=False, torch_error="PyTorch is not usable")
    assert all(a.available is False and a.reason == "PyTorch is not usable" for a in t.values())


def test_detect_here():
    import torch

    c = caps.detect(has_mtp=True)
    assert c.torch_version == torch.__version__
    assert c.cuda_available == torch.cuda.is_available()
    assert c.total_memory_bytes > 0 and 0 < c.free_memory_bytes <= max(c.total_memory_bytes, c.free_memory_bytes)
    assert c.optimizations["mtp"].available is True
    assert c.to_dict()["optimizations"]["cuda_graphs"]["available"] == c.cuda_available
    if not c.cuda_available:
        assert c.device == "cpu" and not c.unified_memory and c.compute_capability is None


def test_unified_memory_detection():
    assert caps._is_unified("NVIDIA GB10")
    assert not caps._is_unified("NVIDIA H200")


def test_host_memory():
    total, avail = caps.host_memory()
    assert total > 0 and 0 < avail <= total

"""The decode kernels' instruction mix, compiled for sm_90 on the CPU (benchmarks/sass_stats.py): guards
against a change that silently brings back shuffles or shared memory into the router, or loses the
bf16x2 MoE products' saving. No GPU needed; skipped where Triton's bundled tools are missing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def _tools():
    from benchmarks import sass_stats
    if not sass_stats.CUOBJDUMP.exists():
        pytest.skip("Triton's bundled cuobjdump is missing")
    return sass_stats


def test_router_selections_use_warp_reductions_without_shared_memory():
    s = _tools()
    ops = [s._op(i) for i in s.router_sass(90)]
    assert ops.count("REDUX") >= 8  # one per pick at least
    assert ops.count("SHFL") < 100  # the argmax version took 195
    assert "STS" not in ops and "BAR" not in ops


def test_packed_moe_products_take_fewer_instructions_per_weight():
    s = _tools()
    fma, _ = s.moe_loop(1, 1, False, 90)
    packed, _ = s.moe_loop(1, 1, True, 90)
    assert len(packed) < 0.85 * len(fma), (len(packed), len(fma))  # measured 915 against 1204

"""The decode kernels' instruction mix, compiled for sm_90 on the CPU (benchmarks/sass_stats.py): guards
against a change that silently brings back shuffles or shared memory into the router, or loses the
bf16x2 MoE products' saving. No GPU needed; skipped where Triton's bundled tools are missing."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
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
    from sparkchat.engine.kernels import router as r
    sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "w_ptr": "*fp32", "scaling": "fp32"}
    cx = dict(E=512, G=8, TG=4, K=8, KP=8, RENORM=True, T=1, SPLIT=10, PDL=True)
    ops = [s._op(i) for i in s.compile_sass(r.route_kernel, sig, cx, r.ROUTE_WARPS, 90)]
    assert ops.count("REDUX") >= 8  # one per pick at least
    assert ops.count("SHFL") < 100  # the argmax version took 195
    assert "STS" not in ops and "BAR" not in ops


def test_packed_moe_products_take_fewer_instructions_per_weight():
    s = _tools()
    from sparkchat.engine.kernels import mxfp4_moe as m
    base = m.moe_config(1, 2560, 768)
    sig = {"x_ptr": "*bf16", "ids_ptr": "*i32", "rw_ptr": "*fp32", "w13_ptr": "*i32", "s13_ptr": "*u8",
           "act_ptr": "*fp32", "limit": "fp32"}
    counts = {}
    for packed in (False, True):
        meta = dict(m._plan(1, 8, 2560, 768, replace(base, packed=packed)).meta1)
        warps = meta.pop("num_warps")
        body = s.loop_body(s.compile_sass(m.mxfp4_moe_stage1_kernel, sig, {**meta, "PDL": True}, warps, 90))
        counts[packed] = len(body)
    assert counts[True] < 0.85 * counts[False], counts  # measured 915 against 1204

"""The timeline arithmetic of benchmarks/profile_step.py (CPU): GEMV roles and exposed time."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import profile_step  # noqa: E402


def test_gemv_roles_follow_the_layer_order():
    names = ["fp8_gemv_kernel", "kda_decode_kernel", "fp8_gemv_kernel", "splitk_add_norm_kernel",  # KDA layer
             "fp8_gemv_kernel", "fp8_gemv_kernel", "route_kernel", "fp8_gemv_kernel",  # router, shared, down
             "mxfp4_moe_stage1_kernel", "mxfp4_moe_stage2_kernel", "splitk_add_norm_kernel",
             "fp8_gemv_kernel", "mla_combine_unfold_kernel", "fp8_gemv_kernel", "splitk_add_norm_kernel",
             "fp8_gemv_kernel", "fp8_gemv_kernel", "splitk_add_norm_kernel",  # a dense MLP
             "fp8_gemv_kernel"]
    roles = profile_step.gemv_roles(names)
    assert [r for r in roles if r.startswith("gemv")] == [
        "gemv attention input", "gemv attention output", "gemv router logits", "gemv shared gate|up",
        "gemv shared down", "gemv attention input", "gemv attention output", "gemv mlp gate|up", "gemv mlp down",
        "gemv head"]
    assert roles[1] == "kda_decode_kernel"


def test_exposed_time_sums_to_the_wall_and_credits_what_each_kernel_adds():
    spans = [(0.0, 10.0, "a"), (2.0, 4.0, "b"), (3.0, 12.0, "c"), (11.0, 11.5, "b"), (14.0, 15.0, "d")]
    got = profile_step.exposed_us(spans)
    # ends in order: b 4 (0..4), a 10, b 11.5, c 12, then d 15 with the idle gap before it (its launch)
    assert got == {"b": (5.5, 2), "a": (6.0, 1), "c": (0.5, 1), "d": (3.0, 1)}
    assert sum(us for us, _ in got.values()) == 15.0

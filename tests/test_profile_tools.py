"""The developer tools on the CPU: profile_step's timeline arithmetic (GEMV roles, exposed time), its switch
alternation and logits check, and the switches benchmarks/gpu_queue.sh sets."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

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


def test_gemv_roles_without_the_add_norm_kernels():
    """The opt-in fusions drop an add+norm: the output projection's own (one token), or the one after a
    MoE layer (done by its stage 2); with the shared expert inside the stages only the router GEMV is left."""
    names = ["fp8_gemv_kernel", "kda_decode_kernel", "fp8_gemv_kernel",  # KDA layer, o_proj with its add+norm
             "fp8_gemv_kernel", "route_kernel", "mxfp4_moe_stage1_kernel", "mxfp4_moe_stage2_kernel",  # + norm
             "fp8_gemv_kernel", "kda_decode_kernel", "fp8_gemv_kernel", "splitk_add_norm_kernel",
             "fp8_gemv_kernel", "fp8_gemv_kernel", "route_kernel", "mxfp4_moe_stage1_kernel",
             "mxfp4_moe_stage2_kernel", "fp8_gemv_kernel"]
    roles = [r for r in profile_step.gemv_roles(names) if r.startswith("gemv")]
    assert roles == ["gemv attention input", "gemv attention output", "gemv router logits",
                     "gemv attention input", "gemv attention output", "gemv router logits", "gemv shared gate|up",
                     "gemv head"]


def test_exposed_time_sums_to_the_wall_and_credits_what_each_kernel_adds():
    spans = [(0.0, 10.0, "a"), (2.0, 4.0, "b"), (3.0, 12.0, "c"), (11.0, 11.5, "b"), (14.0, 15.0, "d")]
    got = profile_step.exposed_us(spans)
    # ends in order: b 4 (0..4), a 10, b 11.5, c 12, then d 15 with the idle gap before it (its launch)
    assert got == {"b": (5.5, 2), "a": (6.0, 1), "c": (0.5, 1), "d": (3.0, 1)}
    assert sum(us for us, _ in got.values()) == 15.0


def test_switch_alternation_sets_several_together_and_restores_them(monkeypatch):
    """--switch A=1+B=3 times both set, then both 0; NAME=V1,V2 each value, then 0 (after an untimed pass of
    the first variant); afterwards every switch is as it was, so the next --switch is timed against the same
    baseline."""
    import os
    import types

    seen = []
    monkeypatch.setattr(profile_step, "fastpath", types.SimpleNamespace(
        install=lambda *a, **k: seen.append((os.environ.get("SPARKCHAT_T_A"), os.environ.get("SPARKCHAT_T_B")))))
    monkeypatch.setattr(profile_step, "graph_step_ms", lambda model, state, tokens=1: 1.0)
    monkeypatch.setattr(profile_step, "step_logits", lambda model, state, tokens=1: torch.ones(tokens, 8))
    monkeypatch.setenv("SPARKCHAT_T_B", "7")
    monkeypatch.delenv("SPARKCHAT_T_A", raising=False)
    profile_step.alternate(None, None, "SPARKCHAT_T_A=1+SPARKCHAT_T_B=3", rounds=1)
    assert seen == [("1", "3")] + [("1", "3"), ("0", "0"), (None, "7")]  # an untimed pass of the first first
    seen.clear()
    profile_step.alternate(None, None, "SPARKCHAT_T_A=1,2", rounds=2)
    assert seen == [("1", "7")] + [("1", "7"), ("2", "7"), ("0", "7")] * 2 + [(None, "7")]


def test_switch_alternation_summarizes_each_variant_with_its_logits_against_off(monkeypatch, capsys):
    """After the rounds, each variant's median step and verify, and its fixed step's logits compared with
    the switches-off variant's: a variant that broke the answer says so beside its time."""
    import types

    monkeypatch.setattr(profile_step, "fastpath", types.SimpleNamespace(install=lambda *a, **k: None))
    times = iter([1.0, 1.0,  # the untimed pass, which must not count
                  2.0, 4.0, 3.0, 5.0, 2.2, 4.4, 3.0, 5.0, 2.1, 4.2, 3.0, 5.0])
    monkeypatch.setattr(profile_step, "graph_step_ms", lambda model, state, tokens=1: next(times))
    answers = iter([torch.full((1, 8), float("nan")), torch.ones(4, 8), torch.ones(1, 8), torch.ones(4, 8)])
    monkeypatch.setattr(profile_step, "step_logits", lambda model, state, tokens=1: next(answers))
    monkeypatch.delenv("SPARKCHAT_T_A", raising=False)
    profile_step.alternate(None, None, "SPARKCHAT_T_A=1", rounds=3)
    out = capsys.readouterr().out
    assert "SPARKCHAT_T_A=1: step 2.100 ms, verify 4.200 ms; 1 tokens: NOT FINITE, 4 tokens: max diff 0.0%" in out
    assert "SPARKCHAT_T_A=0: step 3.000 ms, verify 5.000 ms; 1 tokens: max diff 0.0% of scale, argmax 1/1" in out


def test_logits_agreement_reports_the_largest_row_difference_and_argmax():
    b = torch.tensor([[1.0, 4.0, 2.0], [3.0, 0.0, -6.0]])
    a = b + torch.tensor([[0.0, 0.0, 0.2], [4.0, 0.0, 0.0]])  # row 1: argmax 0 -> 0, diff 4 of scale 6
    assert profile_step.logits_agreement(a, b) == "2 tokens: max diff 66.7% of scale, argmax 2/2"
    a[0, 2] = 9.0
    assert profile_step.logits_agreement(a, b).endswith("argmax 1/2")


def test_the_gpu_queue_names_only_switches_the_code_reads():
    """A misspelt switch in benchmarks/gpu_queue.sh would time the default against itself: every
    SPARKCHAT_* name it sets must be read somewhere in the package or the tests."""
    import re

    root = Path(__file__).resolve().parents[1]
    queue = (root / "benchmarks" / "gpu_queue.sh").read_text()
    names = set(re.findall(r"SPARKCHAT_[A-Z0-9_]+", queue))
    assert "SPARKCHAT_MOE_SHARED" in names and "SPARKCHAT_MOE_ADD_NORM" in names
    code = "\n".join(p.read_text() for d in ("sparkchat", "tests") for p in (root / d).rglob("*.py")
                     if p.name != "test_profile_tools.py")
    unread = sorted(n for n in names if f'"{n}"' not in code)
    assert not unread, unread


def test_every_switch_the_gpu_queue_alternates_times_something_against_off():
    """`--switch NAME=0` alternated 0 with 0 (sessions 25-26 queued one): each variant must differ
    from the switches-off one, and profile_step refuses one that does not."""
    import re

    queue = (Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_queue.sh").read_text()
    switches = [m.strip('"') for m in re.findall(r"--switch\s+(\"[^\"]+\"|\S+)", queue)]
    assert len(switches) >= 10
    for switch in switches:
        variants = profile_step.switch_variants(switch)
        assert len(variants) >= 2 and all(v != variants[-1] for v in variants[:-1]), switch
    with pytest.raises(SystemExit, match="switches-off"):
        profile_step.switch_variants("SPARKCHAT_MOE_TILE_X=0")
    assert profile_step.switch_variants("SPARKCHAT_MOE_TILE_X=1") == [[("SPARKCHAT_MOE_TILE_X", "1")],
                                                                      [("SPARKCHAT_MOE_TILE_X", "0")]]
    # |...: timed against an old default that is not all zeros, over the same variables in the same order
    assert profile_step.switch_variants("SPARKCHAT_T_A=0+SPARKCHAT_T_B=650|SPARKCHAT_T_B=800+SPARKCHAT_T_A=x") == [
        [("SPARKCHAT_T_A", "0"), ("SPARKCHAT_T_B", "650")], [("SPARKCHAT_T_A", "x"), ("SPARKCHAT_T_B", "800")]]
    assert profile_step.switch_variants("SPARKCHAT_T_A=1,2|SPARKCHAT_T_A=3") == [
        [("SPARKCHAT_T_A", "1")], [("SPARKCHAT_T_A", "2")], [("SPARKCHAT_T_A", "3")]]
    for bad in ("SPARKCHAT_T_A=1|SPARKCHAT_T_B=1", "SPARKCHAT_T_A=1+SPARKCHAT_T_B=2|SPARKCHAT_T_A=0",
                "SPARKCHAT_T_A=1|SPARKCHAT_T_A"):
        with pytest.raises(SystemExit, match="name every variable"):
            profile_step.switch_variants(bad)
    with pytest.raises(SystemExit, match="switches-off"):
        profile_step.switch_variants("SPARKCHAT_T_A=2|SPARKCHAT_T_A=2")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_gpu_queue_moe_configs_parse(monkeypatch):
    """Each SPARKCHAT_MOE_CONFIG value the queue alternates names real MoeConfig fields (a typo raises)."""
    import re

    from sparkchat.engine.kernels.mxfp4_moe import moe_config_overrides

    queue = (Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_queue.sh").read_text()
    specs = re.findall(r"SPARKCHAT_MOE_CONFIG=([^\s\"]+)", queue)
    assert specs
    for value in (v for spec in specs for v in spec.split(",")):
        monkeypatch.setenv("SPARKCHAT_MOE_CONFIG", value)
        assert moe_config_overrides(1) or moe_config_overrides(4), value


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_gpu_queue_gemv_configs_parse_and_name_real_shapes(monkeypatch):
    """Each SPARKCHAT_GEMV_CONFIG value the queue alternates, but "0" (the defaults, in a `+` or `|` switch),
    changes the config of a GEMV the one-token step runs on the sm_90 GPUs the queue is for (a typo in a field
    raises; a shape nobody asks for would time the default against itself)."""
    import re

    from sparkchat.engine.kernels import router
    from sparkchat.engine.kernels.fp8_gemv import gemv_config

    queue = (Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_queue.sh").read_text()
    specs = re.findall(r"SPARKCHAT_GEMV_CONFIG=([^\s\"+|]+)", queue)
    assert specs
    shapes = [("block", 1, 2560, 4096), ("block", 1, 20480, 2560), ("block", 4, 2560, 4096), ("block", 4, 20480, 2560)]
    monkeypatch.setattr(router, "is_sm90", lambda device: True)

    def configs():  # the router's as route() picks it on sm_90 (asking L2 ahead by default), then the others
        return [router._logits_config(torch.device("cuda"), 1, 512, 2560), *(gemv_config(*shape) for shape in shapes)]

    monkeypatch.delenv("SPARKCHAT_GEMV_CONFIG", raising=False)
    defaults = configs()
    for value in (v for spec in specs for v in spec.split(",") if v != "0"):
        monkeypatch.setenv("SPARKCHAT_GEMV_CONFIG", value)
        assert configs() != defaults, value


def test_loop_trace_finds_the_gpus_idle_stretches_and_the_host_calls_in_them():
    """benchmarks/loop_trace.py's arithmetic on a made-up trace: overlapping kernels (a side stream) are one
    busy span, only gaps over the threshold count, and a stretch lists the host calls overlapping it,
    outer ones first."""
    import loop_trace

    def gpu(ts, dur, cat="kernel"):
        return {"cat": cat, "ts": ts, "dur": dur, "name": "k"}

    events = [gpu(0, 10), gpu(5, 20), gpu(26, 4, "gpu_memcpy"),  # busy to 30 (a 1 µs gap does not count)
              gpu(100, 50),  # 70 µs idle before it
              gpu(158, 2),  # 8 µs idle
              {"cat": "cuda_runtime", "ts": 40, "dur": 55, "name": "cudaGraphLaunch"},
              {"cat": "cpu_op", "ts": 35, "dur": 70, "name": "outer"},
              {"cat": "cpu_op", "ts": 0, "dur": 20, "name": "before"},
              {"cat": "python_function", "ts": 40, "dur": 5, "name": "ignored"}]
    assert loop_trace.idle_stretches(events, 5.0) == [(30, 100), (150, 158)]
    assert loop_trace.idle_stretches(events, 10.0) == [(30, 100)]
    assert [e["name"] for e in loop_trace.host_calls(events, 30, 100)] == ["outer", "cudaGraphLaunch"]

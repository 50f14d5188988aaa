"""The decode kernels' instruction mix, compiled for sm_90 on the CPU (benchmarks/sass_stats.py): guards
against a change that silently brings back shuffles or shared memory into the router, or loses the
bf16x2 MoE products' saving. No GPU needed; skipped where Triton's bundled tools are missing."""

from __future__ import annotations

import importlib.util
import re
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


def test_preloaded_moe_stage2_streams_its_weights_before_the_pdl_wait():
    """With preload2 the one-token stage 2 issues all three k steps' weight loads before waiting for
    stage 1 (measured 49 of 70 loads before the wait on sm_90, against 17 of 46 for its k loop), so
    the down weights stream during stage 1's tail."""
    s = _tools()
    before, total = s.moe_loads_before_wait(2, True)
    loop_before, _ = s.moe_loads_before_wait(2, False)
    assert before >= 2 * loop_before and before >= 0.6 * total, (before, total, loop_before)


def test_vectorized_moe_stages_issue_their_weight_and_scale_loads_first():
    """The stages in 16-byte loads (MoeConfig.vec1 / vec2): behind the warp barrier, stage 1's weight (10
    LDG.128 a thread) and scale loads (10 LDG.U8) all come before its first bf16x2 FMA, within the
    80-register cap (3 programs of 8 warps an SM) and spilling little — without the barrier ptxas moves
    the scale loads behind the multiplies (measured on sm_90: 14 / 10 wide / byte loads in front with
    it, 11 / 0 without); stage 2's weights (6 LDG.128) and scales (6 byte loads: one byte a thread, see
    _unaligned_zero) all come before its PDL wait, its act after."""
    s = _tools()
    kinds, regs = s.moe_vec_loads(1)
    assert kinds["LDG.E.U8"] == [10, 0] and kinds["LDG.E.128"][0] >= 10 and regs <= 80, (kinds, regs)
    assert kinds["STL"][0] <= 8, kinds
    unfenced, _ = s.moe_vec_loads(1, fence=False)
    assert unfenced["LDG.E.U8"][0] < 10, unfenced
    down, _ = s.moe_vec_loads(2)
    assert down["LDG.E.128"][0] == 6 and down["LDG.E.U8"] == [6, 0] and down["LDG.E.128"][1] >= 6, down
    s.moe_vec_loads(1, arch=121)  # both compile for the DGX Spark (its SASS the bundled cuobjdump cannot read)
    s.moe_vec_loads(2, arch=121)


def test_one_split_add_norm_has_no_arrival_counter():
    """The output projection's add+norm in one split (GemvConfig.split 1) adds from registers: no atomic
    in its SASS, where the tuned split-K config has its arrival counter."""
    from dataclasses import replace

    from sparkchat.engine.kernels.fp8_gemv import gemv_config

    s = _tools()
    tuned = gemv_config("block", 1, 2560, 4096)
    _, split_k = s.add_norm_gemv(90, tuned)
    _, one = s.add_norm_gemv(90, replace(tuned, split=1, bk=1024, warps=4))
    assert any(s._op(i).startswith("ATOM") for i in split_k)
    assert not any(s._op(i).startswith(("ATOM", "RED")) for i in one), [i for i in one if "ATOM" in i]


@pytest.mark.parametrize("T, stage, limits", [
    (1, 1, dict(BAR=1, LDS=1, all=960)),
    (1, 2, dict(BAR=4, LDS=2, all=670)),  # 10 barriers, 8 shared loads, 688 instructions before
    (4, 1, dict(BAR=1, LDS=1, all=950)),  # 41, 21, 1032: the verify's stage 1 is issue-bound
    (4, 2, dict(BAR=3, LDS=1, all=725)),  # 14, 13, 776
])
def test_vectorized_moe_stages_move_no_activation_or_scale_through_shared_memory(T, stage, limits):
    """The 16-byte-load stages as launched: each thread loads its own activation words (the x tile in w's
    layout, _group_dot) and scale bytes (_unaligned_zero), so the only shared-memory trips left are the
    final reductions; before, Triton moved the activations (four tokens) or the scales (stage 2) through
    shared memory every k step, a barrier each time."""
    ops, regs = _tools().moe_vec_stage_ops(T, stage)
    for op, most in limits.items():
        assert ops.get(op, 0) <= most, (op, ops.get(op, 0), most)
    assert regs <= (80 if stage == 1 else 64 if T == 4 else 60), regs


def test_verify_gemv_uses_each_targets_tensor_cores():
    """The tensor-core GEMV becomes wgmma on the H200 and mma.sync on the Spark's sm_121a (no
    Hopper-only instruction there), with the one-instruction e4m3x2 -> f16x2 conversion on both, and its
    k loop stays near four instructions per weight a thread streams on sm_90 (measured 4.23)."""
    s = _tools()
    hopper, weights = s.mma_gemv(90)
    spark, _ = s.mma_gemv(121)
    assert "wgmma" in hopper.asm["ptx"] and "mma.sync" in spark.asm["ptx"] and "wgmma" not in spark.asm["ptx"]
    assert all("cvt.rn.f16x2.e4m3x2" in k.asm["ptx"] for k in (hopper, spark))
    body = s.loop_body(s.disassemble(hopper, "fp8_mma_kernel"))
    assert len(body) / weights < 5, len(body) / weights


def test_narrow_gemv_accumulators_halve_the_registers():
    """[bn, bk/16] accumulators (GemvConfig.kacc: each thread first sums its own 16 products) let the
    one-token KDA projection's 16 x 512 tile fit in 96 registers a thread on sm_90 (250 with [bn, bk]
    ones; the 8 x 512 tile used before took 124), and compile for several tokens and row tiles and for
    the Spark's sm_121a."""
    from dataclasses import replace

    from sparkchat.engine.kernels.fp8_gemv import gemv_config

    s = _tools()
    tuned_cfg = gemv_config("block", 1, 20480, 2560)
    assert tuned_cfg.kacc == 32
    tuned, _ = s.fma_gemv(90, 1, 20480, 2560)
    wide, _ = s.fma_gemv(90, 1, 20480, 2560, replace(tuned_cfg, kacc=0))
    assert s.registers(tuned, "tuned") <= 100 and s.registers(wide, "wide") >= 200
    for arch in (90, 121):
        s.fma_gemv(arch, 4, 2560, 4096, replace(tuned_cfg, bn=8, rs=2, bk=256, split=4, kacc=16))


@pytest.mark.parametrize("arch,smem", [(90, 232448), (121, 101376)])
def test_mla_step_kernels_fit_the_device(arch, smem):
    """The MLA step's kernels compile for the H200 and for the Spark's sm_121a with the launch shapes
    `default_config` picks for that device's shared memory, use no more of it than a program may (the
    split kernel at 32 cache rows a step needs 100 KiB: more than sm_12x gives), stay within
    split_smem_estimate, and use no Hopper-only instruction on sm_121a."""
    from benchmarks import sass_stats
    from sparkchat.engine.kernels import mla_decode as m

    for T in (1, 4):
        for name, kernel in sass_stats.mla_kernels(arch, T, smem).items():
            assert kernel.metadata.shared <= smem, (name, T, kernel.metadata.shared)
            if arch == 121:
                assert "wgmma" not in kernel.asm["ptx"], name
    for block_n in (16, 32, 64):
        real = sass_stats.compile_kernel(m.mla_decode_split_kernel, sass_stats.MLA_SPLIT_SIG, dict(
            H=32, M=32, R=512, P=64, BLOCK_M=32, BLOCK_N=block_n, INTERPRET=False, ITERS=0, PDL=True), 8, arch, 2)
        assert real.metadata.shared <= m.split_smem_estimate(32, block_n, 2, 512, 64), (block_n, real.metadata.shared)


def test_tensor_core_gemvs_fit_the_sparks_shared_memory():
    """The verify's largest tensor-core GEMV tiles — the head (128 rows a program) and the shared expert's
    gate|up (4 stages) — fit in the 99 KiB a program gets on sm_12x (compiled: 44 and 40 KiB)."""
    from benchmarks import sass_stats
    from sparkchat.engine.kernels import fp8_gemv as g

    for kind, N in (("head", 157184), ("block", 1536)):
        cfg = g.gemv_config(kind, 4, N, 2560)
        assert cfg.mma
        cx = dict(T=4, N=N, K=2560, BM=cfg.bn, BK=cfg.bk, SCALE=1 if kind == "head" else 0, OUT=0, SPLIT=cfg.split,
                  STAGES=cfg.stages, XS=0, XU=0, X_SWIGLU=False, PDL=True)
        kernel = sass_stats.compile_kernel(g.fp8_mma_kernel, sass_stats._GEMV_SIG, cx, cfg.warps, 121)
        assert kernel.metadata.shared <= 101376, (kind, kernel.metadata.shared)


def _state_tile_layout(kernel) -> str:
    """The layout of the [128, 32] fp32 state block a KDA kernel loads (its TTGIR)."""
    g = kernel.asm["ttgir"]
    layouts = dict(re.findall(r"(#\w+) = (#ttg\.blocked<[^>]*>)", g))
    loads = set(re.findall(r"tt\.load [^\n]*tensor<128x32x!tt\.ptr<f32>, (#\w+)>", g))
    assert len(loads) == 1, loads
    return layouts[loads.pop()]


@pytest.mark.parametrize("arch", [90, 121])
def test_commit_kernel_holds_the_state_as_the_verify_does(arch):
    """The one-launch KDA commit at the Ling shapes (32 x 128 x 128 fp32 states, bf16 conv rows of 3 x 4096
    channels) compiles for the H200 and the Spark's sm_121a with plain loads and stores, and holds each
    state block in the verify kernel's layout — the sums over a block then run in the same order, which
    is what makes a committed state bit for bit a shorter step's (without the alignment hint on the
    table's addresses it was a [1, 1]-per-thread layout)."""
    sass_stats = _tools()
    from sparkchat.engine.kernels import kda_commit as c
    from sparkchat.engine.kernels import kda_decode as d

    nb, warps = d.LAUNCH
    row = 3 * 4096 * 2 // 4
    shapes = dict(T=4, H=32, DH=128, NB=nb, CONV=3 * row, ROW=row, BLOCK=c.BLOCK)
    commit = sass_stats.compile_kernel(c.kda_commit_kernel, {"table_ptr": "*i64", "last": "i32"},
                                       dict(shapes, LAST_ON_DEVICE=False), warps, arch)
    # the pipelined loop's form, reading `last` where the GPU's acceptance wrote it
    on_device = sass_stats.compile_kernel(c.kda_commit_kernel, {"table_ptr": "*i64", "last": "*i64"},
                                          dict(shapes, LAST_ON_DEVICE=True), warps, arch)
    for kernel in (commit, on_device):
        ptx = kernel.asm["ptx"]
        assert "ld.global" in ptx and "st.global" in ptx and "wgmma" not in ptx and "cp.async.bulk" not in ptx
    sig = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "f_ptr", "b_ptr", "og_ptr", "conv_ptr")}
    sig.update({n: "*fp32" for n in ("rec_ptr", "cw_ptr", "alog_ptr", "dtb_ptr")})
    sig.update({"onw_ptr": "*bf16", "o_ptr": "*bf16", "win_ptr": "*bf16", "steps_ptr": "*fp32", "cnt_ptr": "*i32"})
    sig.update({f"s_{n}": "i32" for n in ("q", "qc", "k", "kc", "v", "vc", "f", "fc", "b", "bc", "og", "ogc", "cv",
                                         "cvc", "w", "wc")})
    sig.update({"q_scale": "fp32", "lower_bound": "fp32", "eps": "fp32"})
    cx = dict(T=4, H=32, DH=128, KC=4, NB=nb, SAFE_GATE=True, KEEP=True, bx_ptr=None, bw_ptr=None, FOLD_B=False,
              HID=1, BKH=1, PDL=True)
    verify = sass_stats.compile_kernel(d.kda_decode_kernel, sig, cx, warps, arch)
    assert _state_tile_layout(commit) == _state_tile_layout(verify) == _state_tile_layout(on_device)


@pytest.mark.parametrize("arch", [90, 121])
def test_pipeline_handoff_kernels_compile_to_plain_loads_and_stores(arch):
    """The pipelined MTP loop's two small kernels at Ling's shapes (3 drafts, hidden 2560 in bf16) compile
    for the H200 and the Spark's sm_121a with plain global loads and stores, nothing Hopper-only."""
    sass_stats = _tools()
    from sparkchat.engine.kernels import pipeline_handoff as h

    accept = sass_stats.compile_kernel(h.accept_greedy_kernel, {n: "*i64" for n in (
        "drafts_ptr", "target_ptr", "accepted_ptr", "next_ptr", "result_ptr")}, dict(K=3, KP=4), 1, arch)
    sig = {n: "*i64" for n in ("drafts_ptr", "accepted_ptr", "next_ptr", "ids_ptr", "pos_ptr", "pick_ptr",
                               "vids_ptr", "vpos_ptr")}
    sig.update({"hidden_ptr": "*bf16", "hin_ptr": "*bf16", "n": "i64"})
    inputs = sass_stats.compile_kernel(h.next_inputs_kernel, sig, dict(K=3, H=2560, KP=4, PP=8, FILL=True,
                                                                       BLOCK=h.HIDDEN_BLOCK), 4, arch)
    for kernel in (accept, inputs):
        ptx = kernel.asm["ptx"]
        assert "ld.global" in ptx and "st.global" in ptx and "wgmma" not in ptx and "cp.async.bulk" not in ptx


@pytest.mark.parametrize("M", [16, 32, 64, 512])
def test_prompt_gemm_compiles_for_the_spark_without_spills(M):
    """The prompt FP8 GEMM's config for each token bucket, shrunk to the GB10's 99 KB of shared memory,
    compiles for sm_121a to mma.sync (no wgmma) with no register spills and fits that shared memory;
    on sm_90 it becomes wgmma."""
    s = _tools()
    spark, cfg = s.prompt_gemm(121, M)
    assert "mma.sync" in spark.asm["ptx"] and "wgmma" not in spark.asm["ptx"], cfg
    assert spark.metadata.shared <= 101376 and s.stack_frame(spark, "fp8_block_gemm_kernel") == 0, cfg
    hopper, _ = s.prompt_gemm(90, M)
    assert "wgmma" in hopper.asm["ptx"]



def test_a_projection_finishing_the_moe_norm_keeps_its_registers():
    """SPARKCHAT_MOE_ADD_NORM=2: KDA's fused input projection at one token applies the split norm as it
    loads its input; that must not cost it registers (96 either way on sm_90) or spill."""
    s = _tools()
    plain, _ = s.fma_gemv(90, 1, 20480, 2560)
    split, _ = s.fma_gemv(90, 1, 20480, 2560, split_norm=80)
    assert s.registers(split, "fp8_gemv_kernel") <= s.registers(plain, "fp8_gemv_kernel")
    assert s.stack_frame(split, "fp8_gemv_kernel") == 0
    s.fma_gemv(121, 1, 20480, 2560, split_norm=80)  # compiles for the Spark too


@pytest.mark.parametrize("arch", [90, 121])
def test_the_split_norms_kernels_compile_without_spills(arch):
    """Every kernel variant of the split RMSNorms (SPARKCHAT_MOE_ADD_NORM=2, SPARKCHAT_SPLIT_MOE_INPUT_NORM,
    SPARKCHAT_SHARED_ADD_LATE) compiles as the engine launches it, for the H200 and the Spark, without a
    stack (the interpreter ran them, but takes things the compiler refuses: a None in a tuple did)."""
    s = _tools()
    kernels = s.split_norm_kernels(arch)
    assert len(kernels) == 7
    for label, (regs, stack) in kernels.items():
        assert stack in (0, None), (label, stack)
        assert regs is None or regs <= 128, (label, regs)


@pytest.mark.parametrize("arch", [90, 121])
def test_one_token_stages_with_the_shared_expert_spill_no_more_than_stage_1_alone(arch):
    """SPARKCHAT_MOE_SHARED=1|2 at one token with the 16-byte-load stages (the default), compiled as
    launched (FENCE on): stage 2 holding the shared expert's down rows too has no stack. Stage 1, capped at
    80 registers so that its programs fit the GPU at once, keeps every weight load in front of the warp
    barrier and so spills a few words (16 bytes a thread, 4 spill stores on sm_90; session 22 counted
    0-4), with the shared expert's gate|up rows or without; the shared branch adds at most 8 bytes to
    that. It spilled 144 while its shared programs kept their weights across the PDL wait; making their
    act before the wait ended that. (Until session 34 this tool compiled FENCE as None, off, and read 0.)"""
    s = _tools()
    from dataclasses import replace

    from sparkchat.engine.kernels import mxfp4_moe as m

    tuned = m.moe_config(1, s.H, s.INTER, vec=0)
    vec = replace(tuned, vec1=True, vec2=True, **m._VEC1[(1, s.H, s.INTER)])
    for stage, shared in ((2, 1), (2, 2)):
        kernel, _, name = s._moe_stage(vec, stage, arch, shared)
        assert s.stack_frame(kernel, name) in (0, None), (stage, shared, s.stack_frame(kernel, name))
    alone, with_shared = (s.stack_frame(*s._moe_stage(vec, 1, arch, shared)[::2]) for shared in (0, 2))
    if alone is not None:  # cuobjdump read it
        assert alone <= 16 and with_shared <= alone + 8, (alone, with_shared)


@pytest.mark.parametrize("arch", [90, 121])
def test_kda_layer_compiles_without_spills_as_launched(arch):
    """kda_decode as a Ling KDA layer launches it — one token with the default launch shape and the
    4-token verify that keeps its inputs — holds its state in registers without a stack."""
    s = _tools()
    from sparkchat.engine.kernels.kda_decode import LAUNCH

    for T, keep in ((1, False), (4, True)):
        kernel = s.kda_step(arch, T, *LAUNCH, keep=keep)
        assert s.stack_frame(kernel, "kda_decode_kernel") in (0, None), (T, s.stack_frame(kernel, "kda_decode_kernel"))


@pytest.mark.parametrize("arch", [90, 121])
def test_moe_slot_sum_with_every_token_at_once_makes_one_trip(arch):
    """SPARKCHAT_TAIL_AT_ONCE bit 2 at the 4-token verify's shapes: stage 2's slot sum loads every token's
    slots in one run before storing (one token after another: a run a token), without more registers
    (capped at the plain program's 64) or a stack."""
    s = _tools()
    label = "moe stage 2 + slot sum"
    (kernel, name), (before, _) = s.verify_tails(arch, True)[label], s.verify_tails(arch, False)[label]
    assert s.stack_frame(kernel, name) in (0, None)
    assert s.registers(kernel, name) <= max(64, s.registers(before, name))
    sass, sass_before = s.disassemble(kernel, name), s.disassemble(before, name)
    if sass is not None:  # cuobjdump reads this architecture
        assert (s.load_trips_after(sass, 1), s.load_trips_after(sass_before, 1)) == (1, 4)


@pytest.mark.parametrize("arch", [90, 121])
def test_kda_output_norm_with_every_position_at_once_makes_one_trip(arch):
    """SPARKCHAT_TAIL_AT_ONCE=4 in the 4-token verify's KDA layer: the head's last program loads every
    position's o before storing any (one run of loads after its arrival atomic, where one position after
    another takes several), with the same registers and no stack."""
    s = _tools()
    serial = s.kda_step(arch, 4, 4, 4, keep=True)
    at_once = s.kda_step(arch, 4, 4, 4, keep=True, norm_at_once=True)
    name = "kda_decode_kernel"
    assert s.stack_frame(at_once, name) in (0, None)
    assert s.registers(at_once, name) <= s.registers(serial, name)
    sass, sass_before = s.disassemble(at_once, name), s.disassemble(serial, name)
    if sass is not None:
        assert s.load_trips_after(sass, 1) == 1 < s.load_trips_after(sass_before, 1)


def test_mla_merge_and_unfold_of_a_window_in_one_trip_to_memory():
    """A 4-token verify's MLA merge + unfold: one token after another (combine 0) each token's loads wait
    for the stores before them, 4 runs of loads (sm_90); with every token's output made before any store
    (1) or a program per token (2) one run, without a stack (1: 216 registers against 171; 2: 94)."""
    s = _tools()
    runs = {}
    for mode in (0, 1, 2):
        k = s.mla_kernels(90, 4, 232448, combine=mode)["mla_combine_unfold_kernel"]
        runs[mode] = s.load_trips_after(s.disassemble(k, "mla_combine_unfold_kernel"), 0)
        assert s.stack_frame(k, "mla_combine_unfold_kernel") == 0, mode
    assert runs == {0: 4, 1: 1, 2: 1}, runs


@pytest.mark.parametrize("arch", [90, 121])
def test_weight_streams_marked_evict_first_keep_their_registers(arch):
    """SPARKCHAT_WEIGHT_EVICT: the MoE stages (16-byte and word loads, with the shared expert's rows) and
    the FP8 GEMV with EVICT="evict_first" load their weights with an L2 evict_first cache policy
    (L2::cache_hint) and nothing else changes: the same registers and stack as without the hint."""
    s = _tools()
    from dataclasses import replace

    from sparkchat.engine.kernels import mxfp4_moe as m

    vec = replace(m.moe_config(1, s.H, s.INTER, vec=0), vec1=True, vec2=True, **m._VEC1[(1, s.H, s.INTER)])
    for stage, shared in ((1, 2), (2, 2)):
        plain, _, name = s._moe_stage(vec, stage, arch, shared, EVICT="")
        hinted, _, _ = s._moe_stage(vec, stage, arch, shared, EVICT="evict_first")
        assert "L2::cache_hint" not in plain.asm["ptx"] and "L2::evict_first" in hinted.asm["ptx"], (stage, shared)
        hints = sum("L2::cache_hint" in line for line in hinted.asm["ptx"].splitlines() if "ld.global" in line)
        assert hints >= (20 if stage == 1 else 12), (stage, hints)  # every weight and scale load
        assert s.registers(hinted, name) == s.registers(plain, name), (stage, name)
        assert s.stack_frame(hinted, name) == s.stack_frame(plain, name), (stage, name)
    # the word-load stages with the shared expert, EVICT left out as the engine launches them (a str default
    # in a jit helper, not the kernel, failed to compile there)
    words = m.moe_config(1, s.H, s.INTER, vec=0)
    for stage in (1, 2):
        kernel, _, name = s._moe_stage(words, stage, arch, 2)
        hinted, _, _ = s._moe_stage(words, stage, arch, 2, EVICT="evict_first")
        assert "L2::cache_hint" not in kernel.asm["ptx"] and "L2::evict_first" in hinted.asm["ptx"], name
        assert s.registers(hinted, name) == s.registers(kernel, name), name
    from sparkchat.engine.kernels import fp8_gemv as g

    cfg = g.gemv_config("block", 1, 20480, 2560)
    plain, _ = s.fma_gemv(arch, 1, 20480, 2560, cfg)
    hinted, _ = s.fma_gemv(arch, 1, 20480, 2560, cfg, evict="evict_first")
    assert "L2::evict_first" in hinted.asm["ptx"] and "L2::cache_hint" not in plain.asm["ptx"]
    assert s.registers(hinted, "fp8_gemv_kernel") == s.registers(plain, "fp8_gemv_kernel")


@pytest.mark.parametrize("arch", [90, 121])
def test_gemv_asks_l2_for_its_later_k_steps_before_the_pdl_wait(arch):
    """GemvConfig.l2_ahead: the FP8 GEMV (the output projection at one and four tokens) and the router's
    plain one issue one L2 prefetch a thread for each later k step, all before griddepcontrol.wait, and no
    more than a program has steps; none without it, and no stack either way; the tensor-core GEMV likewise
    from its first step, with the same registers."""
    s = _tools()
    from dataclasses import replace

    from sparkchat.engine.kernels import fp8_gemv as g

    for kind, T, N, K, steps_after_first in (("block", 1, 2560, 4096, 1), ("block", 4, 2560, 4096, 3),
                                             ("plain", 1, 512, 2560, 3)):
        cfg = g.gemv_config(kind, T, N, K)
        for ahead in (0, 2, 8):
            kernel, _ = s.fma_gemv(arch, T, N, K, replace(cfg, l2_ahead=ahead), plain=kind == "plain")
            lines = kernel.asm["ptx"].splitlines()
            wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
            asks = [i for i, line in enumerate(lines) if "prefetch.global.L2::evict_last" in line]
            assert len(asks) == min(ahead, steps_after_first), (kind, T, ahead, len(asks))
            assert all(i < wait for i in asks), (kind, T, ahead)
            assert s.stack_frame(kernel, "fp8_gemv_kernel") in (0, None), (kind, T, ahead)
    # the tensor-core GEMV loads nothing before its wait: it asks for the first steps (10 a program at KDA's shape)
    regs = None
    for ahead in (0, 3):
        kernel, _ = s.mma_gemv(arch, l2_ahead=ahead)
        lines = kernel.asm["ptx"].splitlines()
        wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        asks = [i for i, line in enumerate(lines) if "prefetch.global.L2::evict_last" in line]
        assert len(asks) == ahead and all(i < wait for i in asks), (ahead, len(asks))
        regs = regs or s.registers(kernel, "fp8_mma_kernel")
        assert s.registers(kernel, "fp8_mma_kernel") == regs


@pytest.mark.parametrize("arch", [90, 121])
def test_gemv_loads_its_pre_steps_before_the_pdl_wait(arch):
    """GemvConfig.pre: the FMA GEMV issues the weight loads of its first `pre` k steps (at most the steps a
    program has) before griddepcontrol.wait (ACQBULK in the SASS), and no stack: the router logits (four
    steps), the one-token output projection (two), MLA's input projection (five) and the 4-token verify's
    output projection (four)."""
    s = _tools()
    from dataclasses import replace

    from sparkchat.engine.kernels import fp8_gemv as g

    for kind, T, N, K, steps in (("plain", 1, 512, 2560, 4), ("block", 1, 2560, 4096, 2), ("block", 1, 6912, 2560, 5),
                                 ("block", 4, 2560, 4096, 4)):
        cfg = g.gemv_config(kind, T, N, K)
        one = None
        for pre in (1, 2, 4, 8):
            kernel, _ = s.fma_gemv(arch, T, N, K, replace(cfg, pre=pre), plain=kind == "plain")
            lines = kernel.asm["ptx"].splitlines()
            wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
            before = sum("ld.global" in line for line in lines[:wait])
            one = one or before
            assert before == min(pre, steps) * one, (kind, T, pre, before, one)
            assert s.stack_frame(kernel, "fp8_gemv_kernel") in (0, None), (kind, T, pre)
            sass = s.disassemble(kernel, "fp8_gemv_kernel")
            if sass is not None:  # ptxas keeps them there
                acq = next(i for i, ins in enumerate(sass) if "ACQBULK" in ins)
                assert sum("LDG" in ins for ins in sass[:acq]) == before, (kind, T, pre)


@pytest.mark.parametrize("arch", [90, 121])
def test_embed_norm_kernels_load_their_norm_weights_before_the_pdl_wait(arch):
    """A step's first launch (kernels/embed_norm.py) at Ling's hidden size compiles for the H200 and the
    Spark with plain loads and no stack: the norm's weights are loaded before griddepcontrol.wait, the ids
    and rows after it (a pipelined step's ids come from the kernel before)."""
    s = _tools()
    from sparkchat.engine.kernels import embed_norm as e

    sig = {"ids_ptr": "*i64", "table_ptr": "*bf16", "nw_ptr": "*bf16", "x_ptr": "*bf16", "h_ptr": "*bf16",
           "eps": "fp32", "h16_ptr": "*fp16", "hd_ptr": "*fp32"}
    first = s.compile_kernel(e.embed_norm_kernel, sig, dict(N=2560, BLOCK=4096, F16=True, INTERPRET=False,
                                                            PDL=True), 8, arch)
    sig = {"ids_ptr": "*i64", "table_ptr": "*bf16", "hidden_ptr": "*bf16", "enorm_ptr": "*bf16",
           "hnorm_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"}
    mtp = s.compile_kernel(e.mtp_input_kernel, sig, dict(N=2560, BLOCK=4096, INTERPRET=False, PDL=True), 8, arch)
    for kernel, name, waits in ((first, "embed_norm_kernel", 1), (mtp, "mtp_input_kernel", 2)):
        lines = kernel.asm["ptx"].splitlines()
        at = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
        assert len(at) == waits, (name, at)  # the MTP input: one wait in each half's branch
        assert any("ld.global" in line for line in lines[:at[0]]), name  # a norm weight before the wait
        assert "ld.global" in "".join(lines[at[-1]:]), name
        assert "wgmma" not in kernel.asm["ptx"] and "cp.async.bulk" not in kernel.asm["ptx"]
        assert s.stack_frame(kernel, name) in (0, None), name

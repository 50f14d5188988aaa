"""Instruction counts of the decode kernels' inner loops, compiled ahead of time — no GPU needed.

    python benchmarks/sass_stats.py [--arch 90] [--arch 121]

Triton compiles for any NVIDIA target on a CPU-only machine (its wheel bundles ptxas and cuobjdump),
so this shows what a kernel change does to the SASS before any GPU time is spent: for each kernel,
the instructions in its k loop per weight a thread streams (MoE stages, fp32 FMA products against
bf16x2; the verify's tensor-core GEMV, with the MMA instruction its PTX uses), and the router's
whole-kernel count, shuffles and shared-memory traffic; for the MLA kernels and the prompt FP8 GEMM,
their shared memory, MMA instruction and registers. Pointer arguments are marked 16-byte aligned, as a real launch specializes them. --arch 121 compiles for the DGX Spark
(GB10): a portability check of the default path.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
H, INTER, K, E = 2560, 768, 8, 512


def compile_kernel(fn, signature: dict, constexprs: dict, warps: int, arch: int, stages: int | None = None,
                   maxnreg: int | None = None):
    """fn compiled for sm_<arch> (its .asm holds "ptx" and "cubin", .metadata.shared its shared memory),
    pointers marked 16-byte aligned."""
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    pointers = [fn.arg_names.index(name) for name, v in signature.items() if v.startswith("*")]  # by position
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers}
    options = {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=options)


def compile_sass(fn, signature: dict, constexprs: dict, warps: int, arch: int) -> list[str] | None:
    """SASS instruction texts (predicates kept) of fn compiled for sm_<arch>; None when the bundled
    cuobjdump cannot disassemble that architecture (CUDA 12.8's cannot read sm_121a): compiled, not
    counted."""
    return disassemble(compile_kernel(fn, signature, constexprs, warps, arch), fn.__name__)


def disassemble(kernel, name: str) -> list[str] | None:
    """compile_sass's answer for an already compiled kernel."""
    path = Path("/tmp") / f"sparkchat_sass_{name}.cubin"
    path.write_bytes(kernel.asm["cubin"])
    done = subprocess.run([str(CUOBJDUMP), "-sass", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    text = done.stdout
    return [m.group(2) for line in text.splitlines() if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line))]


def _op(ins: str) -> str:
    words = ins.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def loop_body(sass: list[str]) -> list[str]:
    """The instructions of the largest loop (from a backward branch's target to the branch)."""
    addr = [i * 16 for i in range(len(sass))]
    best: list[str] = []
    for i, ins in enumerate(sass):
        m = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr[i]:
            body = sass[int(m.group(1), 16) // 16: i + 1]
            best = body if len(body) > len(best) else best
    return best


def report(name: str, instrs: list[str] | None, per: float | None = None) -> None:
    if instrs is None:
        print(f"  {name:<46} compiled (the bundled cuobjdump cannot disassemble this architecture)")
        return
    if not instrs:  # e.g. a k loop of 3 steps, unrolled whole by the compiler
        print(f"  {name:<46} no loop left in the SASS (fully unrolled)")
        return
    ops = Counter(_op(i) for i in instrs)
    per_w = f"{len(instrs) / per:6.2f} per weight" if per else ""
    keys = ("SHFL", "REDUX", "BAR", "STS", "LDS", "LDG", "STL")
    extra = ", ".join(f"{k} {ops[k]}" for k in keys if ops.get(k))
    print(f"  {name:<46} {len(instrs):6d} instructions {per_w}  [{extra}]")


_STAGE1_SIG = {"x_ptr": "*bf16", "ids_ptr": "*i32", "rw_ptr": "*fp32", "w13_ptr": "*i32", "s13_ptr": "*u8",
               "act_ptr": "*fp32", "limit": "fp32"}
_GEMV_SIG = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16", "pmax_ptr": "*fp32",
             "pidx_ptr": "*i32", "lim": "fp32"}  # both FP8 GEMV kernels' non-constexpr arguments
_STAGE2_SIG = {"act_ptr": "*fp32", "ids_ptr": "*i32", "w2_ptr": "*i32", "s2_ptr": "*u8", "part_ptr": "*fp32",
               "cnt_ptr": "*i32", "y_ptr": "*bf16", "add_ptr": "*bf16"}


def moe_loop(T: int, stage: int, packed: bool, arch: int, paired: bool = False,
             packed_act: bool = False, packed_x: bool = False) -> tuple[list[str] | None, float]:
    """(k-loop SASS or None, weights a thread streams per loop iteration) of one mxfp4_moe stage with
    the tuned config for T tokens, products packed (bf16x2) or not, words in checkpoint or paired order."""
    from sparkchat.engine.kernels import mxfp4_moe as m

    base = m.moe_config(T, H, INTER, vec=0)
    cfg = replace(base, packed=packed, dedupe=base.dedupe and not packed, packed_act=packed_act,
                  preload1=False, preload2=False)  # the k loops (a preloaded stage has none)
    plan = m._plan(T, K, H, INTER, cfg, paired, x_packed=packed_x)
    if stage == 1:
        sig = dict(_STAGE1_SIG, x_ptr="*i32") if packed_x else _STAGE1_SIG  # x as bf16x2 words (pack_moe_x)
        fn, meta, rows, bkw, unroll = (m.mxfp4_moe_stage1_kernel, plan.meta1, 2 * cfg.rs1 * cfg.bn1, cfg.bkw1,
                                       cfg.unroll1)
    else:
        fn, sig, meta, rows, bkw, unroll = (m.mxfp4_moe_stage2_kernel, _STAGE2_SIG, {**plan.meta2, "HAS_ADD": True},
                                            cfg.rs2 * cfg.bn2, cfg.bkw2, cfg.unroll2)
    meta = {**meta, "PDL": True, "INTERPRET": False}
    warps = meta.pop("num_warps")
    sass = compile_sass(fn, sig, meta, warps, arch)
    return (None if sass is None else loop_body(sass)), rows * bkw * 8 * unroll / (32 * warps)


_SHARED_SIG = {"shw_ptr": "*fp8e4nv", "shs_ptr": "*fp32", "sh_limit": "fp32"}  # + sha_ptr (+ xs_ptr)


def _moe_stage(cfg, stage: int, arch: int, shared: int = 0, sig_extra: dict | None = None,
               **meta_extra) -> tuple[object, list[str] | None, str]:
    """(compiled kernel, its SASS or None, kernel name) of one one-token mxfp4_moe stage with `cfg` as
    the engine would launch it (paired words, packed input, PDL). shared: the shared expert as
    SPARKCHAT_MOE_SHARED runs it (1: its down in stage 2; 2: its gate|up in stage 1 too)."""
    from sparkchat.engine.kernels import mxfp4_moe as m

    plan = m._plan(1, K, H, INTER, cfg, True, x_packed=True, shared_up=INTER if shared else None,
                   shared_stage1=shared == 2)
    if stage == 1:
        fn = m.mxfp4_moe_stage1_vec_kernel if plan.vec1 else m.mxfp4_moe_stage1_kernel
        sig, meta = dict(_STAGE1_SIG, x_ptr="*i32", act_ptr="*bf16"), plan.meta1
        if plan.meta1["SHARED"]:
            sig.update(_SHARED_SIG, xs_ptr="*bf16", sha_ptr="*fp32")
    else:
        fn = m.mxfp4_moe_stage2_vec_kernel if plan.vec2 else m.mxfp4_moe_stage2_kernel
        sig, meta = dict(_STAGE2_SIG, act_ptr="*i32"), {**plan.meta2, "HAS_ADD": not shared}
        if shared:
            sig.update(_SHARED_SIG, sha_ptr="*bf16" if plan.meta2["SH_GU"] else "*fp32")
    # FENCE as launched (the vec kernels' default: True); left out, Triton would compile it as None
    fence = {"FENCE": True} if "FENCE" in fn.arg_names else {}
    meta = {**meta, "PDL": True, "INTERPRET": False, **fence, **meta_extra}
    warps, maxnreg = meta.pop("num_warps"), meta.pop("maxnreg", None)
    kernel = compile_kernel(fn, {**sig, **(sig_extra or {})}, meta, warps, arch, maxnreg=maxnreg)
    return kernel, disassemble(kernel, fn.__name__), fn.__name__


def split_norm_kernels(arch: int) -> dict[str, tuple[int | None, int | None]]:
    """{kernel variant: (registers, stack bytes)} for the split RMSNorms' kernels at the Ling shapes, one
    token, as the engine launches them (SPARKCHAT_MOE_ADD_NORM=2, SPARKCHAT_SPLIT_MOE_INPUT_NORM=1,
    SPARKCHAT_SHARED_ADD_LATE=1): each must compile for `arch`; registers and stack where cuobjdump reads it."""
    from sparkchat.engine.kernels import fp8_gemv as g
    from sparkchat.engine.kernels import mxfp4_moe as m
    from sparkchat.engine.kernels.norm_rows import norm_rows_kernel

    out = {}

    def keep(label, kernel, name):
        out[label] = (registers(kernel, name), stack_frame(kernel, name))

    cfg = m.moe_config(1, H, INTER)
    norm_sig = {"res_ptr": "*bf16", "s_out_ptr": "*bf16", "ssq_ptr": "*fp32"}
    kernel, _, name = _moe_stage(cfg, 2, arch, sig_extra=norm_sig, NORM=2)
    keep("moe stage 2, add + sums of squares", kernel, name)
    xn_sig = {"xn_ssq_ptr": "*fp32", "xn_w_ptr": "*bf16", "xn_h_ptr": "*bf16", "xn_eps": "fp32"}
    for label, N, K, kind, extra_sig, extra in (
            ("output projection, add + sums of squares", H, 4096, "block",
             {"cnt_ptr": "*i32", "res_ptr": "*bf16", "s_out_ptr": "*bf16", "ssq_ptr": "*fp32", "eps": "fp32"},
             dict(ADD_NORM=True, NORM_LAST=False)),
            ("router logits, finishing the norm (h and planes)", 256, H, "plain",
             dict(xn_sig, xn_hx_ptr="*bf16"), dict(XN_NSQ=320, XN_NSQP=512, XN_WRITE=True, XN_HX=True)),
            ("shared gate|up, applying the norm", 1536, H, "block", xn_sig,
             dict(XN_NSQ=320, XN_NSQP=512, XN_WRITE=False)),
            ("KDA input projection, finishing the norm", 20480, H, "block", xn_sig,
             dict(XN_NSQ=80, XN_NSQP=128, XN_WRITE=True))):
        c = g.gemv_config(kind, 1, N, K)
        bk = min(c.bk, g._pow2(K))
        split = g._split_for(K, bk, c.split)
        plain = kind == "plain"
        cx = dict(T=1, N=N, K=K, BN=c.bn, RS=c.rs, BK=bk, UNROLL=c.unroll, SCALE=2 if plain else 0,
                  OUT=3 if split > 1 or plain or extra.get("ADD_NORM") else 0, SPLIT=split, PREFETCH=c.prefetch,
                  ROW_ACC=c.row_acc, XS=0, XU=0, X_SWIGLU=False, PDL=True, KACC=g._kacc(c, bk), PRE=c.pre,
                  **{"XN_NSQ": 0, "XN_NSQP": 1, "INTERPRET": False, **extra})
        sig = dict(_GEMV_SIG, w_ptr="*bf16", s_ptr="*bf16", y_ptr="*fp32") if plain else dict(_GEMV_SIG)
        if cx["OUT"] == 3:
            sig["y_ptr"] = "*fp32"
        keep(label, compile_kernel(g.fp8_gemv_kernel, {**sig, **extra_sig}, cx, c.warps, arch), "fp8_gemv_kernel")
    add = compile_kernel(g.splitk_add_norm_kernel,
                         {"part_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "res_out_ptr": "*bf16",
                          "h_ptr": "*bf16", "eps": "fp32", "add_ptr": "*bf16"},
                         dict(N=H, T=1, SPLIT=1, BLOCK=4096, PDL=True, HAS_ADD=True), 8, arch)
    keep("add + norm, adding the shared expert", add, "splitk_add_norm_kernel")
    finish = compile_kernel(norm_rows_kernel,
                            {"s_ptr": "*bf16", "ssq_ptr": "*fp32", "nw_ptr": "*bf16", "h_ptr": "*bf16", "eps": "fp32",
                             "hx_ptr": "*bf16"}, dict(NSQ=320, T=1, N=H, INTERPRET=False, MOE_X=True, PDL=True), 8, arch)
    keep("split norm finished alone", finish, "norm_rows_kernel")
    return out


def moe_loads_before_wait(stage: int, preload: bool, arch: int = 90) -> tuple[int, int] | None:
    """(weight loads issued before the PDL wait, all global loads) in the SASS of one one-token mxfp4_moe
    stage, tuned config with or without `preload` (None where cuobjdump cannot read the architecture).
    The wait, griddepcontrol.wait, is ACQBULK in sm_90 SASS."""
    from sparkchat.engine.kernels import mxfp4_moe as m

    cfg = replace(m.moe_config(1, H, INTER, vec=0), preload1=preload, preload2=preload)
    _, sass, _ = _moe_stage(cfg, stage, arch)
    if sass is None:
        return None
    ops = [_op(i) for i in sass]
    wait = ops.index("ACQBULK")
    return ops[:wait].count("LDG"), ops.count("LDG")


def moe_vec_loads(stage: int, arch: int = 90, fence: bool = True) -> tuple[dict, int | None] | None:
    """A one-token MoE stage in 16-byte loads (MoeConfig.vec1 / vec2, stage 1 as the bench lists it: 16 gate
    rows, 64 words a step, 8 warps, 80 registers; stage 2 with the tuned blocks): per load kind, [before,
    after] the stage's first bf16x2 FMA (stage 1) or its PDL wait (stage 2, ACQBULK), plus "STL": [spill
    stores, 0]; and its registers. None where cuobjdump cannot read the architecture. fence=False drops
    the warp barrier that keeps the loads in front (_issue_fence)."""
    from sparkchat.engine.kernels import mxfp4_moe as m

    cfg = replace(m.moe_config(1, H, INTER), vec1=True, bn1=16, bkw1=64, warps1=8, maxnreg1=80, vec2=True)
    kernel, sass, name = _moe_stage(cfg, stage, arch, FENCE=fence)
    if sass is None:
        return None
    ops = [_op(ins) for ins in sass]
    split = ops.index("HFMA2") if stage == 1 else ops.index("ACQBULK")
    kinds: dict[str, list[int]] = {"STL": [ops.count("STL"), 0]}  # spills
    for i, ins in enumerate(sass):
        if ops[i] == "LDG":
            kind = ins.split()[1] if ins.startswith("@") else ins.split()[0]
            kinds.setdefault(kind, [0, 0])[i > split] += 1
    return kinds, registers(kernel, name)


def moe_vec_stage_ops(T: int, stage: int, arch: int = 90) -> tuple[dict[str, int], int | None] | None:
    """(instruction counts by opcode, registers) of a MoE stage in 16-byte loads as the engine launches it
    for T tokens (the tuned config, paired words, packed input, PDL); None where cuobjdump cannot read
    the architecture. BAR, STS/STSM and LDS count the trips through shared memory."""
    from sparkchat.engine.kernels import mxfp4_moe as m

    cfg = m.moe_config(T, H, INTER)
    plan = m._plan(T, K, H, INTER, cfg, True, x_packed=True)
    if stage == 1:
        fn, sig, meta = m.mxfp4_moe_stage1_vec_kernel, dict(_STAGE1_SIG, x_ptr="*i32", act_ptr="*bf16"), plan.meta1
    else:
        fn, sig, meta = m.mxfp4_moe_stage2_vec_kernel, dict(_STAGE2_SIG, act_ptr="*i32"), {**plan.meta2, "HAS_ADD": True}
    meta = {**meta, "PDL": True, "INTERPRET": False}
    warps, maxnreg = meta.pop("num_warps"), meta.pop("maxnreg", None)
    kernel = compile_kernel(fn, sig, meta, warps, arch, maxnreg=maxnreg)
    sass = disassemble(kernel, fn.__name__)
    if sass is None:
        return None
    counts: dict[str, int] = {}
    for ins in sass:
        counts[_op(ins)] = counts.get(_op(ins), 0) + 1
    counts["all"] = len(sass)
    return counts, registers(kernel, fn.__name__)


def router_sass(arch: int) -> list[str] | None:
    """The whole route_kernel (one token, the Ling shape) as the engine launches it: from the logits
    GEMV's split-K partials (as many as its tuned config makes)."""
    from sparkchat.engine.kernels import fp8_gemv as g
    from sparkchat.engine.kernels import router as r

    sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "w_ptr": "*fp32", "scaling": "fp32"}
    cfg = g.gemv_config("plain", 1, E, H)
    split = g._split_for(H, min(cfg.bk, g._pow2(H)), cfg.split)
    cx = dict(E=E, G=8, TG=4, K=K, KP=8, RENORM=True, T=1, SPLIT=split, PDL=True,
              PF_LINES=0, PF_PACE=0)  # the routing program alone, as without l2_prefetch
    return compile_sass(r.route_kernel, sig, cx, r.ROUTE_WARPS, arch)


def kda_step(arch: int, T: int = 1, programs: int = 4, warps: int = 4, keep: bool = False, norm_at_once: bool = False):
    """kda_decode_kernel compiled as a Ling KDA layer launches it (32 heads x 128, conv 4, bf16
    projections, beta folded in, PDL) with `programs` a head of `warps` warps each: the compiled kernel.
    norm_at_once: the head's output norm loads every position's o first (SPARKCHAT_TAIL_AT_ONCE bit 4)."""
    from sparkchat.engine.kernels import kda_decode as kd

    sig = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "f_ptr", "b_ptr", "og_ptr", "conv_ptr", "onw_ptr",
                                      "o_ptr", "win_ptr", "bx_ptr", "bw_ptr")}
    sig.update({name: "*fp32" for name in ("rec_ptr", "cw_ptr", "alog_ptr", "dtb_ptr", "steps_ptr")}, cnt_ptr="*i32")
    sig.update({name: "i32" for name in ("s_q", "s_qc", "s_k", "s_kc", "s_v", "s_vc", "s_f", "s_fc", "s_b", "s_bc",
                                         "s_og", "s_ogc", "s_cv", "s_cvc", "s_w", "s_wc")})
    sig.update(q_scale="fp32", lower_bound="fp32", eps="fp32")
    cx = dict(T=T, H=32, DH=128, KC=4, NB=programs, SAFE_GATE=True, KEEP=keep, FOLD_B=True, HID=H, BKH=512, PDL=True,
              NORM_AT_ONCE=norm_at_once)
    return compile_kernel(kd.kda_decode_kernel, sig, cx, warps, arch)


def mma_gemv(arch: int, l2_ahead: int = 0) -> tuple[object, float]:
    """The tensor-core FP8 GEMV as a 4-token verify launches it for KDA's fused projection (l2_ahead: with
    GemvConfig.l2_ahead set so): (the compiled kernel, weights a thread streams per k step)."""
    from sparkchat.engine.kernels import fp8_gemv as g

    cfg = g.gemv_config("block", 4, 20480, H)
    cx = dict(T=4, N=20480, K=H, BM=cfg.bn, BK=cfg.bk, SCALE=0, OUT=0, SPLIT=cfg.split, STAGES=cfg.stages,
              XS=0, XU=0, X_SWIGLU=False, PDL=True, L2_AHEAD=l2_ahead)
    return compile_kernel(g.fp8_mma_kernel, _GEMV_SIG, cx, cfg.warps, arch), cfg.bn * cfg.bk / (32 * cfg.warps)


def fma_gemv(arch: int, T: int, N: int, K: int, cfg=None, split_norm: int = 0,
             evict: str = "", plain: bool = False) -> tuple[object, float]:
    """The FMA GEMV (fp8_gemv_kernel, block scales, bf16 out) for T tokens at N x K with cfg (default:
    what the engine picks): (the compiled kernel, weights a thread streams per k step). split_norm: x is
    a split RMSNorm's input with that many sums of squares a token (fp8_block_gemv's split_norm). evict: the
    weights' L2 eviction hint (overrides.weight_eviction). plain: bf16 weights without scales, split-K partials
    out, as the router's logits (plain_gemv_partials). cfg.l2_ahead and cfg.pre as the engine launches them on
    a GPU."""
    from sparkchat.engine.kernels import fp8_gemv as g

    cfg = cfg or g.gemv_config("block", T, N, K)
    bk = min(cfg.bk, g._pow2(K))
    split = g._split_for(K, bk, cfg.split)
    cx = dict(T=T, N=N, K=K, BN=cfg.bn, RS=cfg.rs, BK=bk, UNROLL=cfg.unroll, SCALE=0, OUT=0 if split == 1 else 3,
              SPLIT=split, PREFETCH=cfg.prefetch, ROW_ACC=cfg.row_acc, XS=0, XU=0, X_SWIGLU=False, PDL=True,
              KACC=g._kacc(cfg, bk), EVICT=evict, L2_AHEAD=cfg.l2_ahead, PRE=cfg.pre)
    sig = _GEMV_SIG
    if plain:
        sig = dict(sig, w_ptr="*bf16", s_ptr="*bf16", y_ptr="*fp32")
        cx.update(SCALE=2, OUT=3)
    cx.update(XN_NSQ=0, XN_NSQP=1)
    if split_norm:
        sig = dict(sig, xn_ssq_ptr="*fp32", xn_w_ptr="*bf16", xn_h_ptr="*bf16", xn_eps="fp32")
        cx.update(XN_NSQ=split_norm, XN_NSQP=g._pow2(split_norm))
    return compile_kernel(g.fp8_gemv_kernel, sig, cx, cfg.warps, arch), cfg.bn * cfg.rs * bk / (32 * cfg.warps)


def add_norm_gemv(arch: int, cfg) -> tuple[object, list[str] | None]:
    """The one-token output projection (fp8_gemv_kernel at 2560 x 4096, block scales) with its residual
    add and the split norm's sums of squares in the launch (fp8_block_gemv_add_norm(..., split_norm=True)),
    in config cfg: (the compiled kernel, its SASS or None)."""
    from sparkchat.engine.kernels import fp8_gemv as g

    N, K_ = 2560, 4096
    bk = min(cfg.bk, g._pow2(K_))
    split = g._split_for(K_, bk, cfg.split)
    cx = dict(T=1, N=N, K=K_, BN=cfg.bn, RS=cfg.rs, BK=bk, UNROLL=cfg.unroll, SCALE=0, OUT=3, SPLIT=split,
              PREFETCH=cfg.prefetch, ROW_ACC=cfg.row_acc, XS=0, XU=0, X_SWIGLU=False, PDL=True,
              KACC=g._kacc(cfg, bk), ADD_NORM=True, NORM_LAST=False, XN_NSQ=0, XN_NSQP=1, PRE=cfg.pre)
    sig = dict(_GEMV_SIG, y_ptr="*fp32", cnt_ptr="*i32", res_ptr="*bf16", s_out_ptr="*bf16", ssq_ptr="*fp32")
    kernel = compile_kernel(g.fp8_gemv_kernel, sig, cx, cfg.warps, arch)
    return kernel, disassemble(kernel, "fp8_gemv_kernel")


MLA_SPLIT_SIG = {k: "*bf16" for k in ("ql_ptr", "qr_ptr", "c_ptr", "kr_ptr")}
MLA_SPLIT_SIG |= {"pos_ptr": "*i64", "po_ptr": "*fp32", "plse_ptr": "*fp32", "attend": "i32", "S": "i32",
                  "qk_scale": "fp32"}
MLA_SPLIT_SIG |= {k: "i32" for k in ("s_ql_t", "s_ql_h", "s_qr_t", "s_qr_h", "s_c", "s_kr")}


def mla_kernels(arch: int, T: int, smem: int, combine: int | None = None) -> dict[str, object]:
    """The three MLA step kernels compiled as `mla_decode_step` launches them at the Ling shapes (32 heads,
    rank 512, rope 64, nope and v 128) for T tokens on a device whose programs get `smem` bytes of shared
    memory (227 KiB: the H200; 99 KiB: sm_12x), the merge + unfold in MODE `combine` (None: the engine's
    config; one token always 0): {name: compiled kernel}."""
    import torch

    from sparkchat.engine.kernels import mla_decode as m

    real = m.max_shared_memory
    m.max_shared_memory = lambda device: smem
    try:
        cfg = m.default_config(torch.device("cuda"), 512, 64)
    finally:
        m.max_shared_memory = real
    Hh, R, P, NOPE, V = 32, 512, 64, 128, 128
    i32 = "i32"
    prep = {k: "*bf16" for k in ("q_ptr", "kv_ptr", "g_ptr")}
    prep |= {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64"}
    prep |= {k: "*bf16" for k in ("lat_ptr", "krc_ptr", "nw_ptr", "w_ptr", "ql_ptr", "qr_ptr", "gate_ptr")}
    prep |= {"eps": "fp32"} | {k: i32 for k in ("s_q", "s_kv", "s_g", "s_cs", "s_lat", "s_krc", "s_wh", "s_wn")}
    comb = {"po_ptr": "*fp32", "plse_ptr": "*fp32", "w_ptr": "*bf16", "gate_ptr": "*bf16", "out_ptr": "*bf16"}
    comb |= {k: i32 for k in ("S", "s_wh", "s_wn", "s_out")}
    return {
        "mla_prepare_kernel": compile_kernel(m.mla_prepare_kernel, prep, dict(
            T=T, H=Hh, NOPE=NOPE, P=P, R=R, BLOCK_R=cfg.prepare_block_r, HP=Hh, INTERPRET=False, PDL=True), 4, arch),
        "mla_decode_split_kernel": compile_kernel(m.mla_decode_split_kernel, MLA_SPLIT_SIG, dict(
            H=Hh, M=T * Hh, R=R, P=P, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, INTERPRET=False, ITERS=0, PDL=True),
            cfg.warps, arch, cfg.stages),
        "mla_combine_unfold_kernel": compile_kernel(m.mla_combine_unfold_kernel, comb, dict(
            T=T, H=Hh, M=T * Hh, R=R, NOPE=NOPE, V=V, BLOCK_V=cfg.unfold_block_v, SC=cfg.combine_chunk,
            INTERPRET=False, CHUNKS=0, PDL=True, MODE=(cfg.combine if combine is None else combine) if T > 1 else 0),
            cfg.unfold_warps, arch),
    }


def _resource_usage(kernel, name: str) -> str:
    """cuobjdump's resource-usage line(s) for a compiled kernel (REG, STACK, SHARED, ...)."""
    path = Path("/tmp") / f"sparkchat_usage_{name}.cubin"
    path.write_bytes(kernel.asm["cubin"])
    return subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(path)], capture_output=True, text=True).stdout


def registers(kernel, name: str) -> int | None:
    """Registers per thread of a compiled kernel (cuobjdump's resource usage; None if unreadable)."""
    m = re.search(r"REG:(\d+)", _resource_usage(kernel, name))
    return int(m.group(1)) if m else None


def stack_frame(kernel, name: str) -> int | None:
    """Bytes of local-memory stack a thread uses (register spills land there; None if unreadable)."""
    m = re.search(r"STACK:(\d+)", _resource_usage(kernel, name))
    return int(m.group(1)) if m else None


def verify_tails(arch: int, at_once: bool) -> dict[str, tuple[object, str]]:
    """The 4-token verify's MoE stage 2 as the engine launches it at the Ling shapes, its slot sum one
    token after another or (at_once, SPARKCHAT_TAIL_AT_ONCE bit 2) every token at once: {label: (compiled
    kernel, kernel name)}."""
    from sparkchat.engine.kernels import mxfp4_moe as m

    T = 4
    saved = os.environ.get("SPARKCHAT_TAIL_AT_ONCE")
    os.environ["SPARKCHAT_TAIL_AT_ONCE"] = "2" if at_once else "0"  # as the engine plans it (register cap too)
    try:
        plan = m._plan(T, K, H, INTER, m.moe_config(T, H, INTER), True, x_packed=True)
    finally:
        if saved is None:
            del os.environ["SPARKCHAT_TAIL_AT_ONCE"]
        else:
            os.environ["SPARKCHAT_TAIL_AT_ONCE"] = saved
    fn = m.mxfp4_moe_stage2_vec_kernel if plan.vec2 else m.mxfp4_moe_stage2_kernel
    meta = {**plan.meta2, "HAS_ADD": False, "PDL": True, "INTERPRET": False}
    warps, maxnreg = meta.pop("num_warps"), meta.pop("maxnreg", None)
    sig2 = dict(_STAGE2_SIG, act_ptr="*i32" if meta["ACT_PACKED"] else "*fp32")
    return {"moe stage 2 + slot sum": (compile_kernel(fn, sig2, meta, warps, arch, maxnreg=maxnreg), fn.__name__)}


def load_trips_after(sass: list[str], atomics: int) -> int:
    """How many separate runs of global loads (each followed by a store before the next run) come after
    the `atomics`-th global atomic: a tail's trips to memory, one a token when each token's loads wait
    for the stores before them."""
    seen, trips, loading = 0, 0, False
    for ins in sass:
        op = _op(ins)
        if op.startswith(("ATOMG", "RED")):
            seen += 1
            continue
        if seen < atomics:
            continue
        if op.startswith("LDG") and not loading:
            trips, loading = trips + 1, True
        elif op.startswith("STG"):
            loading = False
    return trips


def prompt_gemm(arch: int, M: int, N: int = 20480, K: int = 2560, smem: int | None = None):
    """(the prompt FP8 GEMM compiled for sm_<arch> with gemm_config's choice for M tokens, that config),
    shrunk to `smem` bytes of shared memory (default: the DGX Spark's 99 KB on sm_12x, the H200's 227 KB
    otherwise)."""
    from sparkchat.engine.kernels import fp8_gemm

    limit = smem or (101376 if arch >= 120 else 232448)
    cfg = fp8_gemm._shrink(fp8_gemm.gemm_config(M, N, K, None), limit)  # None: no device, no limit yet
    kernel = compile_kernel(fp8_gemm.fp8_block_gemm_kernel,
                            {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16", "M": "i32"},
                            dict(N=N, K=K, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP=cfg.group, SWAP=cfg.swap,
                                 INTERPRET=False), cfg.warps, arch, cfg.stages)
    return kernel, cfg


def moe_shared_report(arch: int) -> None:
    """Registers, stack and SASS size of the one-token MoE stages as the engine runs them (tuned config,
    and the 16-byte-load stages), with the shared expert beside them (SPARKCHAT_MOE_SHARED=0) or inside
    them (1: its down in stage 2; 2: both projections)."""
    from sparkchat.engine.kernels import mxfp4_moe as m

    tuned = m.moe_config(1, H, INTER, vec=0)
    vec = replace(tuned, vec1=True, vec2=True, **m._VEC1[(1, H, INTER)])
    for label, cfg in (("tuned", tuned), ("vec", vec)):
        for stage in (1, 2):
            for shared in (0, 1, 2):
                if stage == 1 and shared == 1:
                    continue  # stage 1 is unchanged by mode 1
                kernel, sass, name = _moe_stage(cfg, stage, arch, shared)
                ops = [_op(i) for i in sass] if sass else []
                size = f", {len(ops)} instructions, {ops.count('LDG')} LDG" if sass else ""
                print(f"  mxfp4_moe T=1 stage {stage} ({label}) SPARKCHAT_MOE_SHARED={shared}: "
                      f"{registers(kernel, name)} registers, {stack_frame(kernel, name)} bytes of stack{size}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, action="append", help="SM version, e.g. 90 (H200) or 121 (GB10)")
    args = ap.parse_args()
    for arch in args.arch or [90]:
        print(f"sm_{arch}:")
        for T in (1, 4):
            for packed, paired, act in ((False, False, False), (True, False, False), (True, True, False),
                                        (True, True, True)):
                for stage in (1, 2):
                    body, weights = moe_loop(T, stage, packed, arch, paired, act and stage == 2, act and stage == 1)
                    kind = ("bf16x2" if packed else "fp32 FMA") + (", paired words" if paired else "")
                    kind += (", packed act" if stage == 2 else ", packed x (from the norm)") if act else ""
                    report(f"mxfp4_moe T={T} stage {stage} {kind} (k loop)", body, weights)
        moe_shared_report(arch)
        for programs, warps in ((4, 4), (4, 2), (8, 2), (2, 4), (8, 1)):  # SPARKCHAT_KDA_LAUNCH1
            kernel = kda_step(arch, 1, programs, warps)
            sass = disassemble(kernel, "kda_decode_kernel")
            size = f", {len(sass)} instructions, {sum('BAR' in i for i in sass)} barriers" if sass else ""
            print(f"  kda_decode T=1, {programs} programs a head x {warps} warps: "
                  f"{registers(kernel, 'kda_decode_kernel')} registers, "
                  f"{stack_frame(kernel, 'kda_decode_kernel')} bytes of stack{size}")
        for label, (regs, stack) in split_norm_kernels(arch).items():  # SPARKCHAT_MOE_ADD_NORM=2 and the like
            print(f"  split norm: {label}: {regs} registers, {stack} bytes of stack")
        for at_once in (False, True):  # SPARKCHAT_TAIL_AT_ONCE: the verify's serial tails
            kernels = dict(verify_tails(arch, at_once))
            kernels["kda layer, output norm"] = (kda_step(arch, 4, 4, 4, keep=True, norm_at_once=at_once),
                                                 "kda_decode_kernel")
            for label, (kernel, name) in kernels.items():
                sass = disassemble(kernel, name)
                trips = "" if sass is None else (f", {load_trips_after(sass, 1)} runs of loads after its first "
                                                 f"atomic, {sum('BAR' in i for i in sass)} barriers")
                print(f"  verify T=4 {label}, tail {'at once' if at_once else 'token by token'}: "
                      f"{registers(kernel, name)} registers, {stack_frame(kernel, name)} bytes of stack{trips}")
        report("route_kernel (whole kernel, one warp)", router_sass(arch))
        kernel, weights = mma_gemv(arch)
        ptx = kernel.asm["ptx"]
        mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "no MMA"
        sass = disassemble(kernel, "fp8_mma_kernel")
        report(f"fp8_mma_kernel T=4 KDA ({mma}, k loop)", None if sass is None else loop_body(sass), weights)
        kernel, weights = fma_gemv(arch, 1, 20480, H)
        sass = disassemble(kernel, "fp8_gemv_kernel")
        report(f"fp8_gemv_kernel T=1 KDA ({registers(kernel, 'fp8_gemv')} registers, k loop)",
               None if sass is None else loop_body(sass), weights)
        smem = 232448 if arch == 90 else 101376
        for T in (1, 4):
            for name, kernel in mla_kernels(arch, T, smem).items():
                ptx = kernel.asm["ptx"]
                mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "no MMA"
                print(f"  {name} T={T}: {kernel.metadata.shared} bytes of shared memory, {mma}, "
                      f"{registers(kernel, name)} registers")
        for M in (16, 32, 64, 512):  # the prompt GEMM's token buckets (kernels/fp8_gemm.py)
            kernel, cfg = prompt_gemm(arch, M)
            ptx = kernel.asm["ptx"]
            mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "no MMA"
            name = "fp8_block_gemm_kernel"
            print(f"  {name} {M} tokens ({cfg.bm}x{cfg.bn}x{cfg.bk} tiles): {kernel.metadata.shared} bytes of shared "
                  f"memory, {mma}, {registers(kernel, name)} registers, {stack_frame(kernel, name)} bytes of stack")


if __name__ == "__main__":
    main()

"""MXFP4 routed-expert MoE for decode windows (T = 1..16 tokens) on tensor cores, one program set per
distinct expert.

Same interface and two-launch structure as `mxfp4_moe` (stage 1: gate/up GEMV + clamped SwiGLU;
stage 2: down GEMV, the last program of each output row block sums the slots), but each program feeds
its expert's weight tile straight to `tl.dot_scaled` (E2M1 codes + E8M0 scales as stored: Triton
decodes them, on the tensor cores where the GPU has MX instructions and in registers elsewhere) with
the window's tokens as the MMA's N side. So:
  - decoding costs the same for 1 token as for 16: the MMA does the multiply-adds, not one FMA per
    weight per token as in `mxfp4_moe`;
  - only the first slot that chose an expert computes it, for every token that chose it (the others
    only check in at stage 2's arrival counter): each distinct expert's bytes stream once, so routing
    that repeats experts between neighbouring tokens (a real model's) makes the verify cheaper.

Token columns: NTOK = 16 (the MMA's smallest N); columns of tokens that did not choose the expert
load nothing (masked) and store nothing. The SwiGLU output is rounded to bf16 (the MMA's input type;
the dequantize-then-matmul oracle rounds it the same way).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.counters import arrival_counters
from sparkchat.engine.kernels.pdl import pdl_args, pdl_wait

NTOK = 16  # token columns per program: the smallest N of a bf16 MMA
_E2M1 = tl.constexpr("e2m1")  # formats as constexprs: the interpreter wants them wrapped
_BF16 = tl.constexpr("bf16")

# E2M1 bytes -> bf16, 4 bytes (8 codes) per call: $4 = bytes B3..B0; $5, $6 = the scales 2^(s-1) of
# bytes (0, 1) and (2, 3) as bf16x2. prmt spreads two bytes to the low bytes of the two halves
# ([0, B1, 0, B0]); each nibble's magnitude bits go to bits 8:6 of its half and its sign to bit 15,
# which reads as bf16 (E2M1 value) * 2^-126 (codes 0 and 1: bf16 subnormals); one bf16x2 FMA by the
# scale gives the weights. Outputs: $0, $1 = low nibbles (even inputs) of bytes 0..3, $2, $3 = high
# nibbles (odd inputs).
_DECODE_ASM = tl.constexpr("""
{
.reg .b32 t0, t1, a, b, z;
mov.b32 z, 0x80008000;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shl.b32 a, t0, 6; shl.b32 b, t0, 12; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 a, a, b;
fma.rn.bf16x2 $0, a, $5, z;
shl.b32 a, t1, 6; shl.b32 b, t1, 12; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 a, a, b;
fma.rn.bf16x2 $1, a, $6, z;
shl.b32 a, t0, 2; shl.b32 b, t0, 8; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 a, a, b;
fma.rn.bf16x2 $2, a, $5, z;
shl.b32 a, t1, 2; shl.b32 b, t1, 8; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 a, a, b;
fma.rn.bf16x2 $3, a, $6, z;
}
""")


@triton.jit
def _is_first(ids_ptr, e, s, S: tl.constexpr, S_PAD: tl.constexpr):
    """True when slot s is the first slot (in t*K + k order) that chose expert e."""
    sl = tl.arange(0, S_PAD)
    ids_all = tl.load(ids_ptr + sl, mask=sl < S, other=-1).to(tl.int32)
    return tl.min(tl.where(ids_all == e, sl, S_PAD), axis=0) == s


@triton.jit
def _token_columns(ids_ptr, rw_ptr, e, T: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                   NT: tl.constexpr, RW: tl.constexpr):
    """For expert e, per token column t < NT: served (t < T and e is among its K experts), its slot
    t*K + k, and (RW) its routing weight."""
    tt = tl.arange(0, NT)
    kk = tl.arange(0, K_PAD)
    m = (tt[:, None] < T) & (kk[None, :] < K)
    ids = tl.load(ids_ptr + tt[:, None] * K + kk[None, :], mask=m, other=-1).to(tl.int32)
    match = (ids == e) & m
    served = tl.max(match.to(tl.int32), axis=1) > 0
    slot = tt * K + tl.sum(tl.where(match, kk[None, :], 0), axis=1)
    if RW:
        rw = tl.sum(tl.load(rw_ptr + tt[:, None] * K + kk[None, :], mask=match, other=0.0), axis=1)
    else:
        rw = tl.zeros([NT], dtype=tl.float32)
    return served, slot, rw


@triton.jit
def _mx_dot(w, s, xrow, served, acc, BN: tl.constexpr, BK: tl.constexpr, NT: tl.constexpr,
            INTERPRET: tl.constexpr, MODE: tl.constexpr):
    """acc [BN, NT] + (E2M1 tile w [BN, BK/2] uint8 with E8M0 scales s [BN, BK/32]) @ x [BK, NT], where
    column t of x is the BK bf16 activations at xrow[t] (zero for tokens not served).

    Triton's CPU interpreter has no dot_scaled: there the tile is decoded to fp32 (exactly: codes to bits,
    then times the scale) and multiplied in fp32, the same products the GPU's MMA sums."""
    if MODE == 1:  # our decode (PTX, above) to bf16 and two plain MMAs: even inputs, odd inputs
        sc = ((tl.minimum(s.to(tl.int32), 128) + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 2^(s-1)
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BN, BK // 32, 16]), [BN, BK // 2])
        lo, hi = tl.inline_asm_elementwise(_DECODE_ASM, "=r,=r,=r,=r,r,r,r", [w, sc],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        even = xrow[None, :] + 2 * tl.arange(0, BK // 2)[:, None]
        acc = tl.dot(lo, tl.load(even, mask=served[None, :], other=0.0), acc)
        acc = tl.dot(hi, tl.load(even + 1, mask=served[None, :], other=0.0), acc)
    else:
        x = tl.load(xrow[None, :] + tl.arange(0, BK)[:, None], mask=served[None, :], other=0.0)
        if INTERPRET:
            b = w.to(tl.int32)
            lo = (((b & 0x07) << 22) | ((b & 0x08) << 28)).to(tl.float32, bitcast=True)  # even inputs, x 2^-126
            hi = (((b & 0x70) << 18) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)  # odd inputs, x 2^-126
            wf = tl.reshape(tl.join(lo, hi) * 8.507059173023462e37, [BN, BK // 32, 32])  # x 2^126: E2M1 values
            sc = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # E8M0: 2^(s-127)
            wf = tl.reshape(wf * sc[:, :, None], [BN, BK])
            acc = tl.dot(wf, x.to(tl.float32), acc)
        else:
            acc = tl.dot_scaled(w, s, _E2M1, x, None, _BF16, acc)
    return acc


@triton.jit
def moe_tc_stage1_kernel(
    x_ptr, ids_ptr, rw_ptr, w13_ptr, s13_ptr, act_ptr, limit,
    T: tl.constexpr, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, NT: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr,
    INTERPRET: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (slot s, gate-row block nb): if s is its expert's first slot, gate and up rows
    [nb*BN, +BN) of that expert for every token that chose it -> act[slot, rows] bf16 (SwiGLU x routing
    weight)."""
    s = tl.program_id(0)
    nb = tl.program_id(1)
    pdl_wait(PDL)  # the expert ids come from the router, the kernel just before
    e = tl.load(ids_ptr + s).to(tl.int32)
    if _is_first(ids_ptr, e, s, T * K, S_PAD):
        served, slot, rw = _token_columns(ids_ptr, rw_ptr, e, T, K, K_PAD, NT, True)
        rows = nb * BN + tl.arange(0, BN)
        kb = tl.arange(0, BK // 2)
        ks = tl.arange(0, BK // 32)
        tt = tl.arange(0, NT)
        w_g = w13_ptr + e.to(tl.int64) * (2 * I * (H // 2)) + rows[:, None] * (H // 2) + kb[None, :]
        s_g = s13_ptr + e.to(tl.int64) * (2 * I * (H // 32)) + rows[:, None] * (H // 32) + ks[None, :]
        x_rows = x_ptr + tt * H  # column t: token t's activations
        acc_g = tl.zeros([BN, NT], dtype=tl.float32)
        acc_u = tl.zeros([BN, NT], dtype=tl.float32)
        for k0 in tl.range(0, H, BK):
            acc_g = _mx_dot(tl.load(w_g + k0 // 2), tl.load(s_g + k0 // 32), x_rows + k0, served, acc_g,
                            BN, BK, NT, INTERPRET, MODE)
            acc_u = _mx_dot(tl.load(w_g + I * (H // 2) + k0 // 2), tl.load(s_g + I * (H // 32) + k0 // 32),
                            x_rows + k0, served, acc_u, BN, BK, NT, INTERPRET, MODE)
        lim = tl.where(limit > 0, limit, float("inf"))
        a = tl.minimum(acc_g / (1.0 + tl.exp(-acc_g)), lim)  # silu, clamped above
        u = tl.minimum(tl.maximum(acc_u, -lim), lim)
        out = (a * u * rw[None, :]).to(tl.bfloat16)
        tl.store(act_ptr + slot[None, :] * I + rows[:, None], out, mask=served[None, :])


@triton.jit
def moe_tc_stage2_kernel(
    act_ptr, ids_ptr, w2_ptr, s2_ptr, part_ptr, cnt_ptr, y_ptr, add_ptr,
    T: tl.constexpr, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, HAS_ADD: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, NT: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr,
    INTERPRET: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (output-row block nb, slot s): if s is its expert's first slot, down rows [nb*BN, +BN)
    for every token that chose the expert -> part[slot, rows] fp32. Every program then checks in at the
    row block's counter; the last one sums each token's K slots in slot order into y (+ add) bf16.
    With PDL the expert ids (the router's, two kernels back) and the first k step's weights are read
    before pdl_wait."""
    nb = tl.program_id(0)
    s = tl.program_id(1)
    rows = nb * BN + tl.arange(0, BN)
    e = tl.load(ids_ptr + s).to(tl.int32)
    if _is_first(ids_ptr, e, s, T * K, S_PAD):
        served, slot, _ = _token_columns(ids_ptr, ids_ptr, e, T, K, K_PAD, NT, False)
        kb = tl.arange(0, BK // 2)
        ks = tl.arange(0, BK // 32)
        w_p = w2_ptr + e.to(tl.int64) * (H * (I // 2)) + rows[:, None] * (I // 2) + kb[None, :]
        s_p = s2_ptr + e.to(tl.int64) * (H * (I // 32)) + rows[:, None] * (I // 32) + ks[None, :]
        a_rows = act_ptr + slot * I  # column t: the activations of token t's slot
        w = tl.load(w_p)
        sc = tl.load(s_p)
        pdl_wait(PDL)
        acc = _mx_dot(w, sc, a_rows, served, tl.zeros([BN, NT], dtype=tl.float32), BN, BK, NT, INTERPRET, MODE)
        for k0 in tl.range(BK, I, BK):
            acc = _mx_dot(tl.load(w_p + k0 // 2), tl.load(s_p + k0 // 32), a_rows + k0, served, acc,
                          BN, BK, NT, INTERPRET, MODE)
        tl.store(part_ptr + slot[None, :] * H + rows[:, None], acc, mask=served[None, :])
    else:
        pdl_wait(PDL)
    # The last of the T*K programs of this row block sums the slots (stores above -> barrier -> release).
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + nb, 1, sem="acq_rel", scope="gpu")
    if done == T * K - 1:
        tl.debug_barrier()
        for t in tl.static_range(T):
            y = tl.zeros([BN], dtype=tl.float32)
            for k in tl.static_range(K):
                y += tl.load(part_ptr + (t * K + k) * H + rows, cache_modifier=".cg")
            y = y.to(tl.bfloat16)
            if HAS_ADD:  # the shared expert's output, added as torch adds two bf16 tensors
                y = (y.to(tl.float32) + tl.load(add_ptr + t * H + rows).to(tl.float32)).to(tl.bfloat16)
            tl.store(y_ptr + t * H + rows, y)
        tl.store(cnt_ptr + nb, 0)  # ready for the next launch


@dataclass(frozen=True)
class TcConfig:
    bn1: int = 16  # gate rows (and as many up rows) per stage-1 program
    bk1: int = 256  # inputs per k step along H
    warps1: int = 4
    bn2: int = 16  # output rows per stage-2 program
    bk2: int = 256  # inputs per k step along I
    warps2: int = 4
    mode: int = 0  # 0: tl.dot_scaled decodes; 1: our PTX decode + plain bf16 MMAs (scales clamp at 2)


@dataclass
class TcWorkspace:
    """Scratch for one call shape; reusable across calls and layers (stream-ordered)."""
    act: torch.Tensor  # bf16 [T*K, I]
    part: torch.Tensor  # fp32 [T*K, H]
    count: torch.Tensor  # int32 [>= H / bn2], zero between launches


def mxfp4_moe_tc_workspace(T: int, K: int, H: int, I: int, device) -> TcWorkspace:
    return TcWorkspace(
        act=torch.empty(T * K, I, dtype=torch.bfloat16, device=device),
        part=torch.empty(T * K, H, dtype=torch.float32, device=device),
        count=arrival_counters("mxfp4_moe", device, max(1, H // 4)),
    )


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fit(block: int, n: int) -> int:
    """Largest power of two <= block that divides n."""
    b = block
    while b > 1 and n % b:
        b //= 2
    return b


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class TcPlan:
    """Grids and constexprs of both stages for one (T, K, H, I, config); the benchmark times them apart."""
    grid1: tuple
    grid2: tuple
    meta1: dict
    meta2: dict

    def stage1(self, x, ids, rw, w13, s13, act, limit: float) -> None:
        moe_tc_stage1_kernel[self.grid1](x, ids, rw, w13, s13, act, limit, **self.meta1, **pdl_args(x.device))

    def stage2(self, act, ids, w2, s2, part, count, out, add=None) -> None:
        moe_tc_stage2_kernel[self.grid2](act, ids, w2, s2, part, count, out, out if add is None else add,
                                         HAS_ADD=add is not None, **self.meta2, **pdl_args(act.device))


def tc_plan(T: int, K: int, H: int, inter: int, cfg: TcConfig) -> TcPlan:
    bn1, bk1 = max(16, _fit(cfg.bn1, inter)), max(32, _fit(cfg.bk1, H))
    bn2, bk2 = max(16, _fit(cfg.bn2, H)), max(32, _fit(cfg.bk2, inter))
    common = dict(T=T, K=K, H=H, I=inter, NT=max(NTOK, _pow2(T)), K_PAD=_pow2(K), S_PAD=_pow2(T * K),
                  INTERPRET=_interpreting(), MODE=0 if _interpreting() else cfg.mode)
    return TcPlan(
        grid1=(T * K, inter // bn1),
        grid2=(H // bn2, T * K),
        meta1=dict(common, BN=bn1, BK=bk1, num_warps=cfg.warps1),
        meta2=dict(common, BN=bn2, BK=bk2, num_warps=cfg.warps2),
    )


def mxfp4_moe_tc(
    x: torch.Tensor,  # [T, H] bf16
    topk_ids: torch.Tensor,  # [T, K] int32/int64
    topk_weights: torch.Tensor,  # [T, K] fp32
    w13: torch.Tensor,  # [E, 2I, H/2] uint8
    w13_scale: torch.Tensor,  # [E, 2I, H/32] uint8
    w2: torch.Tensor,  # [E, H, I/2] uint8
    w2_scale: torch.Tensor,  # [E, H, I/32] uint8
    swiglu_limit: float = 0.0,
    *,
    out: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    join: Callable[[], None] | None = None,
    workspace: TcWorkspace | None = None,
    config: TcConfig | None = None,
) -> torch.Tensor:
    """Same contract as mxfp4_moe: sum_k w[t,k] * down_e(swiglu_L(gate_e x_t, up_e x_t)) (+ add) -> bf16
    [T, H]; experts of one token distinct, tokens may share them."""
    T, H = x.shape
    E = w13.shape[0]
    inter = w13.shape[1] // 2
    K = topk_ids.shape[1]
    assert x.dtype == torch.bfloat16 and x.is_contiguous(), "x must be contiguous bf16 [T, H]"
    assert 1 <= T <= 16, f"T={T}: this kernel serves decode windows of 1..16 tokens"
    assert topk_ids.shape == (T, K) and topk_ids.dtype in (torch.int32, torch.int64) and topk_ids.is_contiguous()
    assert topk_weights.shape == (T, K) and topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
    assert H % 32 == 0 and inter % 32 == 0, "H and I must be multiples of the MX group (32)"
    assert w13.dtype == torch.uint8 and w13.shape == (E, 2 * inter, H // 2) and w13.is_contiguous()
    assert w13_scale.dtype == torch.uint8 and w13_scale.shape == (E, 2 * inter, H // 32) and w13_scale.is_contiguous()
    assert w2.dtype == torch.uint8 and w2.shape == (E, H, inter // 2) and w2.is_contiguous()
    assert w2_scale.dtype == torch.uint8 and w2_scale.shape == (E, H, inter // 32) and w2_scale.is_contiguous()
    if not _interpreting():
        assert x.is_cuda, "mxfp4_moe_tc runs on CUDA (mxfp4_moe_reference is the CPU twin)"
    cfg = config or TcConfig()
    plan = tc_plan(T, K, H, inter, cfg)
    assert H % plan.meta2["BN"] == 0 and inter % plan.meta1["BN"] == 0, "H and I must be multiples of 16"
    if out is None:
        out = torch.empty(T, H, dtype=torch.bfloat16, device=x.device)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16 and out.is_contiguous()
    ws = workspace or mxfp4_moe_tc_workspace(T, K, H, inter, x.device)
    assert ws.act.dtype == torch.bfloat16 and ws.act.numel() >= T * K * inter
    assert ws.part.dtype == torch.float32 and ws.part.numel() >= T * K * H
    assert ws.count.dtype == torch.int32 and ws.count.numel() >= H // plan.meta2["BN"]
    plan.stage1(x, topk_ids, topk_weights, w13, w13_scale, ws.act, float(swiglu_limit))
    if join is not None:
        join()
    if add is not None:
        add = add.contiguous()
        assert add.shape == (T, H) and add.dtype == torch.bfloat16
    plan.stage2(ws.act, topk_ids, w2, w2_scale, ws.part, ws.count, out, add)
    return out

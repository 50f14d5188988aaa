"""MoE stage 1 (gate/up + SwiGLU) on the tensor cores: MXFP4 weights widened to f16, f16 activations.

Why: on the H200 the CUDA-core stage 1 (mxfp4_moe.py) spends ~3.4 instructions per 4-bit weight
(decode to bf16x2, bf16x2 FMAs, scales), ~6.8 per byte streamed, where the SMs issue ~8 per byte of HBM
bandwidth: the one-token MoE is bound by issue and latency together. Here:
- an E2M1 code becomes an E4M3 byte by moving bits (sign to bit 7, e1 e0 m to bits 4..2: the code / 64,
  exactly, normal or subnormal), five integer instructions a word of 8 codes; each byte pair then
  widens to f16x2 in one conversion (`cvt.rn.f16x2.e4m3x2`, sm_89 and newer);
- two `mma.sync.m16n8k16` (f16 in, fp32 out: the H200 and the DGX Spark's GB10 alike, no Hopper-only
  instruction; FP8 mma.sync itself is emulated on sm_90) multiply 16 weight rows (8 gate rows and their
  8 up rows) by one MX group (32 codes: a row's four words, one a thread of a quad);
- the 8 MMA columns are tokens: x * s in f16 (s a per-token power of two; 11 significant bits), so
  one MMA serves every token that chose the expert (up to 8) for the price of one;
- each group's result is scaled by its E8M0 byte into fp32 accumulators; the program's warps split K
  and meet in one reduction; SwiGLU, the routing weight, the store.

The twin is `mma_stage1_reference` (the same f16 activations, exactly dequantized weights, fp32 sums);
`pack_x_f16` (twin `pack_x_f16_reference`) builds the activations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.pdl import pdl_args, pdl_wait

MAX_TOKENS = 8  # a token an MMA column


@triton.jit
def _mma_group(wg, wu, b0, b1, b2, b3):
    """One MX group (32 codes) of rows g and g + 8 of a 16-row tile, as two m16n8k16 MMAs. wg / wu: the
    thread's word of each row (8 E2M1 codes), moved into E4M3 bytes (codes 0 2 4 6 and 1 3 5 7), each
    byte pair widened to f16x2 (exact: code / 64); b0..b3: the f16x2 activations of the same codes for the
    thread's column (pack_x_f16's order). Returns the thread's fp32 outputs: rows g, g+8 x columns 2t, 2t+1."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 lg, hg, lu, hu, p, q, a0, a1, a2, a3, c0, c1, c2, c3;
        .reg .b16 x0, x1;
        .reg .f32 z;
        mov.f32 z, 0f00000000;
        shl.b32 p, $4, 2; and.b32 p, p, 0x1C1C1C1C; shl.b32 q, $4, 4; and.b32 q, q, 0x80808080; or.b32 lg, p, q;
        shr.u32 p, $4, 2; and.b32 p, p, 0x1C1C1C1C; and.b32 q, $4, 0x80808080; or.b32 hg, p, q;
        shl.b32 p, $5, 2; and.b32 p, p, 0x1C1C1C1C; shl.b32 q, $5, 4; and.b32 q, q, 0x80808080; or.b32 lu, p, q;
        shr.u32 p, $5, 2; and.b32 p, p, 0x1C1C1C1C; and.b32 q, $5, 0x80808080; or.b32 hu, p, q;
        mov.b32 {x0, x1}, lg; cvt.rn.f16x2.e4m3x2 a0, x0; cvt.rn.f16x2.e4m3x2 a2, x1;
        mov.b32 {x0, x1}, lu; cvt.rn.f16x2.e4m3x2 a1, x0; cvt.rn.f16x2.e4m3x2 a3, x1;
        mov.b32 {x0, x1}, hg; cvt.rn.f16x2.e4m3x2 c0, x0; cvt.rn.f16x2.e4m3x2 c2, x1;
        mov.b32 {x0, x1}, hu; cvt.rn.f16x2.e4m3x2 c1, x0; cvt.rn.f16x2.e4m3x2 c3, x1;
        mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {a0, a1, a2, a3}, {$6, $7}, {z, z, z, z};
        mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {c0, c1, c2, c3}, {$8, $9}, {$0, $1, $2, $3};
        }
        """,
        "=f,=f,=f,=f,r,r,r,r,r,r", [wg, wu, b0, b1, b2, b3],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _e8m0(s):
    """E8M0 byte -> 2^(s - 127) in fp32 (s = 0 gives 0: 2^-127 is below every product here)."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pack_x_f16_kernel(x_ptr, xq_ptr, xf_ptr, H: tl.constexpr, BLOCK: tl.constexpr):
    """One token: x [H] bf16 -> xq [H] f16, x * s with each word's 8 values in the order 0 2 4 6 1 3 5 7
    (_mma_group's), s a power of two putting max |x| in [2^14, 2^15); and xf = 2^6 / s, the factor that
    turns the MMA's sums back into x's scale (2^6: the weights enter as code / 64)."""
    t = tl.program_id(0)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + t * H + k, mask=k < H, other=0.0).to(tl.float32)))
    s = tl.exp2(14.0 - tl.floor(tl.log2(tl.maximum(tl.max(amax, axis=0), 1e-30))))
    for d0 in tl.range(0, H, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        q = d % 8
        ok = d < H
        v = tl.load(x_ptr + t * H + (d - q) + (q % 4) * 2 + q // 4, mask=ok, other=0.0).to(tl.float32) * s
        tl.store(xq_ptr + t * H + d, v.to(tl.float16), mask=ok)
    tl.store(xf_ptr + t, 64.0 / s)


def pack_x_f16(x: torch.Tensor, xq: torch.Tensor | None = None, xf: torch.Tensor | None = None):
    """bf16 [T, H] -> (xq f16 [T, H], xf fp32 [T]) for mxfp4_moe_stage1_mma."""
    T, H = x.shape
    xq = torch.empty(T, H, dtype=torch.float16, device=x.device) if xq is None else xq
    xf = torch.empty(T, dtype=torch.float32, device=x.device) if xf is None else xf
    pack_x_f16_kernel[(T,)](x, xq, xf, H=H, BLOCK=1024, num_warps=4)
    return xq, xf


@triton.jit
def mxfp4_moe_stage1_mma_kernel(
    xq_ptr, xf_ptr, ids_ptr, rw_ptr, w13_ptr, s13_ptr, act_ptr, limit,
    T: tl.constexpr, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, W: tl.constexpr, CH: tl.constexpr,
    DEDUPE: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (slot, block of 8 intermediate rows). W warps split the H/32 groups; CH groups' loads are
    issued before their MMAs. DEDUPE: the first slot of each distinct expert serves every token that
    chose it (token j in MMA column j); else each slot serves its own token (column 0)."""
    s = tl.program_id(0)
    nb = tl.program_id(1)
    pdl_wait(PDL)
    e = tl.load(ids_ptr + s).to(tl.int32)
    sl = tl.arange(0, 32)
    if DEDUPE:
        ids_all = tl.load(ids_ptr + sl, mask=sl < T * K, other=-1).to(tl.int32)
        work = tl.min(tl.where(ids_all == e, sl, 32), axis=0) == s
    else:
        work = True
    if work:
        HW: tl.constexpr = H // 8
        HG: tl.constexpr = H // 32
        GPW: tl.constexpr = HG // W  # groups per warp
        idx = tl.arange(0, 32 * W)  # one element a thread: lane idx % 32 of warp idx // 32
        wi = idx // 32
        lane = idx % 32
        g = lane // 4
        t = lane % 4
        u = (t * 3) % 4  # the word of its quad's group a thread takes (a permutation Triton cannot vectorize)
        # the B column this lane loads: token g (DEDUPE) or the slot's token in column 0
        if DEDUPE:
            col_tok = g
            chose = tl.zeros([32 * W], dtype=tl.int32)
            for j in tl.static_range(T):
                hit = tl.max((tl.load(ids_ptr + j * K + sl, mask=sl < K, other=-1) == e).to(tl.int32), axis=0)
                chose = tl.maximum(chose, tl.where(g == j, hit, 0))
            col_ok = chose > 0
        else:
            col_tok = s // K + 0 * g
            col_ok = g == 0
        w_e = w13_ptr + e.to(tl.int64) * (2 * I * HW)
        s_e = s13_ptr + e.to(tl.int64) * (2 * I * HG)
        rg = nb * 8 + g  # gate row; its up row is I + rg
        m0 = wi * GPW  # this warp's first group
        bp = xq_ptr.to(tl.pointer_type(tl.int32)) + col_tok * (H // 2) + u * 4 + m0 * 16
        wg_p = w_e + rg * HW + u + m0 * 4
        wu_p = w_e + (I + rg) * HW + u + m0 * 4
        sg_p = s_e + rg * HG + m0
        su_p = s_e + (I + rg) * HG + m0
        acc_g0 = tl.zeros([32 * W], dtype=tl.float32)
        acc_g1 = tl.zeros([32 * W], dtype=tl.float32)
        acc_u0 = tl.zeros([32 * W], dtype=tl.float32)
        acc_u1 = tl.zeros([32 * W], dtype=tl.float32)
        for c in tl.range(0, GPW, CH):
            ld = ()
            for i in tl.static_range(CH):
                ld = ld + ((tl.load(wg_p + i * 4), tl.load(wu_p + i * 4), tl.load(sg_p + i), tl.load(su_p + i),
                            tl.load(bp + i * 16, mask=col_ok, other=0), tl.load(bp + i * 16 + 1, mask=col_ok, other=0),
                            tl.load(bp + i * 16 + 2, mask=col_ok, other=0),
                            tl.load(bp + i * 16 + 3, mask=col_ok, other=0)),)
            wg_p += CH * 4
            wu_p += CH * 4
            sg_p += CH
            su_p += CH
            bp += CH * 16
            for i in tl.static_range(CH):
                wg, wu, sg, su, b0, b1, b2, b3 = ld[i]
                d0, d1, d2, d3 = _mma_group(wg, wu, b0, b1, b2, b3)
                fg = _e8m0(sg)
                fu = _e8m0(su)
                acc_g0 += d0 * fg
                acc_g1 += d1 * fg
                acc_u0 += d2 * fu
                acc_u1 += d3 * fu
        # lane (g, t) now holds rows rg / I + rg for the tokens of columns 2t (…0) and 2t + 1 (…1)
        gate0 = tl.sum(tl.reshape(acc_g0, [W, 32]), axis=0)
        gate1 = tl.sum(tl.reshape(acc_g1, [W, 32]), axis=0)
        up0 = tl.sum(tl.reshape(acc_u0, [W, 32]), axis=0)
        up1 = tl.sum(tl.reshape(acc_u1, [W, 32]), axis=0)
        g1 = sl // 4
        t1 = sl % 4
        lim = tl.where(limit > 0, limit, float("inf"))
        for j in tl.static_range(T if DEDUPE else 1):
            tok = j if DEDUPE else s // K
            ids_j = tl.load(ids_ptr + tok * K + sl, mask=sl < K, other=-1).to(tl.int32)
            match = ids_j == e
            hit = tl.max(match.to(tl.int32), axis=0) > 0
            slot = tok * K + tl.sum(tl.where(match, sl, 0), axis=0)
            rw = tl.sum(tl.load(rw_ptr + tok * K + sl, mask=match, other=0.0), axis=0)
            xf = tl.load(xf_ptr + tok)
            gv = (gate0 if j % 2 == 0 else gate1) * xf
            uv = (up0 if j % 2 == 0 else up1) * xf
            a = tl.minimum(gv / (1.0 + tl.exp(-gv)), lim)
            uv = tl.minimum(tl.maximum(uv, -lim), lim)
            mine = (t1 == j // 2) & hit
            tl.store(act_ptr + slot * I + nb * 8 + g1, a * uv * rw, mask=mine)


def mxfp4_moe_stage1_mma(xq: torch.Tensor, xf: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor,
                         w13: torch.Tensor, s13: torch.Tensor, act: torch.Tensor, limit: float,
                         warps: int = 4, chunk: int = 4, dedupe: bool | None = None) -> torch.Tensor:
    """Stage 1 for T <= 8 tokens: act fp32 [T*K, I] (with dedupe, the rows of a slot that repeats an
    earlier slot's expert are written by that slot's program). xq, xf: pack_x_f16(x). w13: [E, 2I, H/2]
    uint8 in the checkpoint's word order."""
    T, K = ids.shape
    E, two_i, half_h = w13.shape
    inter, H = two_i // 2, half_h * 2
    assert 1 <= T <= MAX_TOKENS and T * K <= 32 and inter % 8 == 0 and (H // 32) % (warps * chunk) == 0
    dedupe = T > 1 if dedupe is None else dedupe
    grid = (T * K, inter // 8)
    mxfp4_moe_stage1_mma_kernel[grid](xq, xf, ids, rw, w13.view(torch.int32), s13, act, float(limit),
                                      T=T, K=K, H=H, I=inter, W=warps, CH=chunk, DEDUPE=dedupe,
                                      num_warps=warps, **pdl_args(xq.device))
    return act


def pack_x_f16_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of pack_x_f16 in x's own order: (x as the MMAs multiply it, in x's scale; xf)."""
    xf32 = x.float()
    amax = xf32.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    s = torch.exp2(14.0 - torch.floor(torch.log2(amax)))
    return (xf32 * s).to(torch.float16).float() / s, (64.0 / s).squeeze(-1)


def mma_stage1_reference(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w13: torch.Tensor,
                         s13: torch.Tensor, limit: float) -> torch.Tensor:
    """Twin of the MMA stage 1: act fp32 [T*K, I] from the f16-rounded activations and exact weights."""
    from sparkchat.engine.kernels.reference import dequant_mxfp4, swiglu

    T, K = ids.shape
    xq, _ = pack_x_f16_reference(x)
    inter = w13.shape[1] // 2
    out = torch.zeros(T * K, inter, dtype=torch.float32, device=x.device)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            h = dequant_mxfp4(w13[e], s13[e]) @ xq[t]
            out[t * K + k] = swiglu(h[:inter], h[inter:], limit) * rw[t, k]
    return out

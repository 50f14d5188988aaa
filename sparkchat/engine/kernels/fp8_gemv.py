"""FP8 (e4m3) weight-streaming GEMV for decode windows of T = 1..8 tokens.

One kernel, `fp8_gemv_kernel`, streams each weight row block once for all T tokens (fp32 FMAs into
per-lane accumulators reduced once at the end) and has three front ends:
  fp8_block_gemv   128x128 block scales (the release's non-expert linears)  -> bf16 [T, N]
                   (+ _swiglu: an MLP's down projection computing its SwiGLU input as it loads it;
                   + _add_norm: an output projection with the residual add and RMSNorm after it)
  fp8_head_gemv    one fp32 scale per row (the FP8 lm_head)                  -> fp32 logits [T, V]
  fp8_head_argmax  same GEMV, greedy argmax fused: each program writes only its (max, index) per
                   token, a second one-program-per-token kernel reduces them -> int64 [T]
A second kernel, `fp8_mma_kernel`, serves the same front ends on the tensor cores (GemvConfig.mma):
chosen for verify windows over many rows, where the FMA kernel pays T FMAs per weight and the MMA one
pass for up to 16 tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.counters import arrival_counters
from sparkchat.engine.kernels.device import interpreting
from sparkchat.engine.kernels.l2_prefetch import ask_l2_tile
from sparkchat.engine.kernels.norm_rows import SCALE_BLOCK, _normed_row, _norm_rows, _store_f16_acts, norm_rows_kernel
from sparkchat.engine.kernels.overrides import field_overrides, weight_eviction
from sparkchat.engine.kernels.packed_acts import _store_packed
from sparkchat.engine.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def _gemv_weights(w_ptr, s_ptr, r0, k0, sub, kk, N: tl.constexpr, K: tl.constexpr, KB: tl.constexpr,
                  BN: tl.constexpr, RS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                  SCALE: tl.constexpr, EVICT: tl.constexpr):
    """Raw fp8 tiles [BN, BK] of the RS row tiles at k0, and (block scales) the scale of each column
    (the RS tiles sit in one 128-row scale block). Constant data: loadable before pdl_wait."""
    cols = k0 + kk
    kmask = cols < K
    ws = ()
    for r in tl.static_range(RS):
        rows = r0 + r * BN + sub
        wp = w_ptr + rows[:, None] * K + cols[None, :]
        if EVEN_N and EVEN_K:
            w = tl.load(wp, eviction_policy=EVICT)
        elif EVEN_K:
            w = tl.load(wp, mask=(rows < N)[:, None], other=0.0, eviction_policy=EVICT)
        else:
            w = tl.load(wp, mask=(rows < N)[:, None] & kmask[None, :], other=0.0, eviction_policy=EVICT)
        ws = ws + (w,)
    if SCALE == 0:
        sc = tl.load(s_ptr + (r0 // SCALE_BLOCK) * KB + cols // SCALE_BLOCK, mask=kmask, other=0.0)
    else:
        sc = 1.0
    return ws, sc


@triton.jit
def _gemv_acts(x_ptr, sc, k0, kk, T: tl.constexpr, K: tl.constexpr, EVEN_K: tl.constexpr,
               SCALE: tl.constexpr, XS: tl.constexpr, XU: tl.constexpr, X_SWIGLU: tl.constexpr, lim,
               xn=(), XN: tl.constexpr = False, XN_WRITE: tl.constexpr = True, XN_HX: tl.constexpr = False,
               INTERPRET: tl.constexpr = False, hx_ptr=None):
    """Each token's activation chunk [BK] at k0 in fp32, already multiplied by the block scale of its
    columns (scaling the activations once replaces a multiply per weight). With X_SWIGLU, x rows hold
    [gate | up] (up at column XU) and the activation is the clamped SwiGLU of the two, rounded to bf16
    as the separate op would: an MLP's down projection then reads its gate/up projection's output
    directly. XN: x rows hold s, the norm's input, and xn = (norm weight, h out, write h?, each token's
    rsqrt): the activation is the RMSNorm's output, rounded as _norm_rows rounds it, and (XN_WRITE)
    written to h where asked, also as the MoE's packed planes at hx_ptr with XN_HX (_split_norm)."""
    cols = k0 + kk
    kmask = cols < K
    xs = ()
    for t in tl.static_range(T):
        if EVEN_K:
            xv = tl.load(x_ptr + t * XS + cols).to(tl.float32)
        else:
            xv = tl.load(x_ptr + t * XS + cols, mask=kmask, other=0.0).to(tl.float32)
        if XN:
            nw = tl.load(xn[0] + cols, mask=kmask, other=0.0).to(tl.float32)
            hv = (nw * (xv * xn[3][t]).to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
            xv = hv.to(tl.float32)
            if XN_WRITE:
                tl.store(xn[1] + t * XS + cols, hv, mask=kmask & xn[2])
                if XN_HX:
                    _store_packed(hx_ptr + t * K, cols, xv, kmask & xn[2], K, INTERPRET)
        if X_SWIGLU:
            up = tl.load(x_ptr + t * XS + XU + cols, mask=kmask, other=0.0).to(tl.float32)
            a = tl.minimum(xv / (1.0 + tl.exp(-xv)), lim)
            xv = (a * tl.minimum(tl.maximum(up, -lim), lim)).to(tl.bfloat16).to(tl.float32)
        if SCALE == 0:
            xv = xv * sc
        xs = xs + (xv,)
    return xs


@triton.jit
def _gemv_loads(x_ptr, w_ptr, s_ptr, r0, k0, sub, kk, T: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                KB: tl.constexpr, BN: tl.constexpr, RS: tl.constexpr, EVEN_N: tl.constexpr,
                EVEN_K: tl.constexpr, SCALE: tl.constexpr, XS: tl.constexpr, XU: tl.constexpr,
                X_SWIGLU: tl.constexpr, lim, xn=(), XN: tl.constexpr = False, XN_WRITE: tl.constexpr = True,
                XN_HX: tl.constexpr = False, INTERPRET: tl.constexpr = False, hx_ptr=None,
                EVICT: tl.constexpr = None):
    """One k step's weight tiles and scaled activation chunks."""
    ws, sc = _gemv_weights(w_ptr, s_ptr, r0, k0, sub, kk, N, K, KB, BN, RS, EVEN_N, EVEN_K, SCALE, EVICT)
    xs = _gemv_acts(x_ptr, sc, k0, kk, T, K, EVEN_K, SCALE, XS, XU, X_SWIGLU, lim, xn, XN, XN_WRITE, XN_HX,
                    INTERPRET, hx_ptr)
    return ws, xs


@triton.jit
def _split_norm(ssq_ptr, nw_ptr, h_ptr, eps, T: tl.constexpr, K: tl.constexpr, NSQ: tl.constexpr,
                NSQP: tl.constexpr):
    """The norm's other half for a GEMV whose x is s (XN): each token's rsqrt(sum of the NSQ partial sums
    of squares / K + eps), as _norm_rows takes it; the first row block's programs also write h."""
    q = tl.arange(0, NSQP)
    invs = ()
    for t in tl.static_range(T):
        ssq = tl.load(ssq_ptr + t * NSQ + q, mask=q < NSQ, other=0.0, cache_modifier=".cg")
        invs = invs + (tl.rsqrt(tl.sum(ssq, axis=0) / K + eps),)
    return nw_ptr, h_ptr, tl.program_id(0) == 0, invs


@triton.jit
def _gemv_step(accs, ws, xs, T: tl.constexpr, RS: tl.constexpr, ROW_ACC: tl.constexpr, KACC: tl.constexpr = 0):
    """accs[t*RS + r] += w_r * x_t for one k step: elementwise into [BN, BK] accumulators, or with
    ROW_ACC reduced over k right away into [BN] ones (several tokens: [BN, BK] per token would spill),
    or with KACC > 0 into [BN, KACC] ones, each the sum of BK / KACC neighbouring columns (a thread's
    own vector of loaded weights: no data leaves the thread, and the accumulators take BK / KACC times
    fewer registers)."""
    BN: tl.constexpr = ws[0].shape[0]
    BK: tl.constexpr = ws[0].shape[1]
    wf = ()
    for r in tl.static_range(RS):
        wf = wf + (ws[r].to(tl.float32),)
    new = ()
    for t in tl.static_range(T):
        xv = xs[t][None, :]
        for r in tl.static_range(RS):
            if ROW_ACC:
                new = new + (accs[t * RS + r] + tl.sum(wf[r] * xv, axis=1),)
            elif KACC > 0:
                p = tl.reshape(wf[r] * xv, [BN, KACC, BK // KACC])
                new = new + (accs[t * RS + r] + tl.sum(p, axis=2),)
            else:
                new = new + (accs[t * RS + r] + wf[r] * xv,)
    return new


@triton.jit
def fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, pmax_ptr, pidx_ptr,
    T: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
    BN: tl.constexpr, RS: tl.constexpr, BK: tl.constexpr, UNROLL: tl.constexpr,
    SCALE: tl.constexpr,  # 0: scale_inv [ceil(N/128), ceil(K/128)]; 1: scale [N]; 2: none (plain weights)
    OUT: tl.constexpr,  # 0: bf16 y [T, N]; 1: fp32 y [T, N]; 2: per-program (max, argmax) only;
                        # 3: fp32 split-K partial sums into y [SPLIT, T, N] (row scale not applied)
    SPLIT: tl.constexpr,  # programs along K (axis 1), each summing K / SPLIT columns
    PREFETCH: tl.constexpr,
    ROW_ACC: tl.constexpr,  # accumulate [BN] per token (reduce over k each step), not [BN, BK]
    XS: tl.constexpr = 0,  # x row stride (0: K)
    XU: tl.constexpr = 0,  # X_SWIGLU: column of the up half in each x row
    X_SWIGLU: tl.constexpr = False,
    lim=float("inf"),  # X_SWIGLU: the clamp (inf: none)
    PDL: tl.constexpr = False,  # programmatic dependent launch (kernels/pdl.py)
    KACC: tl.constexpr = 0,  # > 0: [BN, KACC] accumulators (_gemv_step)
    ADD_NORM: tl.constexpr = False,  # OUT 3: then the residual add and RMSNorm (_add_norm_tail)
    NORM_LAST: tl.constexpr = True,  # ADD_NORM: also the norm itself (else s and the sums of squares only)
    HAS_RES: tl.constexpr = True,  # ADD_NORM: a residual to add (False: the projection itself is normed)
    cnt_ptr=None, res_ptr=None, nw_ptr=None, s_out_ptr=None, h_ptr=None, ssq_ptr=None, eps=0.0,
    h16_ptr=None, hd_ptr=None, F16: tl.constexpr = False, hx_ptr=None, MOE_X: tl.constexpr = False,
    INTERPRET: tl.constexpr = False,
    # XN_NSQ > 0: x is s, an RMSNorm's input, with XN_NSQ partial sums of squares a token at xn_ssq_ptr;
    # the activations are the norm's output (weight xn_w_ptr), which the first row block writes to xn_h_ptr
    # (XN_WRITE False: not written here, another kernel does; XN_HX: also as the MoE's packed planes, xn_hx_ptr)
    xn_ssq_ptr=None, xn_w_ptr=None, xn_h_ptr=None, xn_eps=0.0, XN_NSQ: tl.constexpr = 0, XN_NSQP: tl.constexpr = 1,
    XN_WRITE: tl.constexpr = True, xn_hx_ptr=None, XN_HX: tl.constexpr = False,
    EVICT: tl.constexpr = "",  # the weights' L2 eviction hint (overrides.weight_eviction)
    L2_AHEAD: tl.constexpr = 0,  # GemvConfig.l2_ahead (0 under the interpreter)
    PRE: tl.constexpr = 1,  # GemvConfig.pre: k steps of weights loaded into registers before pdl_wait
):
    """Rows [pid*RS*BN, +RS*BN) of y = x @ w.T for T tokens, over this program's share of K. The
    program holds RS row tiles of [BN, BK] fp8 per k step; each token's activation chunk is loaded
    once and used for every tile; accumulators ([BN, BK] fp32 per token and tile) are reduced over k
    once at the end. Split-K keeps every SM streaming when N has few row blocks (o_proj, down)."""
    pid = tl.program_id(0)
    NP = tl.num_programs(0)
    r0 = pid * (RS * BN)
    sub = tl.arange(0, BN)
    kk = tl.arange(0, BK)
    KS: tl.constexpr = K // SPLIT  # columns per split (a multiple of BK when SPLIT > 1)
    k_lo = tl.program_id(1) * KS
    EVEN_K: tl.constexpr = K % BK == 0
    EVEN_N: tl.constexpr = N % (RS * BN) == 0
    KB: tl.constexpr = (K + SCALE_BLOCK - 1) // SCALE_BLOCK
    XSTRIDE: tl.constexpr = K if XS == 0 else XS
    NBLK: tl.constexpr = (N + RS * BN - 1) // (RS * BN)  # row blocks (ADD_NORM's sums of squares: NBLK * RS)
    accs = ()
    for i in tl.static_range(T * RS):
        if ROW_ACC:
            accs = accs + (tl.zeros([BN], dtype=tl.float32),)
        elif KACC > 0:
            accs = accs + (tl.zeros([BN, KACC], dtype=tl.float32),)
        else:
            accs = accs + (tl.zeros([BN, BK], dtype=tl.float32),)
    # The first k step's weights are loaded before pdl_wait: they overlap the previous kernel's tail.
    ws, sc = _gemv_weights(w_ptr, s_ptr, r0, k_lo, sub, kk, N, K, KB, BN, RS, EVEN_N, EVEN_K, SCALE, EVICT)
    # PRE > 1 (not with PREFETCH): the next PRE - 1 steps' too, held in registers through the wait
    PRE_N: tl.constexpr = 1 if (PREFETCH or KS <= BK) else (PRE if PRE * BK <= KS else KS // BK)  # whole steps
    pre_ws = ()
    pre_sc = ()
    for st in tl.static_range(1, PRE_N):
        w_st, sc_st = _gemv_weights(w_ptr, s_ptr, r0, k_lo + st * BK, sub, kk, N, K, KB, BN, RS, EVEN_N, EVEN_K,
                                    SCALE, EVICT)
        pre_ws = pre_ws + (w_st,)
        pre_sc = pre_sc + (sc_st,)
    # and the lines of the next L2_AHEAD k steps, which the loop reads after the wait, asked of L2 now:
    # no registers held, and HBM fetches them while the previous kernel's chain leaves it idle
    if L2_AHEAD:
        for st in tl.static_range(PRE_N, PRE_N + L2_AHEAD):
            if st * BK < KS:
                ask_l2_tile(w_ptr, r0, k_lo + st * BK, N, K, RS * BN, BK)
    pdl_wait(PDL)
    XN: tl.constexpr = XN_NSQ > 0
    if XN:
        xn = _split_norm(xn_ssq_ptr, xn_w_ptr, xn_h_ptr, xn_eps, T, K, XN_NSQ, XN_NSQP)
    else:
        xn = ()
    xs = _gemv_acts(x_ptr, sc, k_lo, kk, T, K, EVEN_K, SCALE, XSTRIDE, XU, X_SWIGLU, lim, xn, XN, XN_WRITE, XN_HX,
                    INTERPRET, xn_hx_ptr)
    if PREFETCH:
        # Software-pipelined by one k step: step k+1's weights and activations are in flight while
        # step k multiplies (the last step re-reads its own chunk: cache hits).
        for kb in tl.range(0, KS, BK, loop_unroll_factor=UNROLL):
            kn = k_lo + tl.minimum(kb + BK, (KS - 1) // BK * BK)
            ws_n, xs_n = _gemv_loads(x_ptr, w_ptr, s_ptr, r0, kn, sub, kk, T, N, K, KB, BN, RS, EVEN_N,
                                     EVEN_K, SCALE, XSTRIDE, XU, X_SWIGLU, lim, xn, XN, XN_WRITE, XN_HX,
                                     INTERPRET, xn_hx_ptr, EVICT)
            accs = _gemv_step(accs, ws, xs, T, RS, ROW_ACC, KACC)
            ws = ws_n
            xs = xs_n
    else:
        accs = _gemv_step(accs, ws, xs, T, RS, ROW_ACC, KACC)
        for st in tl.static_range(1, PRE_N):  # the steps loaded before the wait, in k order
            xs = _gemv_acts(x_ptr, pre_sc[st - 1], k_lo + st * BK, kk, T, K, EVEN_K, SCALE, XSTRIDE, XU, X_SWIGLU,
                            lim, xn, XN, XN_WRITE, XN_HX, INTERPRET, xn_hx_ptr)
            accs = _gemv_step(accs, pre_ws[st - 1], xs, T, RS, ROW_ACC, KACC)
        for kb in tl.range(PRE_N * BK, KS, BK, loop_unroll_factor=UNROLL):
            k0 = k_lo + kb
            ws, xs = _gemv_loads(x_ptr, w_ptr, s_ptr, r0, k0, sub, kk, T, N, K, KB, BN, RS, EVEN_N, EVEN_K,
                                 SCALE, XSTRIDE, XU, X_SWIGLU, lim, xn, XN, XN_WRITE, XN_HX, INTERPRET, xn_hx_ptr,
                                 EVICT)
            accs = _gemv_step(accs, ws, xs, T, RS, ROW_ACC, KACC)
    for t in tl.static_range(T):
        for r in tl.static_range(RS):
            rows = r0 + r * BN + sub
            if ROW_ACC:
                y = accs[t * RS + r]
            else:
                y = tl.sum(accs[t * RS + r], axis=1)
            if SCALE == 1 and OUT != 3:
                y = y * tl.load(s_ptr + rows, mask=rows < N, other=0.0)
            if OUT == 2:
                y = tl.where(rows < N, y, float("-inf"))
                m = tl.max(y, axis=0)
                j = r0 + r * BN + tl.argmax(y, axis=0, tie_break_left=True)
                if r == 0:
                    bv = m
                    bi = j
                else:
                    better = m > bv  # strict: the earlier tile wins ties
                    bi = tl.where(better, j, bi)
                    bv = tl.where(better, m, bv)
            elif OUT == 0:
                tl.store(y_ptr + t * N + rows, y.to(tl.bfloat16), mask=rows < N)
            elif OUT == 1:
                tl.store(y_ptr + t * N + rows, y, mask=rows < N)
            elif ADD_NORM and SPLIT == 1:
                # the whole sum is this program's: the add and the sum of squares from registers, with no
                # partials written, no arrival counter, no reload (_add_norm_tail's roundings)
                _add_rows(y, res_ptr, s_out_ptr, ssq_ptr, t, rows, pid * RS + r, N, NBLK * RS, HAS_RES)
            else:
                tl.store(y_ptr + (tl.program_id(1) * T + t) * N + rows, y, mask=rows < N)
        if OUT == 2:
            tl.store(pmax_ptr + t * NP + pid, bv)
            tl.store(pidx_ptr + t * NP + pid, bi)
    if ADD_NORM and SPLIT == 1:
        if NORM_LAST:
            _add_norm_last(s_out_ptr, cnt_ptr, nw_ptr, h_ptr, ssq_ptr, eps, h16_ptr, hd_ptr, hx_ptr, NBLK,
                           NBLK * RS, T, N, F16, MOE_X, INTERPRET)
    elif ADD_NORM:
        _add_norm_tail(y_ptr, cnt_ptr, res_ptr, nw_ptr, s_out_ptr, h_ptr, ssq_ptr, eps, h16_ptr, hd_ptr, hx_ptr,
                       pid, r0, sub, T, N, BN, RS, SPLIT, F16, MOE_X, INTERPRET, NORM_LAST, HAS_RES)


@triton.jit
def _split_sum(part_ptr, t, rows, m, T: tl.constexpr, N: tl.constexpr, SPLIT: tl.constexpr):
    """Token t's split-K partial sums [SPLIT, T, N] at `rows` (mask m) added in split order, read past L1
    (other programs wrote them)."""
    y = tl.load(part_ptr + t * N + rows, mask=m, other=0.0, cache_modifier=".cg")
    for p in tl.static_range(1, SPLIT):
        y += tl.load(part_ptr + (p * T + t) * N + rows, mask=m, other=0.0, cache_modifier=".cg")
    return y


@triton.jit
def _f16_exact(x):
    """x [BK, TN] (bf16 values, fp32) as fp16 times a power of two per column (token): each column is
    scaled so its largest magnitude lands in [2^14, 2^15) (fp16 holds every bf16 mantissa, not its
    range). Returns (fp16 tile, 1 / scale [TN]); the products with fp16 weights stay exact."""
    amax = tl.max(tl.abs(x), axis=0)
    e = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 16)  # biased exponent; 0/denormal -> 16
    up = ((268 - e) << 23).to(tl.float32, bitcast=True)  # 2^(14 - unbiased exponent)
    down = ((e - 14) << 23).to(tl.float32, bitcast=True)
    return (x * up[None, :]).to(tl.float16), down


@triton.jit
def fp8_mma_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, pmax_ptr, pidx_ptr,
    T: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    SCALE: tl.constexpr,  # 0: scale_inv [ceil(N/128), ceil(K/128)]; 1: scale [N]
    OUT: tl.constexpr,  # as fp8_gemv_kernel: 0 bf16 y, 1 fp32 y, 2 per-program (max, argmax), 3 split partials
    SPLIT: tl.constexpr, STAGES: tl.constexpr,
    XS: tl.constexpr = 0, XU: tl.constexpr = 0, X_SWIGLU: tl.constexpr = False, lim=float("inf"),
    PDL: tl.constexpr = False,
    xd_ptr=None,  # X_F16: fp32 [T, ceil(K/128)], the power of two undoing each block's scaling
    X_F16: tl.constexpr = False,  # x_ptr: fp16 [T, K], each 128-column block scaled as _f16_exact does
    L2_AHEAD: tl.constexpr = 0,  # GemvConfig.l2_ahead (0 under the interpreter)
):
    """fp8_gemv_kernel's results for a window of T ≤ 16 tokens on the tensor cores: rows
    [pid*BM, +BM) of y = x @ w.T as [BM, 16] MMA tiles, the tokens (zero-padded to 16) the N side.
    Weights go e4m3 -> fp16 (exact, one conversion per two weights) and the activations to fp16 under
    a per-token power of two per k step (_f16_exact), so every product is exact and accumulates in fp32,
    as the FMA kernel's do. Where CUDA cores pay T FMAs per weight, the MMA pays one pass for all
    tokens, and Triton's pipeliner keeps STAGES k steps of weights in flight (cp.async)."""
    pid = tl.program_id(0)
    NP = tl.num_programs(0)
    TN: tl.constexpr = 16
    rows = pid * BM + tl.arange(0, BM)
    toks = tl.arange(0, TN)
    kk = tl.arange(0, BK)
    KS: tl.constexpr = K // SPLIT
    KB: tl.constexpr = (K + SCALE_BLOCK - 1) // SCALE_BLOCK
    XSTRIDE: tl.constexpr = K if XS == 0 else XS
    k_lo = tl.program_id(1) * KS
    rmask = rows < N
    tmask = toks < T
    acc = tl.zeros([BM, TN], dtype=tl.float32)
    if L2_AHEAD:  # nothing is loaded before the wait here: the first L2_AHEAD k steps' lines asked of L2
        for st in tl.static_range(0, L2_AHEAD):
            if st * BK < KS:
                ask_l2_tile(w_ptr, pid * BM, k_lo + st * BK, N, K, BM, BK)
    pdl_wait(PDL)  # the activations are read inside the pipelined loop
    for kb in tl.range(0, KS, BK, num_stages=STAGES):
        cols = k_lo + kb + kk
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=rmask[:, None], other=0.0)
        xp = x_ptr + toks[None, :] * XSTRIDE + cols[:, None]
        if X_F16:  # already exact fp16 (f16_block_acts): no reduction across the tile in the loop
            xh = tl.load(xp, mask=tmask[None, :], other=0.0)
            down = tl.load(xd_ptr + toks * KB + (k_lo + kb) // SCALE_BLOCK, mask=tmask, other=0.0)
        else:
            xv = tl.load(xp, mask=tmask[None, :], other=0.0).to(tl.float32)  # [BK, TN]
            if X_SWIGLU:
                up = tl.load(xp + XU, mask=tmask[None, :], other=0.0).to(tl.float32)
                a = tl.minimum(xv / (1.0 + tl.exp(-xv)), lim)
                xv = (a * tl.minimum(tl.maximum(up, -lim), lim)).to(tl.bfloat16).to(tl.float32)
            xh, down = _f16_exact(xv)
        part = tl.dot(w.to(tl.float16), xh)
        if SCALE == 0:  # BM rows sit in one 128-row scale block, BK columns in one 128-column block
            down = down * tl.load(s_ptr + (pid * BM // SCALE_BLOCK) * KB + (k_lo + kb) // SCALE_BLOCK)
        acc += part * down[None, :]
    if SCALE == 1 and OUT != 3:
        acc = acc * tl.load(s_ptr + rows, mask=rmask, other=0.0)[:, None]
    if OUT == 2:
        y = tl.where(rmask[:, None], acc, float("-inf"))
        tl.store(pmax_ptr + toks * NP + pid, tl.max(y, axis=0), mask=tmask)
        tl.store(pidx_ptr + toks * NP + pid, pid * BM + tl.argmax(y, axis=0, tie_break_left=True), mask=tmask)
    else:
        m = rmask[:, None] & tmask[None, :]
        if OUT == 3:
            yp = y_ptr + (tl.program_id(1) * T + toks[None, :]) * N + rows[:, None]
        else:
            yp = y_ptr + toks[None, :] * N + rows[:, None]
        if OUT == 0:
            tl.store(yp, acc.to(tl.bfloat16), mask=m)
        else:
            tl.store(yp, acc, mask=m)


@triton.jit
def splitk_reduce_kernel(part_ptr, s_ptr, y_ptr, TN: tl.constexpr, N: tl.constexpr, SPLIT: tl.constexpr,
                         SCALE: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    """y = sum of the SPLIT partials, in a fixed order (deterministic, unlike atomics), then the row
    scale and the output dtype."""
    pdl_wait(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < TN
    acc = tl.load(part_ptr + i, mask=m, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * TN + i, mask=m, other=0.0)
    if SCALE == 1:
        acc = acc * tl.load(s_ptr + i % N, mask=m, other=0.0)
    if OUT_BF16:
        tl.store(y_ptr + i, acc.to(tl.bfloat16), mask=m)
    else:
        tl.store(y_ptr + i, acc, mask=m)


@triton.jit
def _add_rows(y, res_ptr, s_out_ptr, ssq_ptr, t, rows, tile, N: tl.constexpr, NSQ: tl.constexpr,
              HAS_RES: tl.constexpr = True):
    """Token t's rows of the projection y (fp32): s = bf16(residual + bf16(y)) (HAS_RES False: bf16(y),
    a projection normed with no residual before it) and the tile's sum of squares."""
    m = rows < N
    if HAS_RES:
        res = tl.load(res_ptr + t * N + rows, mask=m, other=0.0).to(tl.float32)
        sv = (res + y.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
    else:
        sv = y.to(tl.bfloat16)
    tl.store(s_out_ptr + t * N + rows, sv, mask=m)
    sf = tl.where(m, sv.to(tl.float32), 0.0)
    tl.store(ssq_ptr + t * NSQ + tile, tl.sum(sf * sf, axis=0))


@triton.jit
def _add_norm_tail(part_ptr, cnt_ptr, res_ptr, nw_ptr, s_out_ptr, h_ptr, ssq_ptr, eps, h16_ptr, hd_ptr, hx_ptr,
                   pid, r0, sub, T: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, RS: tl.constexpr,
                   SPLIT: tl.constexpr, F16: tl.constexpr, MOE_X: tl.constexpr, INTERPRET: tl.constexpr,
                   NORM_LAST: tl.constexpr = True, HAS_RES: tl.constexpr = True):
    """splitk_add_norm_kernel's work, done by the GEMV's own programs so that the output projection and
    the add+norm after it are one launch (SPLIT > 1: with one split the kernel adds from its registers,
    _add_rows). The last split of each row block to finish (arrival counter pid) sums its rows' partials
    in split order, adds the residual (s = bf16(residual + bf16(y))) and writes s and each row tile's sum
    of squares; the last row block to finish (counter NP) then turns s
    into h = w * bf16(s * rsqrt(mean(s²) + eps)) for all N columns (and h's F16 / MOE_X forms). Both
    counters are reset by the program that reads them. Same roundings as the two-launch path; only the
    order in which the squares are summed differs. NORM_LAST False: s and the sums of squares only, the
    norm left to its readers (SplitNorm)."""
    NP: tl.constexpr = (N + RS * BN - 1) // (RS * BN)  # row blocks
    tl.debug_barrier()  # this program's partial stores -> the release below
    done = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
    if done == SPLIT - 1:
        tl.debug_barrier()
        NSQ: tl.constexpr = NP * RS
        for t in tl.static_range(T):
            for r in tl.static_range(RS):
                rows = r0 + r * BN + sub
                m = rows < N
                _add_rows(_split_sum(part_ptr, t, rows, m, T, N, SPLIT), res_ptr, s_out_ptr, ssq_ptr, t, rows,
                          pid * RS + r, N, NSQ, HAS_RES)
        tl.store(cnt_ptr + pid, 0)
        if NORM_LAST:
            _add_norm_last(s_out_ptr, cnt_ptr, nw_ptr, h_ptr, ssq_ptr, eps, h16_ptr, hd_ptr, hx_ptr, NP, NSQ, T, N,
                           F16, MOE_X, INTERPRET)


@triton.jit
def _add_norm_last(s_out_ptr, cnt_ptr, nw_ptr, h_ptr, ssq_ptr, eps, h16_ptr, hd_ptr, hx_ptr, NP: tl.constexpr,
                   NSQ: tl.constexpr, T: tl.constexpr, N: tl.constexpr, F16: tl.constexpr, MOE_X: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """_add_norm_tail's end: the last row block to finish (counter NP) norms all N columns."""
    tl.debug_barrier()  # s and the sums of squares -> the release below
    last = tl.atomic_add(cnt_ptr + NP, 1, sem="acq_rel", scope="gpu")
    if last == NP - 1:
        tl.debug_barrier()
        _norm_rows(s_out_ptr, ssq_ptr, nw_ptr, h_ptr, eps, h16_ptr, hd_ptr, hx_ptr, NSQ, T, N, F16, MOE_X, INTERPRET)
        tl.store(cnt_ptr + NP, 0)


@triton.jit
def splitk_add_norm_kernel(part_ptr, res_ptr, nw_ptr, res_out_ptr, h_ptr, eps, N: tl.constexpr,
                           T: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr = False, h16_ptr=None, hd_ptr=None, F16: tl.constexpr = False,
                           hx_ptr=None, MOE_X: tl.constexpr = False, INTERPRET: tl.constexpr = False,
                           add_ptr=None, HAS_ADD: tl.constexpr = False, HAS_RES: tl.constexpr = True):
    """One program per token: y = the SPLIT partials summed in order, rounded to bf16 (the projection's
    output; HAS_ADD: plus add_ptr's bf16 [T, N], rounded again, as torch adds two bf16 tensors — a MoE
    layer's shared expert), then the residual add and RMSNorm that follow it, rounded as ops.add_rms_norm rounds:
    s = bf16(residual + y) (HAS_RES False: s = y); h = w * bf16(s * rsqrt(mean(s²) + eps)). Writes s and h. With SPLIT = 1
    the one partial may be bf16 (add_rms_norm). F16: also h as f16_block_acts gives it (h16 fp16 [T, N],
    hd fp32 [T, ceil(N/128)]), which the tensor-core GEMVs reading h then take as is. MOE_X: also h as
    the packed MoE stage 1 multiplies it (hx bf16 [T, N], mxfp4_moe.pack_moe_x's layout)."""
    pdl_wait(PDL)
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    m = i < N
    y = tl.load(part_ptr + t * N + i, mask=m, other=0.0)
    for p in tl.static_range(1, SPLIT):
        y += tl.load(part_ptr + (p * T + t) * N + i, mask=m, other=0.0)
    y = y.to(tl.bfloat16).to(tl.float32)
    if HAS_ADD:
        y = (y + tl.load(add_ptr + t * N + i, mask=m, other=0.0).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
    if HAS_RES:  # else the projection itself is normed (y is already bf16)
        y = (tl.load(res_ptr + t * N + i, mask=m, other=0.0).to(tl.float32) + y).to(tl.bfloat16).to(tl.float32)
    s = y
    # the interpreter's truncating casts kept (INTERPRET False), as _norm_rows and _add_rows have them: the
    # add+norm paths stay bit-identical to each other there
    h = _normed_row(s, tl.load(nw_ptr + i, mask=m, other=0.0), eps, N, False)
    tl.store(res_out_ptr + t * N + i, s.to(tl.bfloat16), mask=m)
    tl.store(h_ptr + t * N + i, h, mask=m)
    if F16:  # as _f16_exact: each block's amax -> [2^14, 2^15)
        _store_f16_acts(h16_ptr, hd_ptr, t, 0, h, m, N, BLOCK)
    if MOE_X:
        _store_packed(hx_ptr + t * N, i, h.to(tl.float32), m, N, INTERPRET)


@triton.jit
def argmax_reduce_kernel(pmax_ptr, pidx_ptr, out_ptr, NP: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    """One program per token: the first program holding the max wins (its index is the first max)."""
    pdl_wait(PDL)
    t = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_j = tl.zeros([BLOCK], tl.int32)
    for j0 in tl.static_range(0, NP, BLOCK):
        v = tl.load(pmax_ptr + t * NP + j0 + j, mask=j0 + j < NP, other=float("-inf"))
        better = v > best_v  # strict: earlier chunk wins ties
        best_v = tl.where(better, v, best_v)
        best_j = tl.where(better, j0 + j, best_j)
    m = tl.max(best_v, axis=0)
    win = tl.min(tl.where(best_v == m, best_j, NP), axis=0)
    tl.store(out_ptr + t, tl.load(pidx_ptr + t * NP + win).to(tl.int64))


@dataclass(frozen=True)
class GemvConfig:
    bn: int = 32  # rows per tile
    rs: int = 2  # row tiles per program, sharing each activation load (bn * rs divides 128)
    bk: int = 64  # k step
    unroll: int = 2
    warps: int = 4
    prefetch: bool = False  # one-step software pipelining of the k loop
    split: int = 1  # split-K programs per row block (partials summed by a second, tiny kernel)
    row_acc: bool = False  # reduce over k every step into per-row accumulators (for several tokens)
    mma: bool = False  # fp8_mma_kernel: bn rows x 16 tokens tensor-core tiles (bk ≤ 128 with block scales)
    stages: int = 3  # mma: k steps of weights in flight
    kacc: int = 0  # FMA kernel, > 0: [bn, kacc] accumulators, each thread summing its own bk/kacc columns first
    # with PDL: how many k steps' weight lines, past what a program loads into registers before its wait (the
    # FMA kernel's `pre` steps, nothing in the tensor-core one), it asks L2 for before that wait
    # (l2_prefetch.ask_l2_tile): HBM fetches them while the kernels before finish their chains
    l2_ahead: int = 0
    # FMA kernel without prefetch: k steps of weights loaded into registers before the PDL wait and held
    # through it (1: the first only; at most a program's steps), streamed while the kernels before finish
    pre: int = 1


# Best measured on the H200 at the Ling-3.0-flash shapes, by (kind, T, N, K); docs/benchmarks.md has
# the sweep. Wide k steps over few rows won at one token: more bytes in flight per program, fewer idle
# tails; [bn, bk/16] accumulators (kacc) halve the registers, so twice the warps hide the latency. At
# four tokens the tensor-core kernel wins where N is large — KDA, MLA, dense gate|up and the head get
# it from gemv_config's rule, the shared gate|up from here — and the small-N output and down
# projections stay on FMAs.
_G = GemvConfig
_TUNED: dict[tuple[str, int, int, int], GemvConfig] = {
    ("head", 1, 157184, 2560): _G(bn=8, rs=1, bk=512, unroll=1, warps=2, kacc=32),
    # router logits: split 5 (was 10) since it also finishes the MoE input's norm; H100, session 28, the
    # graphed step 2.479 -> 2.468 ms (4 rounds, each round ahead), the top-k adding half the partials
    ("plain", 1, 512, 2560): _G(bn=16, rs=1, bk=128, unroll=2, warps=4, split=5),
    ("plain", 4, 512, 2560): _G(bn=8, rs=1, bk=512, unroll=2, warps=2, split=5),
    ("block", 1, 20480, 2560): _G(bn=16, rs=1, bk=512, unroll=1, warps=2, kacc=32),  # KDA q|k|v|f|g
    ("block", 4, 20480, 2560): _G(bn=64, rs=1, bk=128, warps=4, split=2, mma=True, stages=3),  # session 10
    ("block", 1, 2560, 4096): _G(bn=8, rs=1, bk=512, unroll=2, warps=2, split=4, kacc=32),  # o_proj, MLA dense
    ("block", 4, 2560, 4096): _G(bn=32, rs=1, bk=128, unroll=1, warps=4, split=8, row_acc=True),
    ("block", 1, 1536, 2560): _G(bn=8, rs=1, bk=512, unroll=2, warps=2, kacc=32),  # shared expert gate|up
    ("block", 4, 1536, 2560): _G(bn=64, rs=1, bk=128, warps=4, split=5, mma=True, stages=4),
    ("block", 1, 2560, 768): _G(bn=8, rs=1, bk=1024, unroll=1, warps=4),  # shared expert down
    ("block", 4, 2560, 768): _G(bn=8, rs=1, bk=512, unroll=1, warps=2, row_acc=True),
    ("block", 1, 6912, 2560): _G(bn=8, rs=1, bk=512, unroll=2, warps=2, kacc=32),  # MLA q|kv_a|g
    ("block", 1, 12288, 2560): _G(bn=16, rs=1, bk=512, unroll=1, warps=4, kacc=32),  # dense MLP gate|up
    ("block", 1, 2560, 6144): _G(bn=8, rs=1, bk=512, unroll=2, warps=2, split=4, kacc=32),  # dense MLP down
    ("block", 4, 2560, 6144): _G(bn=8, rs=1, bk=512, unroll=1, warps=2, split=4, kacc=32),
}


MMA_MIN_ROWS = 4096  # untuned shapes with several tokens and at least this many rows go to the tensor cores


def gemv_config(kind: str, T: int, N: int | None = None, K: int | None = None) -> GemvConfig:
    """The config for (kind, T, N, K) (_gemv_config_for), with SPARKCHAT_GEMV_CONFIG's fields for that
    shape over it (gemv_config_overrides)."""
    cfg = _gemv_config_for(kind, T, N, K)
    fields = gemv_config_overrides(kind, T, N, K)
    return replace(cfg, **fields) if fields else cfg


def gemv_config_overrides(kind: str, T: int, N: int | None, K: int | None) -> dict:
    """SPARKCHAT_GEMV_CONFIG: GemvConfig fields for one GEMV shape, `<kind>.<T>.<N>.<K>.<field>:<value>`
    joined by `/` (e.g. `plain.1.512.2560.split:5/plain.1.512.2560.bk:256`, the router logits), for
    timing configs inside the graphed step with profile_step --switch (whose NAME=V1,V2 lists several
    values, hence no commas). "0" or unset: none."""

    def shape_ok(text: str) -> bool:
        parts = text.split(".")
        return len(parts) == 4 and all(p.isdigit() for p in parts[1:])

    return field_overrides("SPARKCHAT_GEMV_CONFIG", GemvConfig, f"{kind}.{T}.{N}.{K}", shape_ok,
                           "<kind>.<T>.<N>.<K>")


def _gemv_config_for(kind: str, T: int, N: int | None = None, K: int | None = None) -> GemvConfig:
    """Tuned config for ("block" | "head", T, N, K), else: the tensor-core kernel for 2-16 tokens over at
    least MMA_MIN_ROWS rows; otherwise the FMA kernel ([bn, bk/16] accumulators at one token, as most
    tuned one-token shapes have; one row tile per program beyond two tokens, which keeps the accumulators
    in registers), and split-K when N has too few row blocks to give every SM two programs."""
    tuned = _TUNED.get((kind, T, N, K))
    if tuned is not None:
        return tuned
    if 2 <= T <= 16 and N is not None and K is not None and N >= MMA_MIN_ROWS and K % 64 == 0:
        # several tokens over many rows: tensor cores (their cost does not grow with T, the FMA kernel's
        # does: KDA's projection at T = 2, 3, 4 took 23.3, 23.9, 23.3 µs against 32.7, 55.6, 32.5), split-K
        # (at most 2, as measured best) until there are two programs per SM
        bk = 128 if K % 128 == 0 else 64
        bn, steps = (128, 1) if kind == "head" else (64, K // bk)
        fits = [s for s in range(1, min(2, steps) + 1) if steps % s == 0]
        split = next((s for s in fits if -(-N // bn) * s >= 2 * _sm_count()), fits[-1])
        return GemvConfig(bn=bn, rs=1, bk=bk, warps=4, split=split, mma=True, stages=3)
    cfg = GemvConfig(bn=16, rs=1, bk=256, unroll=1, warps=4, kacc=16) if T == 1 else (
        GemvConfig() if T <= 2 else GemvConfig(rs=1))
    if N is None or K is None or kind == "head":
        return cfg
    programs, steps = -(-N // (cfg.bn * cfg.rs)), max(1, K // cfg.bk)
    if K % cfg.bk:
        return cfg
    # the fewest k splits (each a whole number of k steps, at most 8) that give every SM two programs
    fits = [s for s in range(1, 9) if steps % s == 0]
    split = next((s for s in fits if programs * s >= 2 * _sm_count()), fits[-1])
    return GemvConfig(**{**cfg.__dict__, "split": split})


def _sm_count() -> int:
    global _SMS
    if _SMS is None:
        _SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    return _SMS


_SMS: int | None = None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())



def _check_x_w(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int]:
    T, K = x.shape
    N, Kw = w.shape
    assert Kw == K, f"x has K={K}, w has K={Kw}"
    assert x.dtype == torch.bfloat16 and x.is_contiguous(), "x must be contiguous bf16 [T, K]"
    assert w.dtype == torch.float8_e4m3fn and w.is_contiguous(), "w must be contiguous float8_e4m3fn [N, K]"
    assert 1 <= T <= 8, f"T={T}: GEMV serves decode windows of 1..8 tokens"
    assert K % 16 == 0, "K must be a multiple of 16"
    if not interpreting():
        assert x.is_cuda and w.is_cuda, "fp8 GEMV runs on CUDA (use the *_reference twins on CPU)"
    return T, N, K


def _split_for(K: int, bk: int, split: int) -> int:
    """The largest split ≤ `split` that cuts K into whole k steps."""
    while split > 1 and K % (split * bk):
        split -= 1
    return split


def _gemv(x, w, s, y, pmax, pidx, scale_kind: int, out_kind: int, cfg: GemvConfig, bk: int, split: int,
          x_f16: tuple[torch.Tensor, torch.Tensor] | None = None, **extra) -> None:
    """One launch of the configured kernel (FMA or tensor-core) over a (row blocks, split) grid;
    x_f16 (f16_block_acts of x) serves the tensor-core kernel only."""
    T = x.shape[0]
    N, K = w.shape
    grid = (triton.cdiv(N, cfg.bn * cfg.rs), split)
    if cfg.mma:
        assert scale_kind in (0, 1) and T <= 16 and K % (split * bk) == 0 and cfg.rs == 1
        assert scale_kind == 1 or (128 % cfg.bn == 0 and 128 % bk == 0), "mma tiles inside one scale block"
        if x_f16 is not None and 128 % bk == 0 and not extra.get("X_SWIGLU", False):  # one scale a k step
            xh, xd = x_f16
            assert xh.shape == x.shape and xh.dtype == torch.float16 and xd.shape == (T, triton.cdiv(K, 128))
            x, extra = xh, dict(extra, xd_ptr=xd, X_F16=True)
        fp8_mma_kernel[grid](x, w, s, y, pmax, pidx, T=T, N=N, K=K, BM=cfg.bn, BK=bk, SCALE=scale_kind,
                             OUT=out_kind, SPLIT=split, STAGES=cfg.stages, num_warps=cfg.warps, **extra,
                             **_l2_ahead(cfg, x), **pdl_args(x.device))
        return
    assert 128 % (cfg.bn * cfg.rs) == 0, "bn * rs must divide the 128-row scale block"
    extra = dict(extra, **_gemv_hints(cfg, x))
    fp8_gemv_kernel[grid](x, w, s, y, pmax, pidx, T=T, N=N, K=K, BN=cfg.bn, RS=cfg.rs, BK=bk, UNROLL=cfg.unroll,
                          SCALE=scale_kind, OUT=out_kind, SPLIT=split, PREFETCH=cfg.prefetch, ROW_ACC=cfg.row_acc,
                          KACC=_kacc(cfg, bk), num_warps=cfg.warps, **extra, **pdl_args(x.device))


def _gemv_hints(cfg: GemvConfig, x: torch.Tensor) -> dict:
    """fp8_gemv_kernel's memory hints for this launch: the weights' L2 eviction policy
    (overrides.weight_eviction), the config's l2_ahead (compiled out under the interpreter) and the
    k steps it loads before its wait (cfg.pre; the default 1 is the kernel's own)."""
    evict = weight_eviction(2, x.device)
    return {**_l2_ahead(cfg, x), **({"EVICT": evict} if evict else {}), **({"PRE": cfg.pre} if cfg.pre > 1 else {})}


def _l2_ahead(cfg: GemvConfig, x: torch.Tensor) -> dict:
    """Either GEMV kernel's L2_AHEAD for cfg (none under the interpreter, which has no inline assembly)."""
    return {"L2_AHEAD": cfg.l2_ahead} if cfg.l2_ahead and x.is_cuda and not interpreting() else {}


def _kacc(cfg: GemvConfig, bk: int) -> int:
    """The accumulator width for a k step of bk columns (0: [bn, bk] ones, also when a small K has
    narrowed the step to kacc columns or fewer)."""
    if not 0 < cfg.kacc < bk:
        return 0
    assert bk % cfg.kacc == 0, f"kacc={cfg.kacc} must divide the k step ({bk})"
    return cfg.kacc


def _launch(x, w, s, y, pmax, pidx, scale_kind: int, out_kind: int, cfg: GemvConfig, **extra) -> None:
    T = x.shape[0]
    N, K = w.shape
    bk = min(cfg.bk, _pow2(K))
    split = _split_for(K, bk, cfg.split) if out_kind in (0, 1) else 1
    if split == 1:
        _gemv(x, w, s, y, pmax, pidx, scale_kind, out_kind, cfg, bk, 1, **extra)
        return
    part = torch.empty(split, T, N, dtype=torch.float32, device=x.device)
    _gemv(x, w, s, part, pmax, pidx, scale_kind, 3, cfg, bk, split, **extra)
    block = 1024
    splitk_reduce_kernel[(triton.cdiv(T * N, block),)](part, s, y, TN=T * N, N=N, SPLIT=split,
                                                        SCALE=scale_kind, OUT_BF16=out_kind == 0,
                                                        BLOCK=block, num_warps=4, **pdl_args(x.device))


def f16_block_acts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [T, K] -> (fp16 [T, K], fp32 [T, ceil(K/128)]): each 128-column block of each row times the
    power of two that puts its largest magnitude in [2^14, 2^15), and the inverse powers — exactly what
    fp8_mma_kernel's _f16_exact computes per k step of 128 columns, so the products are the same."""
    T, K = x.shape
    kb = triton.cdiv(K, 128)
    xf = torch.nn.functional.pad(x.float(), (0, kb * 128 - K)).view(T, kb, 128)
    e = ((xf.abs().amax(-1).view(torch.int32) >> 23) & 0xFF).clamp_min(16)
    up = ((268 - e) << 23).view(torch.float32)
    down = ((e - 14) << 23).view(torch.float32)
    return (xf * up[..., None]).view(T, kb * 128)[:, :K].to(torch.float16).contiguous(), down.contiguous()


@dataclass
class SplitNorm:
    """An RMSNorm left half done (mxfp4_moe_add_sumsq): its input s [T, K] bf16 and s's sums of squares
    in parts, fp32 [T, NSQ]. Attached to the norm's output h (not yet written) as `h.split_norm`; the
    GEMV reading h finishes the norm as it loads s and writes h for the layer's other readers
    (fp8_block_gemv's `split_norm`), or `finish` does, one launch."""
    s: torch.Tensor
    ssq: torch.Tensor
    weight: torch.Tensor
    eps: float
    write: bool = True  # False: a reader that only applies it (another kernel writes h)
    planes: torch.Tensor | None = None  # h as the MoE's packed stage 1 reads it (h.moe_x), written with h

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        """The norm's output (norm_rows_kernel): written into h (and its planes), or for a reader that only
        applies it (write off; another kernel writes h) into a tensor of its own."""
        T, N = self.s.shape
        out = h if self.write else torch.empty_like(h)
        planes = dict(hx_ptr=self.planes, MOE_X=True) if self.planes is not None and self.write else {}
        norm_rows_kernel[(1,)](self.s, self.ssq, self.weight, out, float(self.eps), NSQ=self.ssq.shape[1], T=T,
                               N=N, INTERPRET=interpreting(), num_warps=8, **planes, **pdl_args(h.device))
        return out

    def kernel_args(self, h: torch.Tensor) -> dict:
        """fp8_gemv_kernel's arguments for reading x as this norm's output (its x_ptr: self.s)."""
        nsq = self.ssq.shape[1]
        args = dict(xn_ssq_ptr=self.ssq, xn_w_ptr=self.weight, xn_h_ptr=h, xn_eps=float(self.eps), XN_NSQ=nsq,
                    XN_NSQP=_pow2(nsq), XN_WRITE=self.write, INTERPRET=interpreting())
        if self.planes is not None and self.write:
            args.update(xn_hx_ptr=self.planes, XN_HX=True)
        return args


def fp8_block_gemv(
    x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, *,
    out: torch.Tensor | None = None, config: GemvConfig | None = None,
    x_f16: tuple[torch.Tensor, torch.Tensor] | None = None, split_norm: SplitNorm | None = None,
) -> torch.Tensor:
    """x [T, K] bf16 @ (w fp8 [N, K] * 128x128 block scale_inv).T -> bf16 [T, N]; w streamed once.
    x_f16: x as f16_block_acts gives it, which the tensor-core kernel then reads instead of scaling x
    itself at every k step (same products). split_norm: x is an RMSNorm's output not yet written; the
    FMA kernel applies the norm to split_norm.s as it loads it and writes x (its first row block does,
    each split its columns); the tensor-core one has SplitNorm.finish write x first."""
    T, N, K = _check_x_w(x, w)
    assert scale_inv.dtype == torch.float32 and scale_inv.is_contiguous()
    assert scale_inv.shape == (triton.cdiv(N, 128), triton.cdiv(K, 128)), f"scale_inv {tuple(scale_inv.shape)}"
    if out is None:
        out = torch.empty(T, N, dtype=torch.bfloat16, device=x.device)
    assert out.shape == (T, N) and out.dtype == torch.bfloat16 and out.is_contiguous()
    cfg = config or gemv_config("block", T, N, K)
    if split_norm is not None and cfg.mma:  # the tensor-core kernel takes its activations in other forms
        x = split_norm.finish(x)
        split_norm = None
    x, extra = _split_norm_input(x, split_norm)
    _launch(x, w, scale_inv, out, out, out, 0, 0, cfg, x_f16=x_f16, **extra)
    return out


def fp8_block_gemv_add_norm(
    x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor,
    eps: float, *, config: GemvConfig | None = None, moe_x: bool = False, split_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's output projection and what follows it: s = residual + x @ w.T (bf16), then RMSNorm(s)
    with weight norm_w -> (s, norm(s)), both bf16 [T, N]: ops.add_rms_norm(residual, fp8_block_gemv(x,
    w, scale_inv), norm_w, eps) in one launch of the FMA kernel (its last programs add and norm:
    _add_norm_tail), else in two, the add and the norm done by the split-K reduce.
    moe_x (a MoE layer follows): the norm also comes as pack_moe_x(norm(s)), attached as `.moe_x`.
    split_norm (the FMA kernel): the launch writes s and its sums of squares only; norm(s) is returned
    unwritten, its SplitNorm attached as `.split_norm` for the GEMV that reads it first.
    residual None: a projection normed with nothing added before (the MTP layer's eh_proj and its input
    norm): s = x @ w.T, as fp8_block_gemv writes it."""
    T, N, K = _check_x_w(x, w)
    assert scale_inv.dtype == torch.float32 and scale_inv.is_contiguous()
    if residual is not None:
        assert residual.shape == (T, N) and residual.dtype == torch.bfloat16 and residual.is_contiguous()
    assert norm_w.shape == (N,) and norm_w.dtype == torch.bfloat16 and norm_w.is_contiguous()
    cfg = config or gemv_config("block", T, N, K)
    bk = min(cfg.bk, _pow2(K))
    split = _split_for(K, bk, cfg.split)
    part = torch.empty(split, T, N, dtype=torch.float32, device=x.device)
    s_out = torch.empty(T, N, dtype=torch.bfloat16, device=x.device)
    h = torch.empty_like(s_out)
    if residual is None:
        residual, extra = s_out, {"HAS_RES": False}  # a pointer the kernels never read
    else:
        extra = {}
    if split_norm and not cfg.mma:  # s and the sums of squares; the norm's reader finishes it
        blocks = triton.cdiv(N, cfg.bn * cfg.rs)
        ssq = torch.empty(T, blocks * cfg.rs, dtype=torch.float32, device=x.device)
        _gemv(x, w, scale_inv, part, part, part, 0, 3, cfg, bk, split, ADD_NORM=True, NORM_LAST=False,
              cnt_ptr=arrival_counters("gemv_add_norm", x.device, blocks + 1), res_ptr=residual, s_out_ptr=s_out,
              ssq_ptr=ssq, **extra)
        h.split_norm = SplitNorm(s_out, ssq, norm_w, eps, planes=torch.empty_like(h) if moe_x else None)
        if moe_x:
            h.moe_x = h.split_norm.planes
        return s_out, h
    if not cfg.mma and T >= fused_add_norm_min_tokens() and fused_add_norm_enabled():  # one launch
        blocks = triton.cdiv(N, cfg.bn * cfg.rs)
        ssq = torch.empty(T, blocks * cfg.rs, dtype=torch.float32, device=x.device)
        _gemv(x, w, scale_inv, part, part, part, 0, 3, cfg, bk, split, ADD_NORM=True,
              cnt_ptr=arrival_counters("gemv_add_norm", x.device, blocks + 1), res_ptr=residual, nw_ptr=norm_w,
              s_out_ptr=s_out, h_ptr=h, ssq_ptr=ssq, eps=float(eps), **_f16_outputs(h), **_moe_x_output(h, moe_x),
              **extra)
        return s_out, h
    _gemv(x, w, scale_inv, part, part, part, 0, 3, cfg, bk, split)
    splitk_add_norm_kernel[(T,)](part, residual, norm_w, s_out, h, float(eps), N=N, T=T, SPLIT=split,
                                 BLOCK=_pow2(N), num_warps=8, **_f16_outputs(h), **_moe_x_output(h, moe_x),
                                 **extra, **pdl_args(x.device))
    return s_out, h


# Measured on the H200 (docs/benchmarks.md, session 12): the graphed 4-token verify 0.1 ms faster fused,
# the one-token step 0.01 ms slower (its GEMV's registers went from 56 to 80 for the tail), so one token
# keeps the two launches. (Today's one-token output projection takes 72 registers either way, sm_90 SASS,
# session 22: SPARKCHAT_FUSED_ADD_NORM_ONE_TOKEN=1 fuses one token too; timed again in session 23, still
# 0.03 ms slower, most likely for the last row block's serial norm, the registers being the same.)
FUSED_ADD_NORM_MIN_TOKENS = 2


def fused_add_norm_min_tokens() -> int:
    """The shortest window whose output projection does its add+norm in its own launch."""
    return 1 if os.environ.get("SPARKCHAT_FUSED_ADD_NORM_ONE_TOKEN", "0") == "1" else FUSED_ADD_NORM_MIN_TOKENS


def fused_add_norm_enabled() -> bool:
    """Output projections with the add+norm in the GEMV's own launch (SPARKCHAT_FUSED_ADD_NORM=0: a
    second, one-program launch does it)."""
    return os.environ.get("SPARKCHAT_FUSED_ADD_NORM", "1") != "0"


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, norm_w: torch.Tensor, eps: float,
                 add: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.add_rms_norm(x, h, norm_w, eps) for a decode window, bf16 [T, N]: (x + h, RMSNorm(x + h)) in
    one launch of the split-K reduce's kernel, h its only partial. Inductor's fused kernel for the same
    thing cannot take part in programmatic dependent launch, so the GEMV after it could not start
    streaming its weights until it had finished. `add` (bf16 [T, N]): h is h + add first, rounded as
    torch rounds it (a MoE layer's shared expert output, added here rather than in the routed stages)."""
    T, N = x.shape
    assert h.shape == (T, N) and norm_w.shape == (N,)
    assert x.dtype == h.dtype == norm_w.dtype == torch.bfloat16
    extra = {}
    if add is not None:
        assert add.shape == (T, N) and add.dtype == torch.bfloat16
        extra = dict(add_ptr=add.contiguous(), HAS_ADD=True)
    s_out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    out = torch.empty_like(s_out)
    splitk_add_norm_kernel[(T,)](h.contiguous(), x.contiguous(), norm_w.contiguous(), s_out, out, float(eps), N=N,
                                 T=T, SPLIT=1, BLOCK=_pow2(N), num_warps=8, **_f16_outputs(out), **extra,
                                 **pdl_args(x.device))
    return s_out, out


F16_ACTS_MIN_TOKENS = 2  # windows this long feed tensor-core GEMVs (gemv_config), which take h16


def _f16_outputs(h: torch.Tensor) -> dict:
    """For a norm output h of a window the tensor-core GEMVs serve: buffers for its f16_block_acts
    form, attached to h as `h.f16_acts` (the GEMV front ends pick it up), as the add+norm kernel's
    extra arguments; else none. SPARKCHAT_F16_ACTS=0 turns it off."""
    T, N = h.shape
    if T < F16_ACTS_MIN_TOKENS or N % 128 or os.environ.get("SPARKCHAT_F16_ACTS", "1") == "0":
        return {}
    h16 = torch.empty(T, N, dtype=torch.float16, device=h.device)
    hd = torch.empty(T, N // 128, dtype=torch.float32, device=h.device)
    h.f16_acts = (h16, hd)
    return dict(h16_ptr=h16, hd_ptr=hd, F16=True)


def _moe_x_output(h: torch.Tensor, want: bool) -> dict:
    """When `want`: a buffer for h in the packed MoE stage 1's layout (pack_moe_x), attached to h as
    `h.moe_x` (ExpertsKernel passes it on), as the add+norm kernel's extra arguments; else none."""
    if not want or h.shape[1] % 8:
        return {}
    h.moe_x = torch.empty_like(h)
    return dict(hx_ptr=h.moe_x, MOE_X=True, INTERPRET=interpreting())


def fp8_block_gemv_swiglu(
    gate_up: torch.Tensor, up_offset: int, limit: float, w: torch.Tensor, scale_inv: torch.Tensor, *,
    out: torch.Tensor | None = None, config: GemvConfig | None = None,
) -> torch.Tensor:
    """An MLP's down projection fed straight from its fused gate|up output: gate_up [T, ≥ up_offset + K]
    bf16 (gate in columns 0..K-1, up from `up_offset`), w fp8 [N, K] -> bf16 [T, N] =
    swiglu_limit(gate, up) @ w.T, the SwiGLU computed as the GEMV loads its activations."""
    T = gate_up.shape[0]
    N, K = w.shape
    assert gate_up.dtype == torch.bfloat16 and gate_up.stride(1) == 1 and 1 <= T <= 8
    assert up_offset >= K and gate_up.shape[1] >= up_offset + K
    assert w.dtype == torch.float8_e4m3fn and w.is_contiguous() and scale_inv.is_contiguous()
    if out is None:
        out = torch.empty(T, N, dtype=torch.bfloat16, device=gate_up.device)
    lim = float(limit) if limit > 0 else float("inf")
    _launch(gate_up, w, scale_inv, out, out, out, 0, 0, config or gemv_config("block", T, N, K),
            XS=gate_up.stride(0), XU=up_offset, X_SWIGLU=True, lim=lim)
    return out


def fp8_head_gemv(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *,
    out: torch.Tensor | None = None, config: GemvConfig | None = None,
    x_f16: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """LM head: x [T, H] bf16 @ (w fp8 [V, H] * scale [V]).T -> fp32 logits [T, V]. x_f16: as for
    fp8_block_gemv."""
    T, V, H = _check_x_w(x, w)
    assert scale.dtype == torch.float32 and scale.shape == (V,) and scale.is_contiguous()
    if out is None:
        out = torch.empty(T, V, dtype=torch.float32, device=x.device)
    assert out.shape == (T, V) and out.dtype == torch.float32 and out.is_contiguous()
    _launch(x, w, scale, out, out, out, 1, 1, config or gemv_config("head", T, V, H), x_f16=x_f16)
    return out


def take_split_norm(x: torch.Tensor) -> SplitNorm | None:
    """x's SplitNorm (x a norm's output not yet written), removed from x where it writes x: the launch it
    is handed to writes x, and later readers read x as it is. A reading one stays (a side stream's view:
    it holds the sums of squares for as long as the view lives, i.e. until the side stream is joined)."""
    split = getattr(x, "split_norm", None)
    if split is not None and split.write:
        del x.split_norm
    return split


def _split_norm_input(x: torch.Tensor, split_norm: SplitNorm | None) -> tuple[torch.Tensor, dict]:
    """(the kernel's x, its extra arguments): x itself, or for x a split norm's unwritten output, the
    norm's input s and the arguments that have the kernel finish the norm (SplitNorm.kernel_args)."""
    if split_norm is None:
        return x, {}
    assert split_norm.s.shape == x.shape and split_norm.s.dtype == torch.bfloat16
    return split_norm.s, split_norm.kernel_args(x)


def plain_gemv_partials(x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None,
                        split_norm: SplitNorm | None = None) -> torch.Tensor:
    """x [T, K] bf16 @ w.T for a plain (fp32 or bf16) weight [N, K], summed in fp32, split over K:
    returns the split-K partial sums [S, T, N] fp32 for the consumer to add up in order (the router
    kernel does), so the logits cost one launch and no separate cast of x. split_norm: as
    fp8_block_gemv's (x, unwritten, is written by this launch where the SplitNorm says so)."""
    T, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and w.dtype in (torch.float32, torch.bfloat16) and w.is_contiguous()
    assert x.dtype == torch.bfloat16 and x.is_contiguous() and 1 <= T <= 8
    cfg = config or gemv_config("plain", T, N, K)
    bk = min(cfg.bk, _pow2(K))
    split = _split_for(K, bk, cfg.split)
    part = torch.empty(split, T, N, dtype=torch.float32, device=x.device)
    x, extra = _split_norm_input(x, split_norm)
    extra = dict(extra, **_gemv_hints(cfg, x))
    fp8_gemv_kernel[(triton.cdiv(N, cfg.bn * cfg.rs), split)](
        x, w, w, part, part, part, T=T, N=N, K=K, BN=cfg.bn, RS=cfg.rs, BK=bk, UNROLL=cfg.unroll, SCALE=2,
        SPLIT=split, PREFETCH=cfg.prefetch, ROW_ACC=cfg.row_acc, OUT=3, KACC=_kacc(cfg, bk), num_warps=cfg.warps,
        **extra, **pdl_args(x.device))
    return part


def fp8_head_argmax_workspace(T: int, V: int, device, config: GemvConfig | None = None, H: int | None = None):
    cfg = config or gemv_config("head", T, V, H)
    np_ = triton.cdiv(V, cfg.bn * cfg.rs)
    return (torch.empty(T, np_, dtype=torch.float32, device=device),
            torch.empty(T, np_, dtype=torch.int32, device=device))


def fp8_head_argmax(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *,
    out: torch.Tensor | None = None, workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """Greedy token of each row of x through the FP8 head, without writing the logits -> int64 [T]."""
    T, V, H = _check_x_w(x, w)
    assert scale.dtype == torch.float32 and scale.shape == (V,) and scale.is_contiguous()
    cfg = config or gemv_config("head", T, V, H)
    np_ = triton.cdiv(V, cfg.bn * cfg.rs)
    if workspace is None:
        workspace = fp8_head_argmax_workspace(T, V, x.device, cfg)
    pmax, pidx = workspace
    assert pmax.shape == (T, np_) and pidx.shape == (T, np_) and pidx.dtype == torch.int32
    if out is None:
        out = torch.empty(T, dtype=torch.int64, device=x.device)
    assert out.shape == (T,) and out.dtype == torch.int64
    _launch(x, w, scale, out, pmax, pidx, 1, 2, cfg)
    argmax_reduce_kernel[(T,)](pmax, pidx, out, NP=np_, BLOCK=min(4096, _pow2(np_)), num_warps=8,
                               **pdl_args(x.device))
    return out

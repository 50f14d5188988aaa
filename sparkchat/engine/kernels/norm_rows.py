"""The last step of a split RMSNorm (the output projection's add+norm tail in kernels/fp8_gemv.py, the
MoE's in kernels/mxfp4_moe.py): rows s whose sums of squares were written in parts -> the norm's output,
in the forms the kernels after it read."""

from __future__ import annotations

import os

import triton
import triton.language as tl

from sparkchat.engine.kernels.packed_acts import _store_packed
from sparkchat.engine.kernels.pdl import pdl_wait

SCALE_BLOCK: tl.constexpr = tl.constexpr(128)  # the release's FP8 weight block, both ways


def tail_at_once() -> int:
    """SPARKCHAT_TAIL_AT_ONCE, bits: which of a verify window's serial tails take all its tokens in the same
    tiles, every load before any store, instead of one token after another — 1: an output projection's
    fused add+norm (fp8_gemv._add_norm_tail, _norm_rows_at_once); 2: MoE stage 2's sum of the slots
    (mxfp4_moe._sum_slots); 4: KDA's gated output norm, run by each head's last program
    (kda_decode_kernel). One token after another, each token's loads wait for the stores before them
    (the compiler cannot move a load above a store that may alias it) and its sums are cross-warp
    reductions of their own: the 4-token verify's output projection is exposed 16 µs a layer (H100,
    session 28) against 4.4 for one token. Off (0) until timed."""
    return int(os.environ.get("SPARKCHAT_TAIL_AT_ONCE", "0"))


@triton.jit
def _norm_rows(s_ptr, ssq_ptr, nw_ptr, h_ptr, eps, h16_ptr, hd_ptr, hx_ptr, NSQ: tl.constexpr, T: tl.constexpr,
               N: tl.constexpr, F16: tl.constexpr, MOE_X: tl.constexpr, INTERPRET: tl.constexpr,
               AT_ONCE: tl.constexpr = False):
    """h = w * bf16(s * rsqrt(sum of the NSQ partial sums of squares / N + eps)) for each token, in
    chunks of 512 columns whose loads are all issued before any is used. AT_ONCE (T > 1): every token
    in the same tiles (_norm_rows_at_once), else one token after another."""
    if AT_ONCE and T > 1:
        _norm_rows_at_once(s_ptr, ssq_ptr, nw_ptr, h_ptr, eps, h16_ptr, hd_ptr, hx_ptr, NSQ, T, N, F16, MOE_X,
                           INTERPRET)
    else:
        _norm_rows_each(s_ptr, ssq_ptr, nw_ptr, h_ptr, eps, h16_ptr, hd_ptr, hx_ptr, NSQ, T, N, F16, MOE_X,
                        INTERPRET)


@triton.jit
def _norm_rows_each(s_ptr, ssq_ptr, nw_ptr, h_ptr, eps, h16_ptr, hd_ptr, hx_ptr, NSQ: tl.constexpr,
                    T: tl.constexpr, N: tl.constexpr, F16: tl.constexpr, MOE_X: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """_norm_rows one token after another: a token's loads wait for the stores before them (the compiler
    cannot move a load above a store that may alias it), so T tokens are T trips to L2, and each token's
    sums (the squares, F16's block maxima) are cross-warp reductions of their own."""
    CH: tl.constexpr = 512
    NC: tl.constexpr = (N + CH - 1) // CH
    NB: tl.constexpr = CH // SCALE_BLOCK
    i = tl.arange(0, CH)
    QB: tl.constexpr = 512
    q = tl.arange(0, QB)
    for t in tl.static_range(T):
        ssq = tl.zeros([QB], dtype=tl.float32)
        for q0 in tl.static_range(0, NSQ, QB):
            ssq += tl.load(ssq_ptr + t * NSQ + q0 + q, mask=q0 + q < NSQ, other=0.0, cache_modifier=".cg")
        ss = ()
        ws = ()
        for c in tl.static_range(NC):
            m = c * CH + i < N
            ss = ss + (tl.load(s_ptr + t * N + c * CH + i, mask=m, other=0.0, cache_modifier=".cg"),)
            ws = ws + (tl.load(nw_ptr + c * CH + i, mask=m, other=0.0),)
        inv = tl.rsqrt(tl.sum(ssq, axis=0) / N + eps)
        for c in tl.static_range(NC):
            cols = c * CH + i
            m = cols < N
            h = (ws[c].to(tl.float32) * (ss[c].to(tl.float32) * inv).to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
            tl.store(h_ptr + t * N + cols, h, mask=m)
            if F16:
                hb = tl.reshape(h.to(tl.float32), [NB, SCALE_BLOCK])
                e = tl.maximum((tl.max(tl.abs(hb), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF, 16)
                up = ((268 - e) << 23).to(tl.float32, bitcast=True)  # as splitk_add_norm_kernel's
                tl.store(h16_ptr + t * N + cols, tl.reshape((hb * up[:, None]).to(tl.float16), [CH]), mask=m)
                b = c * NB + tl.arange(0, NB)
                tl.store(hd_ptr + t * ((N + SCALE_BLOCK - 1) // SCALE_BLOCK) + b,
                         ((e - 14) << 23).to(tl.float32, bitcast=True), mask=b * SCALE_BLOCK < N)
            if MOE_X:
                _store_packed(hx_ptr + t * N, cols, h.to(tl.float32), m, N, INTERPRET)


@triton.jit
def _norm_rows_at_once(s_ptr, ssq_ptr, nw_ptr, h_ptr, eps, h16_ptr, hd_ptr, hx_ptr, NSQ: tl.constexpr,
                       T: tl.constexpr, N: tl.constexpr, F16: tl.constexpr, MOE_X: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """_norm_rows for every token in [TP, 512] tiles, each chunk's loads issued before the chunk before
    it is stored: one trip to L2 on the chain, not one a token, and each sum one reduction for all
    tokens. Same roundings as _norm_rows_each; the sums of squares may add in another order. (Holding
    every chunk, as _norm_rows_each does for one token, took the verify's output projection from 96 to
    110 registers, a program fewer an SM.)"""
    CH: tl.constexpr = 512
    NC: tl.constexpr = (N + CH - 1) // CH
    NB: tl.constexpr = CH // SCALE_BLOCK
    NBT: tl.constexpr = (N + SCALE_BLOCK - 1) // SCALE_BLOCK  # hd's row stride
    TP: tl.constexpr = 2 if T <= 2 else (4 if T <= 4 else 8)
    QB: tl.constexpr = 512
    tt = tl.arange(0, TP)
    tm = tt < T
    i = tl.arange(0, CH)
    q = tl.arange(0, QB)
    ssq = tl.zeros([TP, QB], dtype=tl.float32)
    for q0 in tl.static_range(0, NSQ, QB):
        ssq += tl.load(ssq_ptr + tt[:, None] * NSQ + q0 + q[None, :], mask=tm[:, None] & (q0 + q < NSQ)[None, :],
                       other=0.0, cache_modifier=".cg")
    m2 = tm[:, None] & (i < N)[None, :]
    s = tl.load(s_ptr + tt[:, None] * N + i[None, :], mask=m2, other=0.0, cache_modifier=".cg")
    w = tl.load(nw_ptr + i, mask=i < N, other=0.0)
    inv = tl.rsqrt(tl.sum(ssq, axis=1) / N + eps)  # [TP]
    for c in tl.static_range(NC):
        cols = c * CH + i
        m2 = tm[:, None] & (cols < N)[None, :]
        if c + 1 < NC:  # the next chunk in flight while this one is stored
            nxt = (c + 1) * CH + i
            nm = tm[:, None] & (nxt < N)[None, :]
            s_next = tl.load(s_ptr + tt[:, None] * N + nxt[None, :], mask=nm, other=0.0, cache_modifier=".cg")
            w_next = tl.load(nw_ptr + nxt, mask=nxt < N, other=0.0)
        h = (w[None, :].to(tl.float32) * (s.to(tl.float32) * inv[:, None]).to(tl.bfloat16).to(tl.float32))
        h = h.to(tl.bfloat16)
        tl.store(h_ptr + tt[:, None] * N + cols[None, :], h, mask=m2)
        if F16:
            hb = tl.reshape(h.to(tl.float32), [TP, NB, SCALE_BLOCK])
            e = tl.maximum((tl.max(tl.abs(hb), axis=2).to(tl.int32, bitcast=True) >> 23) & 0xFF, 16)  # [TP, NB]
            up = ((268 - e) << 23).to(tl.float32, bitcast=True)  # as splitk_add_norm_kernel's
            tl.store(h16_ptr + tt[:, None] * N + cols[None, :],
                     tl.reshape((hb * up[:, :, None]).to(tl.float16), [TP, CH]), mask=m2)
            b = c * NB + tl.arange(0, NB)
            tl.store(hd_ptr + tt[:, None] * NBT + b[None, :], ((e - 14) << 23).to(tl.float32, bitcast=True),
                     mask=tm[:, None] & (b * SCALE_BLOCK < N)[None, :])
        if MOE_X:
            _store_packed(hx_ptr + tt[:, None] * N, cols[None, :], h.to(tl.float32), m2, N, INTERPRET)
        if c + 1 < NC:
            s = s_next
            w = w_next


@triton.jit
def norm_rows_kernel(s_ptr, ssq_ptr, nw_ptr, h_ptr, eps, NSQ: tl.constexpr, T: tl.constexpr, N: tl.constexpr,
                     INTERPRET: tl.constexpr, hx_ptr=None, MOE_X: tl.constexpr = False, PDL: tl.constexpr = False):
    """_norm_rows as a launch of its own (one program): a split norm whose reader could not finish it."""
    pdl_wait(PDL)
    _norm_rows(s_ptr, ssq_ptr, nw_ptr, h_ptr, eps, None, None, hx_ptr, NSQ, T, N, False, MOE_X, INTERPRET)

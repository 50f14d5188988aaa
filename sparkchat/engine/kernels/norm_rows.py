"""The last step of a split RMSNorm (the output projection's add+norm tail in kernels/fp8_gemv.py, the
MoE's in kernels/mxfp4_moe.py): rows s whose sums of squares were written in parts -> the norm's output,
in the forms the kernels after it read."""

from __future__ import annotations

import triton
import triton.language as tl

from sparkchat.engine.kernels.packed_acts import _bf16_round, _store_packed
from sparkchat.engine.kernels.pdl import pdl_wait

SCALE_BLOCK: tl.constexpr = tl.constexpr(128)  # the release's FP8 weight block, both ways


@triton.jit
def _store_f16_acts(h16_ptr, hd_ptr, t, c0, h, m, N: tl.constexpr, W: tl.constexpr):
    """Columns c0..c0+W-1 of token t's norm output h (bf16 [W], m: inside the row) in the tensor-core
    GEMVs' form (fp8_gemv.f16_block_acts): each 128-column block scaled by a power of two into fp16's
    exact range (its amax -> [2^14, 2^15)), h16 fp16 [T, N], and the power undoing it, hd fp32 [T, N/128]."""
    NB: tl.constexpr = W // SCALE_BLOCK
    hb = tl.reshape(h.to(tl.float32), [NB, SCALE_BLOCK])
    e = tl.maximum((tl.max(tl.abs(hb), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF, 16)
    up = ((268 - e) << 23).to(tl.float32, bitcast=True)
    tl.store(h16_ptr + t * N + c0 + tl.arange(0, W), tl.reshape((hb * up[:, None]).to(tl.float16), [W]), mask=m)
    b = c0 // SCALE_BLOCK + tl.arange(0, NB)
    tl.store(hd_ptr + t * ((N + SCALE_BLOCK - 1) // SCALE_BLOCK) + b, ((e - 14) << 23).to(tl.float32, bitcast=True),
             mask=b * SCALE_BLOCK < N)


@triton.jit
def _to_bf16(v, INTERPRET: tl.constexpr):
    """fp32 -> nearest bf16 (the interpreter's own cast truncates)."""
    if INTERPRET:
        v = _bf16_round(v)
    return v.to(tl.bfloat16)


@triton.jit
def _normed_row(x, w, eps, N: tl.constexpr, INTERPRET: tl.constexpr):
    """RMSNorm of one row (bf16 values) as ops.rms_norm rounds it: bf16(w * bf16(x * rsqrt(mean(x²) + eps)))."""
    s = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s * s, axis=0) / N + eps)
    return _to_bf16(w.to(tl.float32) * _to_bf16(s * inv, INTERPRET).to(tl.float32), INTERPRET)


@triton.jit
def _norm_rows(s_ptr, ssq_ptr, nw_ptr, h_ptr, eps, h16_ptr, hd_ptr, hx_ptr, NSQ: tl.constexpr, T: tl.constexpr,
               N: tl.constexpr, F16: tl.constexpr, MOE_X: tl.constexpr, INTERPRET: tl.constexpr):
    """h = w * bf16(s * rsqrt(sum of the NSQ partial sums of squares / N + eps)) for each token, in
    chunks of 512 columns whose loads are all issued before any is used."""
    CH: tl.constexpr = 512
    NC: tl.constexpr = (N + CH - 1) // CH
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
                _store_f16_acts(h16_ptr, hd_ptr, t, c * CH, h, m, N, CH)
            if MOE_X:
                _store_packed(hx_ptr + t * N, cols, h.to(tl.float32), m, N, INTERPRET)


@triton.jit
def norm_rows_kernel(s_ptr, ssq_ptr, nw_ptr, h_ptr, eps, NSQ: tl.constexpr, T: tl.constexpr, N: tl.constexpr,
                     INTERPRET: tl.constexpr, hx_ptr=None, MOE_X: tl.constexpr = False, PDL: tl.constexpr = False):
    """_norm_rows as a launch of its own (one program): a split norm whose reader could not finish it."""
    pdl_wait(PDL)
    _norm_rows(s_ptr, ssq_ptr, nw_ptr, h_ptr, eps, None, None, hx_ptr, NSQ, T, N, False, MOE_X, INTERPRET)

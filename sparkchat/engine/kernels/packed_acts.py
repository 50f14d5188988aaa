"""The packed activation layout the MXFP4 MoE stages multiply (bf16x2 words of x * 2^100, in four planes),
and the exact bf16 rounding the kernels share: written by the add+norm kernels and stage 1, read by the
MoE stages (kernels/mxfp4_moe.py)."""

from __future__ import annotations

import triton
import triton.language as tl

_HI16 = tl.constexpr(-0x10000)  # 0xFFFF0000
_X_SCALE = tl.constexpr(1.2676506002282294e30)  # 2^100, applied to activations


@triton.jit
def _bf16_round(v):
    """fp32 -> nearest bf16, kept in fp32 (the interpreter's own casts truncate)."""
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & _HI16
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _store_packed(base, idx, v, mask, N: tl.constexpr, INTERPRET: tl.constexpr):
    """Activations v (elements idx of N) as a packed stage multiplies them: v * 2^100 rounded to bf16, in
    four planes — int32 word i * N/8 + w is the bf16x2 (v[8w + i], v[8w + i + 4]) that _pack_x would
    build (read with PLANE = N/8), so that a warp loading component i of consecutive words reads
    consecutive words. Half the bytes of fp32 and no conversions in the reading stage's k loop. Stage 1
    writes its act so for stage 2, the add+norm kernel the MoE input so for stage 1 (pack_moe_x)."""
    q = idx % 8
    dest = 2 * ((q % 4) * (N // 8) + idx // 8) + q // 4
    v = v * _X_SCALE
    if INTERPRET:
        v = _bf16_round(v)  # exact in bf16 now: the interpreter's truncating cast keeps it
    tl.store(base + dest, v.to(tl.bfloat16), mask=mask)

"""Tile helpers shared by the tensor-core prefill kernels (moe_prefill, fp8_gemm): one MMA step with
either operand order, its accumulator, broadcasting a per-row or per-column vector against it, and a
bf16 rounding that Triton's CPU interpreter gets right.

SWAP puts the weight tile on the MMA's left (acc [BN, BM] = W [BN, BK] @ x^T [BK, BM]): the weights,
decoded in registers, go straight into the MMA and the tokens are its N side, which may be as small as
16 (short prompts). Triton lowers tl.dot to wgmma on sm_90 and to mma.sync on sm_80..sm_121.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma(a, w, acc, SWAP: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a @ w^T ([BM, BN]) or, SWAP, acc + w @ a^T ([BN, BM]: the decoded weights are the MMA's
    left operand, taken from registers, and the tokens its N side), on tensor cores: bf16 in, fp32
    accumulate. Triton's CPU interpreter multiplies bf16 tensors in tl.dot as their raw uint16 bits,
    so there the operands are widened to fp32 first (exact: the same products)."""
    if INTERPRET:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    if SWAP:
        acc = tl.dot(w, tl.trans(a), acc)
    else:
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def zeros_acc(BM: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr):
    """An fp32 accumulator: [BN, BM] (SWAP) or [BM, BN]."""
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    return acc


@triton.jit
def per_row(v, SWAP: tl.constexpr):
    """A per-row vector [BM] broadcast against an accumulator tile."""
    if SWAP:
        out = v[None, :]
    else:
        out = v[:, None]
    return out


@triton.jit
def per_col(v, SWAP: tl.constexpr):
    """A per-column vector [BN] broadcast against an accumulator tile."""
    if SWAP:
        out = v[:, None]
    else:
        out = v[None, :]
    return out


@triton.jit
def to_bf16(v, INTERPRET: tl.constexpr):
    """fp32 -> bf16, round to nearest even. The interpreter's casts truncate (and its "rtne" mode
    mishandles a carry out of the mantissa), so there the rounding is done on the bits first."""
    if INTERPRET:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        v = b.to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16)

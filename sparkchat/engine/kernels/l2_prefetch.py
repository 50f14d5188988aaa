"""Asking L2 for lines a later load will read, with nothing brought back to the SM (sm_80 and newer).

Used where HBM idles behind a latency-bound chain: the router's top-k launch asks for the next layer's
input projection (router.route's `l2_prefetch`), and a GEMV's programs ask for their own later k steps
before their PDL wait (GemvConfig.l2_ahead). The lines are marked evict_last, so that the streamed
weights (evict_first on sm_90, overrides.weight_eviction) go before them. Not under Triton's CPU
interpreter, which has no inline assembly: callers pass the switch that compiles these calls out there.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ask_l2(ptrs):
    """A prefetch of the 128-byte line holding each of ptrs into L2 (evict_last)."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def ask_l2_tile(w_ptr, r0, c0, N: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Ask L2 for rows [r0, r0+ROWS) x columns [c0, c0+COLS) of the row-major [N, K] matrix at w_ptr: one
    prefetch a 128-byte line (rows and columns past the ends clamped to the last, which repeats a line)."""
    ESIZE: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    STEP: tl.constexpr = 128 // ESIZE  # elements a line
    LINES: tl.constexpr = (COLS + STEP - 1) // STEP
    rows = tl.minimum(r0 + tl.arange(0, ROWS), N - 1)
    cols = tl.minimum(c0 + tl.arange(0, LINES) * STEP, K - 1)
    ask_l2(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :])

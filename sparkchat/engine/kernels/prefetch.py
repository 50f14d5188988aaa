"""L2 prefetch: start a later read's DRAM traffic now, without holding registers for it.

A decode step is a chain of short kernels, many of them waiting on latency (a PDL wait, a top-k, a
recurrence) while HBM idles. A program that knows which weights are read next can ask L2 for them
(`prefetch.global.L2`, one instruction per 128-byte line, nothing returned to the SM): the later
loads then hit L2. Used where the bytes are known ahead and fit L2 with room to spare: the MoE's
stage 1 prefetches the down-projection rows its expert's stage 2 reads, and a GEMV program, before its
PDL wait, the k steps after the first (which it loads into registers).

A plain PTX instruction (sm_20 onwards: the H200 and the DGX Spark's GB10 alike). Under Triton's
interpreter there is no PTX: callers pass ENABLED=False there, which changes no result.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

LINE = tl.constexpr(128)  # bytes per L2 line


@triton.jit
def prefetch_lines(ptrs):
    """Ask L2 for the line holding each address of `ptrs` (any element type)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_share(base, nbytes, part, parts: tl.constexpr, LINES: tl.constexpr):
    """Share `part` of `parts` (consecutive, equal, whole lines) of the nbytes bytes at `base`.
    LINES: a power of two ≥ the lines in a share; addresses past the share repeat its last line."""
    b = base.to(tl.pointer_type(tl.uint8))
    share = ((nbytes + parts * LINE - 1) // (parts * LINE)) * LINE
    lo = part * share
    hi = tl.minimum(lo + share, nbytes) - 1
    if lo <= hi:
        offs = tl.minimum(lo + tl.arange(0, LINES) * LINE, hi)
        prefetch_lines(b + offs)


def share_lines(nbytes: int, parts: int) -> int:
    """LINES for prefetch_share: the lines in one of `parts` shares of nbytes, as a power of two."""
    lines = max(1, -(-nbytes // (parts * 128)))
    return 1 << (lines - 1).bit_length()


def l2_prefetch_enabled(env: str) -> bool:
    """Whether the prefetch switched by `env` runs: on unless `env`=0, never under the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") != "1" and os.environ.get(env, "1") != "0"

"""Warming the L2 cache with weights a later kernel will stream, while the memory bus is idle.

A MoE layer's chain (router GEMV → top-k → stage 1 → stage 2) is latency-bound: from the attention's
end to stage 2's end the H200 moves ~33 MB in ~24 µs where its bus could move ~100 MB (session 21's
timeline). The next layer's input projection (52.5 MB for KDA) cannot start before that chain ends, but
its weights are constant: prefetched into L2 during the chain, part of them is read from L2, not DRAM,
when its GEMV runs. `l2_prefetch_kernel` issues one `prefetch.global.L2` per 128-byte line (no
registers held, no result: the line arrives in L2 and the program moves on); it writes nothing, so it
runs on its own stream beside the chain and needs no twin — the model's outputs are the same with it on
or off, which is what the tests check.

`prefetch.global.L2` is PTX for sm_80 and newer (the H200's sm_90, the DGX Spark's sm_121 alike).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LINE = 128  # bytes: an L2 line
LINES_PER_PROGRAM = 1024  # 128 KB a program, 8 prefetches a thread at 4 warps


@triton.jit
def l2_prefetch_kernel(ptr, nbytes, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Prefetch bytes [pid * LINES * 128, ...) of ptr (a byte pointer) into L2, clamped to nbytes.
    EVICT_LAST marks the lines to be evicted last (the MoE's streamed weights, read once, go first)."""
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.minimum((pid * LINES + tl.arange(0, LINES)) * 128, nbytes - 1)  # past the end: the last line again
    addr = (ptr + offs).to(tl.int64, bitcast=True)
    # is_pure=False: the result is unused, the instruction is what matters (kept, not dead code)
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [addr],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [addr],
                                  dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, nbytes: int, *, evict_last: bool = True) -> None:
    """Prefetch the first `nbytes` of `t` (a contiguous CUDA tensor; all of it when smaller) into L2."""
    assert t.is_cuda and t.is_contiguous(), "a contiguous CUDA tensor"
    raw = t.view(-1).view(torch.uint8)
    nbytes = min(int(nbytes), raw.numel())
    if nbytes <= 0:
        return
    grid = (triton.cdiv(nbytes, LINES_PER_PROGRAM * LINE),)
    l2_prefetch_kernel[grid](raw, nbytes, LINES=LINES_PER_PROGRAM, EVICT_LAST=evict_last, num_warps=4)

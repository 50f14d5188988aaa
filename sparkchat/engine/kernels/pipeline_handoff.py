"""The pipelined MTP loop's small steps between two cycles, one launch each (engine/pipeline.py holds
their torch twins, accept_greedy_ops and next_inputs_ops): the greedy acceptance of a verify, and the
inputs of the cycle queued behind it. As torch ops they are ~15 tiny kernels a cycle, each a launch's
latency on the GPU's critical path between a verify's end and the next draft chain's start."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

HIDDEN_BLOCK = 1024  # hidden-state elements a program copies at a time


@triton.jit
def accept_greedy_kernel(drafts_ptr, target_ptr, accepted_ptr, next_ptr, result_ptr, K: tl.constexpr,
                         KP: tl.constexpr):
    """accepted = the drafts' leading run equal to the target's picks; next = the target's pick after it;
    result = drafts, accepted, next (what the host reads)."""
    i = tl.arange(0, KP)
    d = tl.load(drafts_ptr + i, mask=i < K, other=-1)
    t = tl.load(target_ptr + i, mask=i < K + 1, other=-1)
    stop = (d != t) | (i >= K)  # draft i rejected, or past the drafts
    accepted = tl.min(tl.where(stop, i, KP), axis=0)
    nxt = tl.sum(tl.where(i == accepted, t, 0), axis=0)
    tl.store(accepted_ptr, accepted.to(tl.int64))
    tl.store(next_ptr, nxt)
    tl.store(result_ptr + i, d, mask=i < K)
    tl.store(result_ptr + K, accepted.to(tl.int64))
    tl.store(result_ptr + K + 1, nxt)


@triton.jit(do_not_specialize=["n"])  # one compiled kernel for every position
def next_inputs_kernel(drafts_ptr, accepted_ptr, next_ptr, hidden_ptr, n, ids_ptr, pos_ptr, pick_ptr, hin_ptr,
                       vids_ptr, vpos_ptr, K: tl.constexpr, H: tl.constexpr, KP: tl.constexpr, PP: tl.constexpr,
                       FILL: tl.constexpr, BLOCK: tl.constexpr):
    """Program j copies catch-up slot j's hidden state (FILL: the accepted slot's past it); program 0 also
    writes the chain's ids, positions and pick, and the verify's positions and first id."""
    j = tl.program_id(0)
    a = tl.load(accepted_ptr)
    nxt = tl.load(next_ptr)
    if FILL:
        src = tl.minimum(j, a)
    else:
        src = j
    for h0 in tl.static_range(0, H, BLOCK):
        o = h0 + tl.arange(0, BLOCK)
        m = o < H
        tl.store(hin_ptr + j * H + o, tl.load(hidden_ptr + src * H + o, mask=m), mask=m)
    if j == 0:
        i = tl.arange(0, KP)
        d = tl.load(drafts_ptr + i, mask=i < K, other=0)
        if FILL:
            ids = tl.where(i < a, d, nxt)
        else:
            ids = tl.where((i == a) | (i >= K), nxt, d)
        tl.store(ids_ptr + i, ids, mask=i < K + 1)
        tl.store(vpos_ptr + i, n + a + 1 + i, mask=i < K + 1)
        p = tl.arange(0, PP)
        tl.store(pos_ptr + p, tl.where(p <= K, n + p, n + a + 1 + p - K), mask=p < 2 * K)
        tl.store(pick_ptr, a)
        tl.store(vids_ptr, nxt)


def accept_greedy(drafts: torch.Tensor, target: torch.Tensor, accepted: torch.Tensor, nxt: torch.Tensor,
                  result: torch.Tensor) -> None:
    """drafts [k], target [k+1] (int64) → accepted [1], nxt [1], result [k+2] (int64, on the device)."""
    k = drafts.shape[0]
    accept_greedy_kernel[(1,)](drafts, target, accepted, nxt, result, K=k, KP=triton.next_power_of_2(k + 1),
                               num_warps=1)


def next_inputs(drafts: torch.Tensor, accepted: torch.Tensor, nxt: torch.Tensor, hidden: torch.Tensor, n: int,
                ids: torch.Tensor, pos: torch.Tensor, pick: torch.Tensor, hidden_in: torch.Tensor,
                verify_ids: torch.Tensor, verify_pos: torch.Tensor, fill: bool) -> None:
    """The pipelined cycle's inputs from the cycle before's results (engine/pipeline.py, next_inputs_ops)."""
    k, H = drafts.shape[0], hidden.shape[1]
    assert hidden.is_contiguous() and hidden_in.is_contiguous() and pos.shape[0] == 2 * k
    next_inputs_kernel[(k + 1,)](drafts, accepted, nxt, hidden, n, ids, pos, pick, hidden_in, verify_ids,
                                 verify_pos, K=k, H=H, KP=triton.next_power_of_2(k + 1),
                                 PP=triton.next_power_of_2(2 * k), FILL=fill, BLOCK=HIDDEN_BLOCK)

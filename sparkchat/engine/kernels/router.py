"""Group-limited top-k routing in one Triton program per token (the twin is nn.moe.route).

The router logits come from one split-K GEMV (`plain_gemv_partials`, fp32 sums of the bf16 input);
this kernel adds its partials in a fixed order and does everything after — sigmoid, expert bias, each
group's top-2 sum, the top groups, the top-k experts inside them, renormalization and scaling — in
registers: two launches per MoE layer where the torch path takes a dozen (two sorts among them).
Latency-bound (one warp, serial picks): each pick is an int32 max of order-preserving score bits and an
int32 min of the index holding it (one warp instruction each, REDUX), not an fp32 argmax (shuffles);
the weights are the picked experts' scores recomputed from their reloaded logits after the picks.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.fp8_gemv import GemvConfig, plain_gemv_partials
from sparkchat.engine.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def _top2(a1, a2, b1, b2):
    """Merge two (largest, second largest) pairs: the two largest of both, a repeated maximum kept twice."""
    return tl.maximum(a1, b1), tl.maximum(tl.minimum(a1, b1), tl.maximum(a2, b2))


@triton.jit
def _ordered(x):
    """fp32 -> int32 in the same order (no NaNs; -0.0 == +0.0 as in fp32), so that selections reduce
    int32s: a warp's int32 max/min is one REDUX instruction where an fp32 one is five shuffle steps."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, -(b & 0x7FFFFFFF))


@triton.jit
def route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, scaling,
                 E: tl.constexpr, G: tl.constexpr, TG: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                 RENORM: tl.constexpr, T: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False):
    t = tl.program_id(0)
    pdl_wait(PDL)
    GS: tl.constexpr = E // G
    ar = tl.arange(0, E)
    logit = tl.load(logits_ptr + t * E + ar)
    for p in tl.static_range(1, SPLIT):  # the GEMV's split-K partial sums, added in a fixed order
        logit += tl.load(logits_ptr + (p * T + t) * E + ar)
    c = tl.sigmoid(logit) + tl.load(bias_ptr + ar)
    c2 = tl.reshape(c, (G, GS))
    # each group's two best in one reduction of (best, second) pairs: no argmax and no second pass
    best, second = tl.reduce((c2, tl.full(c2.shape, float("-inf"), tl.float32)), 1, _top2)
    # every selection below is a max of ordered int32 scores, then the lowest index holding it
    # (tl.argmax's and the twin's tie rule); chosen and excluded entries drop to INT32_MIN, below any score
    gr = tl.arange(0, G)
    gs = _ordered(best + second)  # [G]
    keep = gr < 0
    for _ in tl.static_range(TG):
        gi = tl.min(tl.where(gs == tl.max(gs, axis=0), gr, G), axis=0)
        keep = keep | (gr == gi)
        gs = tl.where(gr == gi, -(2 ** 31), gs)
    cand = tl.reshape(tl.where(keep[:, None], _ordered(c2), -(2 ** 31)), (E,))
    kr = tl.arange(0, KP)
    ids = tl.zeros((KP,), dtype=tl.int32)
    for k in tl.static_range(K):
        i = tl.min(tl.where(cand == tl.max(cand, axis=0), ar, E), axis=0)
        ids = tl.where(kr == k, i, ids)
        cand = tl.where(ar == i, -(2 ** 31), cand)
    # the weights: the chosen experts' logits reloaded (cache hits) and summed in the same order as above,
    # so bit-identical to their scores, instead of one more reduction (a masked sum) per pick
    kmask = kr < K
    li = tl.load(logits_ptr + t * E + ids, mask=kmask, other=0.0)
    for p in tl.static_range(1, SPLIT):
        li += tl.load(logits_ptr + (p * T + t) * E + ids, mask=kmask, other=0.0)
    ws = tl.where(kmask, tl.sigmoid(li), 0.0)
    if RENORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    tl.store(ids_ptr + t * K + kr, ids.to(tl.int64), mask=kmask)
    tl.store(w_ptr + t * K + kr, ws * scaling, mask=kmask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


ROUTE_WARPS = 1  # one warp: each selection's reductions are a REDUX each, no shared-memory round trip


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, top_groups: int, top_k: int,
          scaling: float, renormalize: bool, *, num_warps: int | None = None,
          gemv: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and results as nn.moe.route: (ids [T, k] int64, weights [T, k] fp32)."""
    T, E = x.shape[0], weight.shape[0]
    assert E % groups == 0 and (E & (E - 1)) == 0 and (groups & (groups - 1)) == 0, "power-of-two E and groups"
    assert weight.dtype in (torch.float32, torch.bfloat16) and bias.dtype == torch.float32 and bias.shape == (E,)
    if T <= 8 and x.dtype == torch.bfloat16 and (x.is_cuda or _interpreting()):
        logits = plain_gemv_partials(x.contiguous(), weight, gemv)  # [S, T, E]: summed below, in order
    else:
        logits = (x.float() @ weight.float().T).contiguous()[None]
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    route_kernel[(T,)](logits, bias, ids, w, float(scaling), E=E, G=groups, TG=top_groups, K=top_k,
                       KP=triton.next_power_of_2(top_k), RENORM=renormalize, T=T, SPLIT=logits.shape[0],
                       num_warps=num_warps or ROUTE_WARPS, **pdl_args(x.device))
    return ids, w

"""Group-limited top-k routing in one Triton program per token (the twin is nn.moe.route).

The router logits come from one split-K GEMV (`plain_gemv_partials`, fp32 sums of the bf16 input);
this kernel adds its partials in a fixed order and does everything after — sigmoid, expert bias, each
group's top-2 sum, the top groups, the top-k experts inside them, renormalization and scaling — in
registers: two launches per MoE layer where the torch path takes a dozen (two sorts among them).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.fp8_gemv import GemvConfig, plain_gemv_partials
from sparkchat.engine.kernels.pdl import pdl_args, pdl_wait


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
    s = tl.sigmoid(logit)
    c = s + tl.load(bias_ptr + ar)
    c2 = tl.reshape(c, (G, GS))
    cols = tl.arange(0, GS)[None, :]
    best = tl.max(c2, axis=1)
    first = tl.argmax(c2, axis=1)
    second = tl.max(tl.where(cols == first[:, None], float("-inf"), c2), axis=1)
    group_score = best + second  # [G]
    gr = tl.arange(0, G)
    keep = gr < 0
    for _ in tl.static_range(TG):
        gi = tl.argmax(group_score, axis=0)
        keep = keep | (gr == gi)
        group_score = tl.where(gr == gi, float("-inf"), group_score)
    cand = tl.reshape(tl.where(keep[:, None], c2, float("-inf")), (E,))
    kr = tl.arange(0, KP)
    ids = tl.zeros((KP,), dtype=tl.int64)
    ws = tl.zeros((KP,), dtype=tl.float32)
    for k in tl.static_range(K):
        i = tl.argmax(cand, axis=0)
        ids = tl.where(kr == k, i.to(tl.int64), ids)
        ws = tl.where(kr == k, tl.sum(tl.where(ar == i, s, 0.0), axis=0), ws)
        cand = tl.where(ar == i, float("-inf"), cand)
    if RENORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    tl.store(ids_ptr + t * K + kr, ids, mask=kr < K)
    tl.store(w_ptr + t * K + kr, ws * scaling, mask=kr < K)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


ROUTE_WARPS = 1  # one warp: every argmax of the top-k loop is a few shuffles, no shared-memory round trip


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

"""Group-limited top-k routing in one Triton program per token (the twin is nn.moe.route).

The router logits come from one split-K GEMV (`plain_gemv_partials`, fp32 sums of the bf16 input);
this kernel adds its partials in a fixed order and does everything after — sigmoid, expert bias, each
group's top-2 sum, the top groups, the top-k experts inside them, renormalization and scaling — in
registers (kernels/top_k.py): two launches per MoE layer where the torch path takes a dozen (two sorts
among them), or one where the GEMV's last program does the top-k (SPARKCHAT_ROUTE_IN_GEMV).
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.device import interpreting
from sparkchat.engine.kernels.fp8_gemv import (GemvConfig, gemv_config, plain_gemv_partials, router_scores, router_top_k,
                                               take_split_norm)
from sparkchat.engine.kernels.pdl import pdl_args, pdl_wait
from sparkchat.engine.kernels.top_k import route_token


@triton.jit
def route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, scaling,
                 E: tl.constexpr, G: tl.constexpr, TG: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                 RENORM: tl.constexpr, T: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False,
                 SCORED: tl.constexpr = False):
    """Token program_id(0)'s experts and weights (top_k.route_token)."""
    pdl_wait(PDL)
    route_token(logits_ptr, bias_ptr, ids_ptr, w_ptr, scaling, tl.program_id(0), E, G, TG, K, KP, RENORM, T, SPLIT,
                SCORED, False)


ROUTE_WARPS = 1  # one warp: each selection's reductions are a REDUX each, no shared-memory round trip


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, top_groups: int, top_k: int,
          scaling: float, renormalize: bool, *, num_warps: int | None = None,
          gemv: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and results as nn.moe.route: (ids [T, k] int64, weights [T, k] fp32)."""
    T, E = x.shape[0], weight.shape[0]
    assert E % groups == 0 and (E & (E - 1)) == 0 and (groups & (groups - 1)) == 0, "power-of-two E and groups"
    assert weight.dtype in (torch.float32, torch.bfloat16) and bias.dtype == torch.float32 and bias.shape == (E,)
    scored = False
    # x may be an RMSNorm's output still unwritten, which this GEMV writes as it finishes the norm
    split = take_split_norm(x)
    x = x.contiguous()
    if T <= 8 and x.dtype == torch.bfloat16 and (x.is_cuda or interpreting()):
        in_gemv = route_in_gemv_config(T, gemv, weight.shape)
        if in_gemv is not None:  # one launch: the GEMV's last program does the top-k
            return router_top_k(x, weight, bias, groups, top_groups, top_k, scaling, renormalize, in_gemv,
                                split_norm=split)
        scored = router_scores_enabled()
        if scored:  # [2, T, E]: the GEMV's last programs made the scores
            logits = router_scores(x, weight, bias, gemv, split_norm=split)
        else:  # [S, T, E]: summed below, in order
            logits = plain_gemv_partials(x, weight, gemv, split_norm=split)
    else:
        if split is not None:
            split.finish(x)
        logits = (x.float() @ weight.float().T).contiguous()[None]
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    route_kernel[(T,)](logits, bias, ids, w, float(scaling), E=E, G=groups, TG=top_groups, K=top_k,
                       KP=triton.next_power_of_2(top_k), RENORM=renormalize, T=T, SPLIT=logits.shape[0],
                       SCORED=scored, num_warps=num_warps or ROUTE_WARPS,
                       **pdl_args(x.device))
    return ids, w


def router_scores_enabled() -> bool:
    """SPARKCHAT_ROUTER_SCORES=1: the router logits' GEMV also sums its split-K partials and makes the
    scores in its last programs (fp8_gemv.router_scores), taking that work off the top-k's single warp
    (sm_90 SASS: 1648 instructions a token -> see docs/benchmarks.md session 22). Opt-in: on the H200
    (session 23) the router alone 5.46 -> 5.17 us at one token, 5.38 -> 6.96 at four, the graphed step
    unchanged."""
    return os.environ.get("SPARKCHAT_ROUTER_SCORES", "0") == "1"


def route_in_gemv_config(T: int, gemv: GemvConfig | None, shape: tuple[int, int]) -> GemvConfig | None:
    """SPARKCHAT_ROUTE_IN_GEMV (one token): the logits GEMV's config where its last program does the top-k
    (fp8_gemv.router_top_k), else None (the top-k kernel). 1: the GEMV's own config; 2: the same in
    one-warp programs, as the top-k kernel runs, whose selections are then single warp reductions.
    Opt-in until timed: it saves the top-k's launch and its wait for the GEMV, but the top-k then runs
    after a counter's atomic, reading the partials from L2."""
    mode = os.environ.get("SPARKCHAT_ROUTE_IN_GEMV", "0")
    if T != 1 or mode not in ("1", "2"):
        return None
    cfg = gemv or gemv_config("plain", T, *shape)
    return cfg if mode == "1" else replace(cfg, warps=ROUTE_WARPS)

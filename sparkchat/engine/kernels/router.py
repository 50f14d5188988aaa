"""Group-limited top-k routing in one Triton program per token (the twin is nn.moe.route).

The router logits come from one split-K GEMV (`plain_gemv_partials`, fp32 sums of the bf16 input);
this kernel adds its partials in a fixed order and does everything after — sigmoid, expert bias, each
group's top-2 sum, the top groups, the top-k experts inside them, renormalization and scaling — in
registers: two launches per MoE layer where the torch path takes a dozen (two sorts among them).
Latency-bound (one warp, one token: a chain of dependent steps), so each step is shaped for a short chain:
- the top groups in one step: a group is kept when fewer than TG groups beat it (all pairs compared
  at once), not TG dependent picks;
- each expert pick is an int32 max of order-preserving score bits and an int32 min of the index
  holding it (one warp instruction each, REDUX, not an fp32 argmax's shuffles), over per-lane bests:
  every lane keeps the best of its own 16 candidates and the index holding it, so a pick reduces 32
  lane bests and only then refreshes them (the winner's lane changed), the index search of that
  refresh off the next pick's chain;
- the weights are the picked experts' scores recomputed from their reloaded logits after the picks
  (L1 hits): carrying each pick's score (a third reduction per pick) or reloading it per pick came out
  longer in the SASS (more instructions, ptxas serializing the picks' compares).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.device import interpreting
from sparkchat.engine.kernels.fp8_gemv import GemvConfig, plain_gemv_partials, router_scores, take_split_norm
from sparkchat.engine.kernels.pdl import pdl_args, pdl_trigger, pdl_wait


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
                 RENORM: tl.constexpr, T: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False,
                 SCORED: tl.constexpr = False, LATE_TRIGGER: tl.constexpr = False):
    """SCORED: logits_ptr holds the scores already (fp8_gemv.router_scores: [2, T, E], sigmoid and
    sigmoid + bias); else SPLIT partial logits [SPLIT, T, E] to add in order (bias_ptr: the bias).
    LATE_TRIGGER: the routed experts' stage 1 may start only once the ids are stored (route_late_trigger)."""
    t = tl.program_id(0)
    pdl_wait(PDL, LATE_TRIGGER)
    GS: tl.constexpr = E // G
    # [E] as [R, L, V]: V consecutive experts per lane (the loads' 16-byte vectors), L lanes, R repeats,
    # so that axes 0 and 2 are inside a thread: a lane's candidates reduce without data movement
    V: tl.constexpr = 4 if E >= 128 else (E // 32 if E >= 32 else 1)
    L: tl.constexpr = E // V if E // V < 32 else 32
    R: tl.constexpr = E // (L * V)
    ar = tl.arange(0, E)
    if SCORED:
        c = tl.load(logits_ptr + (T + t) * E + ar)
    else:
        logit = tl.load(logits_ptr + t * E + ar)
        for p in tl.static_range(1, SPLIT):  # the GEMV's split-K partial sums, added in a fixed order
            logit += tl.load(logits_ptr + (p * T + t) * E + ar)
        c = tl.sigmoid(logit) + tl.load(bias_ptr + ar)
    c2 = tl.reshape(c, (G, GS))
    # each group's two best in one reduction of (best, second) pairs: no argmax and no second pass
    best, second = tl.reduce((c2, tl.full(c2.shape, float("-inf"), tl.float32)), 1, _top2)
    # the top groups at once: g is kept when fewer than TG groups beat it (a higher score, or an equal
    # one at a lower index: tl.argmax's and the twin's tie rule), all G x G pairs compared in parallel
    gr = tl.arange(0, G)
    gs = _ordered(best + second)  # [G]
    beats = (gs[None, :] > gs[:, None]) | ((gs[None, :] == gs[:, None]) & (gr[None, :] < gr[:, None]))
    keep = tl.sum(beats.to(tl.int32), axis=1) < TG
    # chosen and excluded entries drop to INT32_MIN, below any score
    cand = tl.reshape(tl.where(keep[:, None], _ordered(c2), -(2 ** 31)), (R, L, V))
    idx = tl.reshape(ar, (R, L, V))
    # each lane's best candidate and the lowest index holding it; a pick is the max of the lane bests,
    # then the lowest index among the lanes holding that max (= the lowest index holding it overall)
    lb = tl.max(tl.max(cand, axis=2), axis=0)  # [L]
    lbi = tl.min(tl.min(tl.where(cand == lb[None, :, None], idx, E), axis=2), axis=0)
    kr = tl.arange(0, KP)
    ids = tl.zeros((KP,), dtype=tl.int32)
    for k in tl.static_range(K):
        m = tl.max(lb, axis=0)
        i = tl.min(tl.where(lb == m, lbi, E), axis=0)
        # lane k takes i, the others keep theirs (i - E * |kr - k| < 0 <= ids): arithmetic, where a
        # where(kr == k) per pick leaves ptxas K live predicates and serializes the picks' compares
        ids = tl.maximum(ids, i - E * tl.abs(kr - k))
        cand = tl.where(idx == i, -(2 ** 31), cand)
        # only the winner's lane changed; its new best feeds the next max, the index search (off that
        # chain) the next min
        lb = tl.max(tl.max(cand, axis=2), axis=0)
        lbi = tl.min(tl.min(tl.where(cand == lb[None, :, None], idx, E), axis=2), axis=0)
    # the weights: the chosen experts' logits reloaded (cache hits) and summed in the same order as above,
    # so bit-identical to their scores, instead of one more reduction (a masked sum) per pick
    kmask = kr < K
    if SCORED:
        ws = tl.load(logits_ptr + t * E + ids, mask=kmask, other=0.0)
    else:
        li = tl.load(logits_ptr + t * E + ids, mask=kmask, other=0.0)
        for p in tl.static_range(1, SPLIT):
            li += tl.load(logits_ptr + (p * T + t) * E + ids, mask=kmask, other=0.0)
        ws = tl.where(kmask, tl.sigmoid(li), 0.0)
    if RENORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    tl.store(ids_ptr + t * K + kr, ids.to(tl.int64), mask=kmask)
    tl.store(w_ptr + t * K + kr, ws * scaling, mask=kmask)
    if LATE_TRIGGER:
        pdl_trigger(PDL)



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
                       SCORED=scored, LATE_TRIGGER=route_late_trigger(T), num_warps=num_warps or ROUTE_WARPS,
                       **pdl_args(x.device))
    return ids, w


def route_late_trigger(T: int) -> bool:
    """SPARKCHAT_ROUTE_LATE_TRIGGER=1: the top-k lets the routed experts' stage 1 launch only after it
    has stored the ids, not as soon as it starts. Stage 1's programs cannot load a weight before the ids
    anyway, but resident early (about one GPU's worth at one token) they hold the SMs that the side
    stream's shared-expert down GEMV, ready about then, needs: it runs only as stage 1 ends, and stage 2,
    joined to it, starts late (session 23's timeline). Not where stage 1 runs the shared expert itself
    (SPARKCHAT_MOE_SHARED=2, one token): its shared programs do their work during the top-k. Opt-in
    until timed."""
    if os.environ.get("SPARKCHAT_MOE_SHARED", "0") == "2" and T == 1:
        return False
    return os.environ.get("SPARKCHAT_ROUTE_LATE_TRIGGER", "0") == "1"


def router_scores_enabled() -> bool:
    """SPARKCHAT_ROUTER_SCORES=1: the router logits' GEMV also sums its split-K partials and makes the
    scores in its last programs (fp8_gemv.router_scores), taking that work off the top-k's single warp
    (sm_90 SASS: 1648 instructions a token -> see docs/benchmarks.md session 22). Opt-in: on the H200
    (session 23) the router alone 5.46 -> 5.17 us at one token, 5.38 -> 6.96 at four, the graphed step
    unchanged."""
    return os.environ.get("SPARKCHAT_ROUTER_SCORES", "0") == "1"

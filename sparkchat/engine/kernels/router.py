"""Group-limited top-k routing in one Triton program per token (the twin is nn.moe.route).

The router logits come from one split-K GEMV (`plain_gemv_partials`, fp32 sums of the bf16 input);
this kernel adds its partials in a fixed order and does everything after — sigmoid, expert bias, each
group's top-2 sum, the top groups, the top-k experts inside them, renormalization and scaling — in
registers: two launches per MoE layer where the torch path takes a dozen (two sorts among them). A
single token (the decode step) takes one launch, `route_fused_kernel`: the logits' split-K GEMV whose
last program to finish does the same top-k — one kernel fewer in each MoE layer's dependent chain.
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

from sparkchat.engine.kernels.counters import arrival_counters
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
    pdl_wait(PDL)
    _route_token(logits_ptr, bias_ptr, ids_ptr, w_ptr, scaling, tl.program_id(0), E, G, TG, K, KP, RENORM, T,
                 SPLIT, "")


@triton.jit
def _logits(logits_ptr, offs, t, E: tl.constexpr, T: tl.constexpr, SPLIT: tl.constexpr, mask,
            CACHE: tl.constexpr):
    """Token t's logits at `offs`: the GEMV's split-K partial sums, added in a fixed order."""
    v = tl.load(logits_ptr + t * E + offs, mask=mask, other=0.0, cache_modifier=CACHE)
    for p in tl.static_range(1, SPLIT):
        v += tl.load(logits_ptr + (p * T + t) * E + offs, mask=mask, other=0.0, cache_modifier=CACHE)
    return v


@triton.jit
def _route_token(logits_ptr, bias_ptr, ids_ptr, w_ptr, scaling, t, E: tl.constexpr, G: tl.constexpr,
                 TG: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr, T: tl.constexpr,
                 SPLIT: tl.constexpr, CACHE: tl.constexpr):
    """Token t's top-k ids and weights from its logit partials (CACHE: their loads' cache modifier;
    ".cg" where other programs of the same launch wrote them)."""
    GS: tl.constexpr = E // G
    # [E] as [R, L, V]: V consecutive experts per lane (the loads' 16-byte vectors), L lanes, R repeats,
    # so that axes 0 and 2 are inside a thread: a lane's candidates reduce without data movement
    V: tl.constexpr = 4 if E >= 128 else (E // 32 if E >= 32 else 1)
    L: tl.constexpr = E // V if E // V < 32 else 32
    R: tl.constexpr = E // (L * V)
    ar = tl.arange(0, E)
    logit = _logits(logits_ptr, ar, t, E, T, SPLIT, ar < E, CACHE)
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
    li = _logits(logits_ptr, ids, t, E, T, SPLIT, kmask, CACHE)
    ws = tl.where(kmask, tl.sigmoid(li), 0.0)
    if RENORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    tl.store(ids_ptr + t * K + kr, ids.to(tl.int64), mask=kmask)
    tl.store(w_ptr + t * K + kr, ws * scaling, mask=kmask)


@triton.jit
def route_fused_kernel(x_ptr, wt_ptr, part_ptr, cnt_ptr, bias_ptr, ids_ptr, w_ptr, scaling,
                       H: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       E: tl.constexpr, G: tl.constexpr, TG: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                       RENORM: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False):
    """One token's routing in one launch. Program (n, s) computes the logits of experts [n*BN, +BN) over
    columns [s*H/SPLIT, +H/SPLIT) — its whole share of the router weight loaded before the PDL wait, so
    the 2.6 MB stream while the add+norm before it runs — and writes them as split-K partials; the last
    program to finish (arrival counter, reset by it) adds them up and does route_kernel's top-k."""
    n = tl.program_id(0)
    sp = tl.program_id(1)
    KS: tl.constexpr = H // SPLIT
    rows = n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    ws = ()
    for i in tl.static_range(KS // BK):
        ws = ws + (tl.load(wt_ptr + rows[:, None] * H + (sp * KS + i * BK + kk)[None, :]),)
    pdl_wait(PDL)
    acc = tl.zeros([BN], dtype=tl.float32)
    for i in tl.static_range(KS // BK):
        xv = tl.load(x_ptr + sp * KS + i * BK + kk).to(tl.float32)
        acc += tl.sum(ws[i].to(tl.float32) * xv[None, :], axis=1)
    tl.store(part_ptr + sp * E + rows, acc)
    # the last program of the launch routes (stores above -> barrier -> release; acquire -> loads)
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if done == (E // BN) * SPLIT - 1:
        tl.debug_barrier()
        _route_token(part_ptr, bias_ptr, ids_ptr, w_ptr, scaling, 0, E, G, TG, K, KP, RENORM, 1, SPLIT, ".cg")
        tl.store(cnt_ptr, 0)  # ready for the next launch


def _fused_shape(E: int, H: int) -> tuple[int, int, int] | None:
    """(BN, BK, SPLIT) of route_fused_kernel for E experts over H columns: 16 experts a program, k steps
    of up to 128 columns, the most splits up to 10 (the Ling shape: 32 x 10 programs of 16 x 256); None
    when H has no power-of-two step of at least 16 columns."""
    bk = 128
    while bk >= 16 and H % bk:
        bk //= 2
    if bk < 16:
        return None
    steps = H // bk
    split = max(s for s in range(1, 11) if steps % s == 0)
    return min(16, E), bk, split


def route_fused_enabled() -> bool:
    """The one-launch routing for single tokens (SPARKCHAT_ROUTE_FUSED=0: the GEMV, then route_kernel)."""
    return os.environ.get("SPARKCHAT_ROUTE_FUSED", "1") != "0"


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
    shape = _fused_shape(E, x.shape[1])
    if (T == 1 and x.dtype == torch.bfloat16 and (x.is_cuda or _interpreting()) and shape is not None
            and gemv is None and route_fused_enabled()):
        bn, bk, split = shape
        part = torch.empty(split, E, dtype=torch.float32, device=x.device)
        ids = torch.empty(1, top_k, dtype=torch.int64, device=x.device)
        w = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
        route_fused_kernel[(E // bn, split)](
            x.contiguous(), weight.contiguous(), part, arrival_counters("route", x.device, 1), bias, ids, w,
            float(scaling), H=x.shape[1], BN=bn, BK=bk, E=E, G=groups, TG=top_groups, K=top_k,
            KP=triton.next_power_of_2(top_k), RENORM=renormalize, SPLIT=split, num_warps=num_warps or ROUTE_WARPS,
            **pdl_args(x.device))
        return ids, w
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

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
With `l2_prefetch` (fastpath.l2_prefetch_bytes: 8 MB on sm_90 by default) the launch also has one-warp
programs ask L2 for the last bytes of the next layer's first weight, paced, while HBM idles behind the
router's chain: the H100's graphed step 2.44 -> 2.42 ms (docs/benchmarks.md session 34). On sm_90 the
logits GEMV also asks L2 for its own later k steps before its wait (ROUTER_L2_AHEAD), with the prefetch's
rounds shortened to end with the top-k: 2.405 -> 2.376 ms (session 37).
Handing part of this work, or all of it, to the GEMV's last programs (an arrival counter, the partials
read back from L2) cut the kernel's instructions but not the step: the H200's graphed step 2.081 ->
2.108 ms with the scores made there, 2.082 -> 2.096-2.103 with the whole top-k there (docs/benchmarks.md
session 28), which also left the shared expert's stage-1 programs reading the norm's output before
the GEMV writing it had finished (mxfp4_moe._shared_gate_up: two kernels back at least).
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.device import interpreting, is_sm90
from sparkchat.engine.kernels.fp8_gemv import (GemvConfig, gemv_config, gemv_config_overrides, plain_gemv_partials,
                                               take_split_norm)
from sparkchat.engine.kernels.l2_prefetch import ask_l2
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
def _clock():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _prefetch_l2(ptr, first, n_lines, LINES: tl.constexpr, PACE: tl.constexpr = 0):
    """Ask L2 for LINES 128-byte lines of ptr from line `first` (the last of n_lines repeated past the end),
    kept ahead of ordinary lines (evict_last). Nothing comes back to the SM. PACE > 0: a line a lane at a
    time, PACE clock cycles apart, so that the memory system never holds many of them at once (a burst
    of them delays every load queued behind it); else all at once, and the program ends. (Waiting 800 or
    1600 cycles before the first round, so that the router GEMV's last loads go first, gained nothing.)"""
    if PACE > 0:
        t0 = _clock()
        for r in tl.static_range(LINES // 32):
            line = first + r * 32 + tl.arange(0, 32)
            ask_l2(ptr + tl.minimum(line, n_lines - 1).to(tl.int64) * 128)
            t = _clock()
            while t - t0 < (r + 1) * PACE:
                t = _clock()
    else:
        line = first + tl.arange(0, LINES)
        ask_l2(ptr + tl.minimum(line, n_lines - 1).to(tl.int64) * 128)


@triton.jit
def route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, scaling,
                 E: tl.constexpr, G: tl.constexpr, TG: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                 RENORM: tl.constexpr, T: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False,
                 pf_ptr=None, pf_lines=0, PF_LINES: tl.constexpr = 0, PF_PACE: tl.constexpr = 0):
    """Token program_id(0)'s experts and weights from the router GEMV's SPLIT partial logits [SPLIT, T, E],
    added in order (bias_ptr: the expert bias). PF_LINES > 0: the programs after the T tokens' each ask
    L2 for PF_LINES lines of pf_ptr (pf_lines in all) and end without waiting (route's `l2_prefetch`)."""
    t = tl.program_id(0)
    if PF_LINES > 0:
        if t >= T:  # no wait: it touches nothing (after the wait, the top-k's loads queued behind it)
            _prefetch_l2(pf_ptr, (t - T) * PF_LINES, pf_lines, PF_LINES, PF_PACE)
        else:
            _route_program(logits_ptr, bias_ptr, ids_ptr, w_ptr, scaling, t, E, G, TG, K, KP, RENORM, T, SPLIT,
                           PDL)
    else:
        _route_program(logits_ptr, bias_ptr, ids_ptr, w_ptr, scaling, t, E, G, TG, K, KP, RENORM, T, SPLIT, PDL)


@triton.jit
def _route_program(logits_ptr, bias_ptr, ids_ptr, w_ptr, scaling, t, E: tl.constexpr, G: tl.constexpr,
                   TG: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr, T: tl.constexpr,
                   SPLIT: tl.constexpr, PDL: tl.constexpr):
    """route_kernel's work for token t."""
    pdl_wait(PDL)
    GS: tl.constexpr = E // G
    # [E] as [R, L, V]: V consecutive experts per lane (the loads' 16-byte vectors), L lanes, R repeats,
    # so that axes 0 and 2 are inside a thread: a lane's candidates reduce without data movement
    V: tl.constexpr = 4 if E >= 128 else (E // 32 if E >= 32 else 1)
    L: tl.constexpr = E // V if E // V < 32 else 32
    R: tl.constexpr = E // (L * V)
    ar = tl.arange(0, E)
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
    li = tl.load(logits_ptr + t * E + ids, mask=kmask, other=0.0)
    for p in tl.static_range(1, SPLIT):
        li += tl.load(logits_ptr + (p * T + t) * E + ids, mask=kmask, other=0.0)
    ws = tl.where(kmask, tl.sigmoid(li), 0.0)
    if RENORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    tl.store(ids_ptr + t * K + kr, ids.to(tl.int64), mask=kmask)
    tl.store(w_ptr + t * K + kr, ws * scaling, mask=kmask)


ROUTE_WARPS = 1  # one warp: each selection's reductions are a REDUX each, no shared-memory round trip
PREFETCH_LINES = 256  # 128-byte lines a prefetching program asks for (32 KB; 8 a lane of its one warp)
# clock cycles between a prefetching program's rounds of 32 lines (SPARKCHAT_L2_PREFETCH_PACE; 0: all at
# once): 8 MB in 8 rounds of ~1 MB, done in ~2.6 µs, before the MoE's stage 1 streams; all at once, the
# router's and top-k's loads queued behind them. The launch ends with its last prefetching program, so
# the rounds must end by the time the top-k does: 800 was best of 500-1200 on the H100 (docs/benchmarks.md
# session 34) until the router's GEMV asked L2 ahead (ROUTER_L2_AHEAD); since then 650, the H100's graphed
# step 2.397 -> 2.376 ms (session 37)
PREFETCH_PACE = 650
# sm_90, one token: the router logits GEMV asks L2 for all its later k steps before its PDL wait
# (GemvConfig.l2_ahead), while HBM idles behind the output projection's chain: 5.00 -> 3.46 µs exposed a
# layer on the H100 (docs/benchmarks.md session 37). SPARKCHAT_GEMV_CONFIG=plain.1.512.2560.l2_ahead:0 off.
ROUTER_L2_AHEAD = 3


def _logits_config(device: torch.device, T: int, E: int, K: int) -> GemvConfig:
    """The router logits GEMV's config: the tuned one, asking L2 ahead (ROUTER_L2_AHEAD) at one token on
    sm_90 unless SPARKCHAT_GEMV_CONFIG sets the shape's l2_ahead."""
    cfg = gemv_config("plain", T, E, K)
    if T == 1 and is_sm90(device) and "l2_ahead" not in gemv_config_overrides("plain", T, E, K):
        cfg = replace(cfg, l2_ahead=ROUTER_L2_AHEAD)
    return cfg


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else default


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, top_groups: int, top_k: int,
          scaling: float, renormalize: bool, *, num_warps: int | None = None,
          gemv: GemvConfig | None = None, l2_prefetch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and results as nn.moe.route: (ids [T, k] int64, weights [T, k] fp32).
    l2_prefetch (contiguous, on the GPU): bytes a later kernel will read — the last rows of the next
    layer's input projection (fastpath._weight_ahead) — that the launch's extra programs ask L2 for while
    the router's GEMV and this top-k leave HBM idle (ignored under the interpreter, which has no L2)."""
    T, E = x.shape[0], weight.shape[0]
    assert E % groups == 0 and (E & (E - 1)) == 0 and (groups & (groups - 1)) == 0, "power-of-two E and groups"
    assert weight.dtype in (torch.float32, torch.bfloat16) and bias.dtype == torch.float32 and bias.shape == (E,)
    # x may be an RMSNorm's output still unwritten, which this GEMV writes as it finishes the norm
    split = take_split_norm(x)
    x = x.contiguous()
    if T <= 8 and x.dtype == torch.bfloat16 and (x.is_cuda or interpreting()):
        cfg = gemv or _logits_config(x.device, T, E, x.shape[1])
        logits = plain_gemv_partials(x, weight, cfg, split_norm=split)  # [S, T, E]: summed in order
    else:
        if split is not None:
            x = split.finish(x)
        logits = (x.float() @ weight.float().T).contiguous()[None]
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    pf, programs = {}, 0
    if l2_prefetch is not None and l2_prefetch.is_cuda and not interpreting() and l2_prefetch.numel():
        assert l2_prefetch.is_contiguous()
        lines = l2_prefetch.numel() * l2_prefetch.element_size() // 128
        programs = triton.cdiv(lines, PREFETCH_LINES)
        pf = dict(pf_ptr=l2_prefetch.view(torch.uint8), pf_lines=lines, PF_LINES=PREFETCH_LINES,
                  PF_PACE=_int_env("SPARKCHAT_L2_PREFETCH_PACE", PREFETCH_PACE))
    route_kernel[(T + programs,)](logits, bias, ids, w, float(scaling), E=E, G=groups, TG=top_groups, K=top_k,
                                  KP=triton.next_power_of_2(top_k), RENORM=renormalize, T=T,
                                  SPLIT=logits.shape[0], num_warps=num_warps or ROUTE_WARPS, **pf,
                                  **pdl_args(x.device))
    return ids, w


"""Group-limited top-k routing for one token in one Triton program (the twin is nn.moe.route): the
router's logits in, its experts and weights out. Called by the top-k kernel (kernels/router.py) and by
the router logits' GEMV when its last program does the top-k itself (fp8_gemv.router_top_k).

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

import triton
import triton.language as tl


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
def _load(ptrs, CG: tl.constexpr):
    """CG: read past L1, for values other programs of the same launch wrote."""
    if CG:
        return tl.load(ptrs, cache_modifier=".cg")
    return tl.load(ptrs)


@triton.jit
def _load_masked(ptrs, mask, CG: tl.constexpr):
    if CG:
        return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def route_token(logits_ptr, bias_ptr, ids_ptr, w_ptr, scaling, t,
                E: tl.constexpr, G: tl.constexpr, TG: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                RENORM: tl.constexpr, T: tl.constexpr, SPLIT: tl.constexpr, SCORED: tl.constexpr,
                CG: tl.constexpr):
    """Token t's experts and weights into ids [T, K] int64 and w [T, K] fp32. SCORED: logits_ptr holds
    the scores already (fp8_gemv.router_scores: [2, T, E], sigmoid and sigmoid + bias); else SPLIT partial
    logits [SPLIT, T, E] to add in order (bias_ptr: the bias). CG: those were written by the same launch
    (fp8_gemv.router_top_k), so read past L1."""
    GS: tl.constexpr = E // G
    # [E] as [R, L, V]: V consecutive experts per lane (the loads' 16-byte vectors), L lanes, R repeats,
    # so that axes 0 and 2 are inside a thread: a lane's candidates reduce without data movement
    V: tl.constexpr = 4 if E >= 128 else (E // 32 if E >= 32 else 1)
    L: tl.constexpr = E // V if E // V < 32 else 32
    R: tl.constexpr = E // (L * V)
    ar = tl.arange(0, E)
    if SCORED:
        c = _load(logits_ptr + (T + t) * E + ar, CG)
    else:
        logit = _load(logits_ptr + t * E + ar, CG)
        for p in tl.static_range(1, SPLIT):  # the GEMV's split-K partial sums, added in a fixed order
            logit += _load(logits_ptr + (p * T + t) * E + ar, CG)
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
        ws = _load_masked(logits_ptr + t * E + ids, kmask, CG)
    else:
        li = _load_masked(logits_ptr + t * E + ids, kmask, CG)
        for p in tl.static_range(1, SPLIT):
            li += _load_masked(logits_ptr + (p * T + t) * E + ids, kmask, CG)
        ws = tl.where(kmask, tl.sigmoid(li), 0.0)
    if RENORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    tl.store(ids_ptr + t * K + kr, ids.to(tl.int64), mask=kmask)
    tl.store(w_ptr + t * K + kr, ws * scaling, mask=kmask)

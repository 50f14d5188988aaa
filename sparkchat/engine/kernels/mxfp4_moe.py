"""MXFP4 routed-expert MoE for decode and the MTP verify window (T = 1..8 tokens).

Two launches, no host sync, no allocation beyond the output and a reusable workspace:
  stage 1  grid (slot, gate-row block): gate/up GEMV over one expert's MXFP4 rows, SwiGLU with clamp,
           times the routing weight -> act[t*K + k, :] (fp32).
  stage 2  grid (output-row block, slot): down GEMV of one expert -> part[t*K + k, rows] (fp32); the
           last program to finish a row block (atomic counter, reset by that program) sums the K
           slots of each token in slot order and writes y bf16 [T, H]. Deterministic, no fp32 atomics.

Decoding, all in registers: weights are read as int32 words of 8 E2M1 codes. Codes (j, j+4) of a word
become one int32 holding two bf16 bit patterns (sign << 15 | e1 e0 m << 6); each half shifted into the
top of an fp32 is the E2M1 value times 2^-126 (codes with e = 0 are fp32 subnormals: exact, and the
kernels never flush them). Activations are pre-multiplied by 2^100 so the products are normal floats;
the 2^(126-100) goes into the E8M0 scale, applied once per word. About 3 integer ops per weight.
PACKED (the default wherever a program serves one token): the pairs stay bf16x2 and are multiplied by
bf16x2 activations in one PTX block per word (_WORD_DOT_ASM), no fp32 unpacking.
PAIRED: the words were permuted at load (kernels/mxfp4_layout.py) so that three of the four code pairs
are one shift and one mask (_unpack8_paired, _WORD_DOT_PAIRED_ASM): same products, fewer instructions.

DEDUPE (T > 1): a slot whose expert already appears at an earlier slot does nothing; the first slot of
each distinct expert computes every token that chose it (skipping the others at run time), so each
expert's bytes stream once and are decoded once. Without DEDUPE (the measured-faster default for T > 1)
each slot computes its own token; the slots of one row block run side by side, so an expert shared by
several tokens is fetched from HBM once and re-read from L2.

Layout: weight words and their per-word scale bytes are loaded flat and reshaped to [rows, words] with
lanes along the words (one 128-byte line per warp load) and rows in registers, so each activation
value is loaded once per thread and reused across its rows. Configs: MoeConfig / moe_config; the
`prefetch` option software-pipelines the k loop by one step (each step's words are loaded a step ahead);
`preload1`/`preload2` (the one-token default) unroll it and load every step's words before multiplying.
`vec1`/`vec2` (the default wherever a program serves one token) run a stage as its own kernel in 16-byte
loads instead: a thread holds whole MX groups (4 consecutive words and their one scale byte), every load
issued before the multiplies.
Packed activations (the MoE input from the add+norm kernel, stage 1's act for stage 2) lie in four planes
(_store_packed), so that a warp's loads of one component over consecutive words read consecutive words.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.counters import arrival_counters
from sparkchat.engine.kernels.device import interpreting
from sparkchat.engine.kernels.norm_rows import _norm_rows
from sparkchat.engine.kernels.overrides import field_overrides, tail_at_once, weight_eviction
from sparkchat.engine.kernels.packed_acts import _HI16, _X_SCALE, _bf16_round, _store_packed
from sparkchat.engine.kernels.pdl import pdl_args, pdl_wait

_MAG2 = tl.constexpr(0x01C001C0)  # e1 e0 m of two bf16 halves (bits 8:6 of each)
_SIGN2 = tl.constexpr(-0x7FFF8000)  # 0x80008000 as int32: sign bit of each half
_PAIR2 = tl.constexpr(-0x7E3F7E40)  # 0x81C081C0 as int32: sign and e1 e0 m of two bf16 halves


@triton.jit
def _halves(p):
    """int32 with two bf16 bit patterns -> (low half, high half) as fp32 (exact, no conversion op)."""
    return (p << 16).to(tl.float32, bitcast=True), (p & _HI16).to(tl.float32, bitcast=True)


@triton.jit
def _unpack8(w):
    """int32 word of 8 E2M1 codes (code j at bits 4j..4j+3) -> codes 0..7 as fp32 (value * 2^-126)."""
    c0, c4 = _halves(((w << 6) & _MAG2) | ((w << 12) & _SIGN2))
    c1, c5 = _halves(((w << 2) & _MAG2) | ((w << 8) & _SIGN2))
    c2, c6 = _halves(((w >> 2) & _MAG2) | ((w << 4) & _SIGN2))
    c3, c7 = _halves(((w >> 6) & _MAG2) | (w & _SIGN2))
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _unpack8_paired(w):
    """_unpack8 for a word in paired order (kernels/mxfp4_layout.py): pairs 0-2 are one shift and one mask."""
    c0, c4 = _halves(w & _PAIR2)
    c1, c5 = _halves((w << 6) & _PAIR2)
    c2, c6 = _halves((w << 3) & _PAIR2)
    c3, c7 = _halves(((w >> 4) & 0x00C000C0) | ((w >> 5) & 0x01000100) | ((w << 1) & _SIGN2))
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _unpack(w, PAIRED: tl.constexpr):
    if PAIRED:
        return _unpack8_paired(w)
    else:
        return _unpack8(w)


@triton.jit
def _e8m0_scale(s):
    """E8M0 byte -> 2^(s - 127) * 2^(126 - 100) in fp32 (exact for s <= 228)."""
    return ((s.to(tl.int32) + 26) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _perm4(c):
    """Word c -> word c with each aligned group of 4 reversed after its first (0,3,2,1): a warp still
    reads whole 128-byte lines, but the compiler cannot prove contiguity, so it keeps one word per
    lane (no vectorization) for the weights and for their per-word scale bytes alike."""
    return (c // 4) * 4 + (c * 3) % 4


@triton.jit
def _word_tile(ptr, row_stride, k0, BN: tl.constexpr, BKW: tl.constexpr, SCALE: tl.constexpr, EVICT: tl.constexpr):
    """[BN, BKW] tile: weight words (SCALE=False) or each word's E8M0 byte (SCALE=True) of rows
    0..BN-1 from ptr, words k0 + _perm4(0..BKW-1). Loaded flat and reshaped, which pins the layout
    (lanes along the words, warps and registers along the rows) shared by both tiles and the
    activation columns."""
    i = tl.arange(0, BN * BKW)
    word = k0 + _perm4(i % BKW)
    if SCALE:
        v = tl.load(ptr + (i // BKW) * row_stride + word // 4, eviction_policy=EVICT)
    else:
        v = tl.load(ptr + (i // BKW) * row_stride + word, eviction_policy=EVICT)
    return tl.reshape(v, [BN, BKW])


@triton.jit
def _dot8(c, x0, x1, x2, x3, x4, x5, x6, x7):
    c0, c1, c2, c3, c4, c5, c6, c7 = c
    return c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3 + c4 * x4 + c5 * x5 + c6 * x6 + c7 * x7


# PACKED: one word (8 codes) times its 8 activations in bf16x2 arithmetic. $1 = the word; $2..$5 = the
# activations as bf16x2 (x[8j+i] * 2^100 low, x[8j+i+4] * 2^100 high, i = 0..3). Each pair of codes
# (i, i+4) becomes one bf16x2 (as in _unpack8), four bf16x2 FMAs sum the products per half, and the
# two halves are added in fp32. Stage 1's k loop: 3.6 instructions per weight instead of 4.7 with
# _unpack8 + fp32 FMAs (sm_90 SASS, benchmarks/sass_stats.py); products round to bf16 in each chain.
_WORD_DOT_ASM = tl.constexpr("""
{
.reg .b32 p, q, a, b;
shl.b32 a, $1, 6; shl.b32 b, $1, 12; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 p, a, b;
mov.b32 q, 0x80008000;
fma.rn.bf16x2 q, p, $2, q;
shl.b32 a, $1, 2; shl.b32 b, $1, 8; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 p, a, b;
fma.rn.bf16x2 q, p, $3, q;
shr.u32 a, $1, 2; shl.b32 b, $1, 4; and.b32 a, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 p, a, b;
fma.rn.bf16x2 q, p, $4, q;
shr.u32 a, $1, 6; and.b32 a, a, 0x01C001C0; and.b32 b, $1, 0x80008000; or.b32 p, a, b;
fma.rn.bf16x2 q, p, $5, q;
shl.b32 a, q, 16; and.b32 b, q, 0xFFFF0000; add.f32 $0, a, b;
}
""")

# _WORD_DOT_ASM for a word in paired order (kernels/mxfp4_layout.py): the same products in the same
# order, 13 integer ops a word instead of 19 before ptxas.
_WORD_DOT_PAIRED_ASM = tl.constexpr("""
{
.reg .b32 p, q, a, b;
mov.b32 q, 0x80008000;
and.b32 p, $1, 0x81C081C0;
fma.rn.bf16x2 q, p, $2, q;
shl.b32 p, $1, 6; and.b32 p, p, 0x81C081C0;
fma.rn.bf16x2 q, p, $3, q;
shl.b32 p, $1, 3; and.b32 p, p, 0x81C081C0;
fma.rn.bf16x2 q, p, $4, q;
shr.u32 a, $1, 4; shr.u32 b, $1, 5; and.b32 a, a, 0x00C000C0; and.b32 b, b, 0x01000100; or.b32 p, a, b;
shl.b32 a, $1, 1; and.b32 a, a, 0x80008000; or.b32 p, p, a;
fma.rn.bf16x2 q, p, $5, q;
shl.b32 a, q, 16; and.b32 b, q, 0xFFFF0000; add.f32 $0, a, b;
}
""")


@triton.jit
def _pack_x(base, word, INTERPRET: tl.constexpr, XPACKED: tl.constexpr = False, PLANE: tl.constexpr = 0):
    """The 8 activations of each word column `word` (at base + 8 * word) as 4 bf16x2 int32 [BKW]:
    x[i] * 2^100 in the low half, x[i + 4] * 2^100 in the high half. The interpreter gets the scaled
    values as 8 fp32 [BKW], rounded to bf16, instead. XPACKED: base points at int32 words already in
    that form (_store_packed), in 4 planes of PLANE words (= row length / 8): just loaded."""
    out = ()
    if XPACKED:
        for i in tl.static_range(4):
            w = tl.load(base + i * PLANE + word)
            if INTERPRET:
                out = out + ((w << 16).to(tl.float32, bitcast=True), (w & _HI16).to(tl.float32, bitcast=True))
            else:
                out = out + (w,)
    else:
        for i in tl.static_range(4):
            lo = tl.load(base + word * 8 + i).to(tl.float32) * _X_SCALE
            hi = tl.load(base + word * 8 + i + 4).to(tl.float32) * _X_SCALE
            if INTERPRET:
                out = out + (_bf16_round(lo), _bf16_round(hi))
            else:
                lo16 = lo.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                hi16 = hi.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
                out = out + ((hi16 << 16) | lo16,)
    return out


@triton.jit
def _word_dot(w, xp, INTERPRET: tl.constexpr, PAIRED: tl.constexpr, TILE: tl.constexpr = False):
    """Word tile w [BN, BKW] . packed activations xp (_pack_x) -> fp32 [BN, BKW], each word's 8 products
    summed in bf16x2 (two chains of four) and the two halves added in fp32. The interpreter emulates
    the bf16x2 FMAs in fp32 with a bf16 rounding after each. xp: the words' activations [BKW], or with
    TILE already loaded as tiles of w's shape."""
    if INTERPRET:
        c = _unpack(w, PAIRED)
        s_lo = tl.zeros(w.shape, dtype=tl.float32)
        s_hi = tl.zeros(w.shape, dtype=tl.float32)
        for i in tl.static_range(4):
            s_lo = _bf16_round(c[i] * _row_of(xp[2 * i], TILE) + s_lo)
            s_hi = _bf16_round(c[i + 4] * _row_of(xp[2 * i + 1], TILE) + s_hi)
        d = s_lo + s_hi
    else:
        args = [w, _row_of(xp[0], TILE), _row_of(xp[1], TILE), _row_of(xp[2], TILE), _row_of(xp[3], TILE)]
        d = tl.inline_asm_elementwise(_WORD_DOT_PAIRED_ASM if PAIRED else _WORD_DOT_ASM, "=r,r,r,r,r,r", args,
                                      dtype=tl.float32, is_pure=True, pack=1)
    return d


@triton.jit
def _row_of(x, TILE: tl.constexpr):
    """x as a row that broadcasts over a word tile's rows (as it is when TILE: a tile already)."""
    if TILE:
        return x
    else:
        return x[None, :]


@triton.jit
def _packed_step(accs, ws, ss, base, word, R: tl.constexpr, INTERPRET: tl.constexpr, PAIRED: tl.constexpr,
                 XPACKED: tl.constexpr, PLANE: tl.constexpr = 0):
    """accs[r] += scale * (word tile r . the activations of word columns `word`), products in bf16x2."""
    xp = _pack_x(base, word, INTERPRET, XPACKED, PLANE)
    new = ()
    for r in tl.static_range(R):
        new = new + (accs[r] + _word_dot(ws[r], xp, INTERPRET, PAIRED) * _e8m0_scale(ss[r]),)
    return new


@triton.jit
def _zeros(n: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr):
    out = ()
    for i in tl.static_range(n):
        out = out + (tl.zeros([BN, BKW], dtype=tl.float32),)
    return out


@triton.jit
def _load_x(x_ptr, x_offs, valid, offs, NT: tl.constexpr):
    """Per token, the 8 activation components of each word column (x[t, 8j + i], i = 0..7) as raw
    values [BKW]; rows of tokens this program does not serve read nothing (masked)."""
    xs = ()
    for t in tl.static_range(NT):
        base = x_ptr + x_offs[t] + offs
        m = valid[t] & (offs >= 0)
        xt = ()
        for i in tl.static_range(8):
            xt = xt + (tl.load(base + i, mask=m, other=0.0),)
        xs = xs + (xt,)
    return xs


@triton.jit
def _fma_tokens(accs, cs, scs, xs, x_ptr, x_offs, offs, valid,
                NT: tl.constexpr, R: tl.constexpr, SKIP: tl.constexpr, LOADED: tl.constexpr):
    """accs[t*R + r] += scs[r] * sum_i cs[r][i] * x'[t, 8j + i] for every token t and word tile r.

    cs: R tiles of 8 decoded code tensors [BN, BKW], decoded once and reused for every token. The
    activation components [BKW] of each token are scaled once and reused for every tile: taken from
    xs (LOADED, see _load_x) or loaded here from x_ptr + x_offs[t] + offs. valid: NT scalars, the
    tokens this program serves (SKIP: the others cost no loads and no arithmetic).
    """
    for t in tl.static_range(NT):
        run = True
        if SKIP:
            run = valid[t]
        if run:
            if LOADED:
                xt = xs[t]
            else:
                base = x_ptr + x_offs[t] + offs  # [BKW]; served rows only, always in bounds
                xt = ()
                for i in tl.static_range(8):
                    xt = xt + (tl.load(base + i),)
            x0 = (xt[0].to(tl.float32) * _X_SCALE)[None, :]
            x1 = (xt[1].to(tl.float32) * _X_SCALE)[None, :]
            x2 = (xt[2].to(tl.float32) * _X_SCALE)[None, :]
            x3 = (xt[3].to(tl.float32) * _X_SCALE)[None, :]
            x4 = (xt[4].to(tl.float32) * _X_SCALE)[None, :]
            x5 = (xt[5].to(tl.float32) * _X_SCALE)[None, :]
            x6 = (xt[6].to(tl.float32) * _X_SCALE)[None, :]
            x7 = (xt[7].to(tl.float32) * _X_SCALE)[None, :]
            new = ()
            for i in tl.static_range(NT * R):
                if i // R == t:
                    new = new + (accs[i] + _dot8(cs[i % R], x0, x1, x2, x3, x4, x5, x6, x7) * scs[i % R],)
                else:
                    new = new + (accs[i],)
            accs = new
    return accs


@triton.jit
def _load_tiles(w_e, s_e, row0s, row_stride, srow_stride, k0, BN: tl.constexpr, BKW: tl.constexpr,
                R: tl.constexpr, EVICT: tl.constexpr):
    """Raw weight words and scale bytes of the R word tiles of one k step."""
    ws = ()
    ss = ()
    for r in tl.static_range(R):
        ws = ws + (_word_tile(w_e + row0s[r] * row_stride, row_stride, k0, BN, BKW, False, EVICT),)
        ss = ss + (_word_tile(s_e + row0s[r] * srow_stride, srow_stride, k0, BN, BKW, True, EVICT),)
    return ws, ss


@triton.jit
def _decode(ws, ss, R: tl.constexpr, PAIRED: tl.constexpr):
    cs = ()
    scs = ()
    for r in tl.static_range(R):
        cs = cs + (_unpack(ws[r], PAIRED),)
        scs = scs + (_e8m0_scale(ss[r]),)
    return cs, scs


@triton.jit
def _stream(accs, w_e, s_e, row0s, row_stride, srow_stride, KW: tl.constexpr, x_ptr, x_offs, valid,
            BN: tl.constexpr, BKW: tl.constexpr, R: tl.constexpr, NT: tl.constexpr, SKIP: tl.constexpr,
            UNROLL: tl.constexpr, PREFETCH: tl.constexpr, WAIT: tl.constexpr, PACKED: tl.constexpr,
            INTERPRET: tl.constexpr, PAIRED: tl.constexpr, XPACKED: tl.constexpr, PRELOAD: tl.constexpr,
            PLANE: tl.constexpr, EVICT: tl.constexpr):
    """The k loop over KW words per row. PACKED: products in bf16x2 (_word_dot; one token only).
    PREFETCH: software-pipelined by one step (step k+1's weight and scale loads, and without PACKED its
    activation loads, are issued before step k is decoded and multiplied). WAIT: pdl_wait
    between the first step's weight loads and its first activation load (kernels/pdl.py). PAIRED: the
    words are in paired order (kernels/mxfp4_layout.py). XPACKED (with PACKED): x_ptr holds int32 words
    of bf16x2 activations in planes of PLANE words (_store_packed). PRELOAD (with PACKED):
    every step's weight and scale loads come first in program order (before WAIT's pdl_wait), then the
    steps' multiplies; ptxas still interleaves some loads with the multiplies (stage 1), while a stage
    2's land before its wait (sm_90 SASS, test_sass)."""
    kw = _perm4(tl.arange(0, BKW))
    if PRELOAD:
        wss = ()
        sss = ()
        for k in tl.static_range(KW // BKW):
            ws_k, ss_k = _load_tiles(w_e, s_e, row0s, row_stride, srow_stride, k * BKW, BN, BKW, R, EVICT)
            wss = wss + (ws_k,)
            sss = sss + (ss_k,)
        pdl_wait(WAIT)
        base = x_ptr + x_offs[0]
        for k in tl.static_range(KW // BKW):
            accs = _packed_step(accs, wss[k], sss[k], base, k * BKW + kw, R, INTERPRET, PAIRED, XPACKED, PLANE)
    else:
        ws, ss = _load_tiles(w_e, s_e, row0s, row_stride, srow_stride, 0, BN, BKW, R, EVICT)
        pdl_wait(WAIT)
        if PACKED:  # one token (NT = 1), bf16x2 products: see _WORD_DOT_ASM
            base = x_ptr + x_offs[0]
            if PREFETCH:
                for k0 in tl.range(0, KW, BKW, loop_unroll_factor=UNROLL):
                    kn = tl.minimum(k0 + BKW, KW - BKW)  # the last step re-reads its own words (cache hits)
                    ws_n, ss_n = _load_tiles(w_e, s_e, row0s, row_stride, srow_stride, kn, BN, BKW, R, EVICT)
                    accs = _packed_step(accs, ws, ss, base, k0 + kw, R, INTERPRET, PAIRED, XPACKED, PLANE)
                    ws = ws_n
                    ss = ss_n
            else:
                accs = _packed_step(accs, ws, ss, base, kw, R, INTERPRET, PAIRED, XPACKED, PLANE)
                for k0 in tl.range(BKW, KW, BKW, loop_unroll_factor=UNROLL):
                    ws, ss = _load_tiles(w_e, s_e, row0s, row_stride, srow_stride, k0, BN, BKW, R, EVICT)
                    accs = _packed_step(accs, ws, ss, base, k0 + kw, R, INTERPRET, PAIRED, XPACKED, PLANE)
        elif PREFETCH:
            xs = _load_x(x_ptr, x_offs, valid, kw * 8, NT)
            for k0 in tl.range(0, KW, BKW, loop_unroll_factor=UNROLL):
                kn = tl.minimum(k0 + BKW, KW - BKW)  # the last step re-reads its own words (cache hits)
                ws_n, ss_n = _load_tiles(w_e, s_e, row0s, row_stride, srow_stride, kn, BN, BKW, R, EVICT)
                xs_n = _load_x(x_ptr, x_offs, valid, (kn + kw) * 8, NT)
                cs, scs = _decode(ws, ss, R, PAIRED)
                accs = _fma_tokens(accs, cs, scs, xs, x_ptr, x_offs, kw, valid, NT, R, SKIP, True)
                ws = ws_n
                ss = ss_n
                xs = xs_n
        else:
            cs, scs = _decode(ws, ss, R, PAIRED)
            accs = _fma_tokens(accs, cs, scs, (), x_ptr, x_offs, kw * 8, valid, NT, R, SKIP, False)
            for k0 in tl.range(BKW, KW, BKW, loop_unroll_factor=UNROLL):
                ws, ss = _load_tiles(w_e, s_e, row0s, row_stride, srow_stride, k0, BN, BKW, R, EVICT)
                cs, scs = _decode(ws, ss, R, PAIRED)
                accs = _fma_tokens(accs, cs, scs, (), x_ptr, x_offs, (k0 + kw) * 8, valid, NT, R, SKIP, False)
    return accs


@triton.jit
def _slot_tokens(ids_ptr, rw_ptr, e, s, T: tl.constexpr, K: tl.constexpr, NT: tl.constexpr,
                 K_PAD: tl.constexpr, DEDUPE: tl.constexpr):
    """The token rows a program serves, as NT-tuples of scalars: (token, slot t*K + k, routing
    weight, served). DEDUPE: every token that chose expert e (first NT = pow2(T) tokens); else
    only slot s's own token (NT = 1)."""
    kk = tl.arange(0, K_PAD)
    toks = ()
    slots = ()
    rws = ()
    vals = ()
    for t in tl.static_range(NT):
        if DEDUPE:
            tok = t
            m = (kk < K) & (t < T)
            ids_t = tl.load(ids_ptr + tok * K + kk, mask=m, other=-1).to(tl.int32)
            match = (ids_t == e) & m
        else:
            tok = s // K
            match = kk == s % K
        rw_t = tl.load(rw_ptr + tok * K + kk, mask=match, other=0.0).to(tl.float32)
        toks = toks + (tok,)
        slots = slots + (tok * K + tl.sum(tl.where(match, kk, 0), axis=0),)
        rws = rws + (tl.sum(rw_t, axis=0),)
        vals = vals + (tl.max(match.to(tl.int32), axis=0) > 0,)
    return toks, slots, rws, vals


@triton.jit
def _is_first(ids_ptr, e, s, S: tl.constexpr, S_PAD: tl.constexpr):
    """True when slot s is the first slot (in t*K + k order) that chose expert e."""
    sl = tl.arange(0, S_PAD)
    ids_all = tl.load(ids_ptr + sl, mask=sl < S, other=-1).to(tl.int32)
    return tl.min(tl.where(ids_all == e, sl, S_PAD), axis=0) == s


@triton.jit
def mxfp4_moe_stage1_kernel(
    x_ptr, ids_ptr, rw_ptr, w13_ptr, s13_ptr, act_ptr, limit,
    T: tl.constexpr, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    BN: tl.constexpr, RS: tl.constexpr, BKW: tl.constexpr, UNROLL: tl.constexpr,
    NT: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr, DEDUPE: tl.constexpr, PREFETCH: tl.constexpr,
    PACKED: tl.constexpr = False, INTERPRET: tl.constexpr = False, PDL: tl.constexpr = False,
    PAIRED: tl.constexpr = False, ACT_PACKED: tl.constexpr = False, X_PACKED: tl.constexpr = False,
    PRELOAD: tl.constexpr = False,
    xs_ptr=None, shw_ptr=None, shs_ptr=None, sha_ptr=None, sh_limit=0.0,
    SHARED: tl.constexpr = 0, SH_UP: tl.constexpr = 0, SH_BK: tl.constexpr = 0, EVICT: tl.constexpr = "",
):
    """ACT_PACKED: act_ptr is bf16, written as _store_packed lays it out for stage 2 (PACKED only).
    X_PACKED (PACKED only): x_ptr is int32 [T, H/2], x already as the bf16x2 words _pack_x builds, in
    planes (pack_moe_x's layout, written by the add+norm kernel before the MoE: _store_packed).
    SHARED > 0 (one token): slots T*K .. T*K + SHARED - 1 are the shared expert's programs, each taking
    1/SHARED of its block's rows (_shared_gate_up; x plain at xs_ptr, act to sha_ptr)."""
    s = tl.program_id(0)  # slot t*K + k
    nb = tl.program_id(1)  # block of RS*BN gate rows (and the matching up rows)
    if SHARED > 0:  # (nested: a kernel without SHARED compiles no branch at all)
        s, nb = _shared_programs_first(T * K, SHARED)
        if s >= T * K:
            BSH: tl.constexpr = RS * BN // SHARED
            _shared_gate_up(xs_ptr, shw_ptr, shs_ptr, sha_ptr, sh_limit, nb * (RS * BN) + (s - T * K) * BSH, H,
                            SH_UP, BSH, SH_BK, PDL, not INTERPRET, EVICT)
        else:
            _stage1_routed(x_ptr, ids_ptr, rw_ptr, w13_ptr, s13_ptr, act_ptr, limit, s, nb, T, K, H, I, BN, RS, BKW,
                           UNROLL, NT, K_PAD, S_PAD, DEDUPE, PREFETCH, PACKED, INTERPRET, PDL, PAIRED, ACT_PACKED,
                           X_PACKED, PRELOAD, EVICT)
    else:
        _stage1_routed(x_ptr, ids_ptr, rw_ptr, w13_ptr, s13_ptr, act_ptr, limit, s, nb, T, K, H, I, BN, RS, BKW,
                       UNROLL, NT, K_PAD, S_PAD, DEDUPE, PREFETCH, PACKED, INTERPRET, PDL, PAIRED, ACT_PACKED,
                       X_PACKED, PRELOAD, EVICT)


@triton.jit
def _stage1_routed(x_ptr, ids_ptr, rw_ptr, w13_ptr, s13_ptr, act_ptr, limit, s, nb,
                   T: tl.constexpr, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                   BN: tl.constexpr, RS: tl.constexpr, BKW: tl.constexpr, UNROLL: tl.constexpr,
                   NT: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr, DEDUPE: tl.constexpr,
                   PREFETCH: tl.constexpr, PACKED: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
                   PAIRED: tl.constexpr, ACT_PACKED: tl.constexpr, X_PACKED: tl.constexpr, PRELOAD: tl.constexpr,
                   EVICT: tl.constexpr):
    """mxfp4_moe_stage1_kernel's routed programs: slot s, block nb."""
    pdl_wait(PDL)  # the expert ids may come from the kernel just before: nothing to load earlier
    e = tl.load(ids_ptr + s).to(tl.int32)
    if DEDUPE:
        work = _is_first(ids_ptr, e, s, T * K, S_PAD)
    else:
        work = True
    if work:
        HW: tl.constexpr = H // 8  # int32 words per row
        HG: tl.constexpr = H // 32  # scale bytes per row
        R: tl.constexpr = 2 * RS  # word tiles per step: (gate, up) x RS row blocks
        toks, slots, rws, valid = _slot_tokens(ids_ptr, rw_ptr, e, s, T, K, NT, K_PAD, DEDUPE)
        x_offs = ()
        for t in tl.static_range(NT):
            x_offs = x_offs + (toks[t] * (H // 2 if X_PACKED else H),)
        sub = tl.arange(0, BN)
        w_e = w13_ptr + e.to(tl.int64) * (2 * I * HW)
        s_e = s13_ptr + e.to(tl.int64) * (2 * I * HG)
        row0s = ()
        for r in tl.static_range(R):
            row0s = row0s + (nb * (RS * BN) + (r // 2) * BN + (r % 2) * I,)  # even r: gate rows, odd r: up rows
        accs = _stream(_zeros(NT * R, BN, BKW), w_e, s_e, row0s, HW, HG, HW, x_ptr, x_offs, valid,
                       BN, BKW, R, NT, DEDUPE, UNROLL, PREFETCH, False, PACKED, INTERPRET, PAIRED, X_PACKED, PRELOAD,
                       H // 8, EVICT)
        lim = tl.where(limit > 0, limit, float("inf"))
        for t in tl.static_range(NT):
            out = act_ptr + slots[t] * I + nb * (RS * BN) + sub
            for rs in tl.static_range(RS):
                g = tl.sum(accs[t * R + 2 * rs], axis=1)
                u = tl.sum(accs[t * R + 2 * rs + 1], axis=1)
                a = tl.minimum(g / (1.0 + tl.exp(-g)), lim)  # silu, clamped above
                u = tl.minimum(tl.maximum(u, -lim), lim)
                if ACT_PACKED:
                    _store_packed(act_ptr + slots[t] * I, nb * (RS * BN) + rs * BN + sub, a * u * rws[t],
                                  valid[t] & (sub >= 0), I, INTERPRET)
                else:
                    tl.store(out + rs * BN, a * u * rws[t], mask=valid[t] & (sub >= 0))


@triton.jit
def mxfp4_moe_stage2_kernel(
    act_ptr, ids_ptr, w2_ptr, s2_ptr, part_ptr, cnt_ptr, y_ptr, add_ptr,
    T: tl.constexpr, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, HAS_ADD: tl.constexpr,
    BN: tl.constexpr, RS: tl.constexpr, BKW: tl.constexpr, UNROLL: tl.constexpr,
    NT: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr, DEDUPE: tl.constexpr, PREFETCH: tl.constexpr,
    PACKED: tl.constexpr = False, INTERPRET: tl.constexpr = False, PDL: tl.constexpr = False,
    PAIRED: tl.constexpr = False, ACT_PACKED: tl.constexpr = False, PRELOAD: tl.constexpr = False,
    shw_ptr=None, shs_ptr=None, sha_ptr=None, sh_limit=0.0, SHARED: tl.constexpr = 0, SH_BK: tl.constexpr = 0,
    SH_GU: tl.constexpr = 0, SH_ROW: tl.constexpr = 0,
    res_ptr=None, nw_ptr=None, s_out_ptr=None, h_ptr=None, ssq_ptr=None, eps=0.0, h16_ptr=None, hd_ptr=None,
    NORM: tl.constexpr = False, F16: tl.constexpr = False, SUM_AT_ONCE: tl.constexpr = False,
    EVICT: tl.constexpr = "",
):
    """With PDL, the expert ids (written by the router, two or more kernels back) and the first step's
    weights are read before pdl_wait: the down weights start streaming during stage 1's tail.
    ACT_PACKED: act_ptr is int32, stage 1's packed act (_store_packed, planes of I/8 words).
    SHARED > 0: slots T*K .. T*K + SHARED - 1 run the shared expert's down rows (_shared_down, into part
    rows T*K + t), which _sum_slots adds after the routed experts' sum; their act is stage 1's (sha_ptr
    fp32, one token), or with SH_GU > 0 the SwiGLU of a gate|up GEMV's bf16 output at sha_ptr [T, SH_ROW].
    NORM: the residual add and the next RMSNorm too (_sum_slots; 2: the add and the sums of squares)."""
    nb = tl.program_id(0)  # block of RS*BN output rows
    s = tl.program_id(1)  # slot t*K + k
    rows = nb * (RS * BN) + tl.arange(0, BN)
    if SHARED > 0:
        if s >= T * K:
            BSH: tl.constexpr = RS * BN // SHARED
            _shared_down(sha_ptr, shw_ptr, shs_ptr, part_ptr + T * K * H, nb * (RS * BN) + (s - T * K) * BSH,
                         sh_limit, T, H, I, BSH, SH_BK, SH_GU, SH_ROW, PDL, not INTERPRET, EVICT)
        else:
            _stage2_routed(act_ptr, ids_ptr, w2_ptr, s2_ptr, part_ptr, s, nb, rows, T, K, H, I, BN, RS, BKW, UNROLL,
                           NT, K_PAD, S_PAD, DEDUPE, PREFETCH, PACKED, INTERPRET, PDL, PAIRED, ACT_PACKED, PRELOAD,
                           EVICT)
    else:
        _stage2_routed(act_ptr, ids_ptr, w2_ptr, s2_ptr, part_ptr, s, nb, rows, T, K, H, I, BN, RS, BKW, UNROLL, NT,
                       K_PAD, S_PAD, DEDUPE, PREFETCH, PACKED, INTERPRET, PDL, PAIRED, ACT_PACKED, PRELOAD, EVICT)
    _sum_slots(part_ptr, cnt_ptr, y_ptr, add_ptr, nb, rows, T, K, H, RS, BN, HAS_ADD, SHARED,
               (res_ptr, nw_ptr, s_out_ptr, h_ptr, ssq_ptr, eps, h16_ptr, hd_ptr), NORM, F16, INTERPRET, SUM_AT_ONCE)


@triton.jit
def _stage2_routed(act_ptr, ids_ptr, w2_ptr, s2_ptr, part_ptr, s, nb, rows,
                   T: tl.constexpr, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                   BN: tl.constexpr, RS: tl.constexpr, BKW: tl.constexpr, UNROLL: tl.constexpr,
                   NT: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr, DEDUPE: tl.constexpr,
                   PREFETCH: tl.constexpr, PACKED: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
                   PAIRED: tl.constexpr, ACT_PACKED: tl.constexpr, PRELOAD: tl.constexpr, EVICT: tl.constexpr):
    """mxfp4_moe_stage2_kernel's routed programs: slot s, row block nb -> part[slot, rows]."""
    IW: tl.constexpr = I // 8
    IG: tl.constexpr = I // 32
    e = tl.load(ids_ptr + s).to(tl.int32)
    if DEDUPE:
        work = _is_first(ids_ptr, e, s, T * K, S_PAD)
    else:
        work = True
    if work:
        # Routing weights are already folded into act: rws (read from ids_ptr here) is unused.
        toks, slots, rws, valid = _slot_tokens(ids_ptr, ids_ptr, e, s, T, K, NT, K_PAD, DEDUPE)
        a_offs = ()
        for t in tl.static_range(NT):
            a_offs = a_offs + (slots[t] * (I // 2 if ACT_PACKED else I),)
        w_e = w2_ptr + e.to(tl.int64) * (H * IW)
        s_e = s2_ptr + e.to(tl.int64) * (H * IG)
        row0s = ()
        for r in tl.static_range(RS):
            row0s = row0s + (nb * (RS * BN) + r * BN,)
        accs = _stream(_zeros(NT * RS, BN, BKW), w_e, s_e, row0s, IW, IG, IW, act_ptr, a_offs, valid,
                       BN, BKW, RS, NT, DEDUPE, UNROLL, PREFETCH, PDL, PACKED, INTERPRET, PAIRED, ACT_PACKED, PRELOAD,
                       I // 8, EVICT)
        for t in tl.static_range(NT):
            out = part_ptr + slots[t] * H + rows
            for r in tl.static_range(RS):
                tl.store(out + r * BN, tl.sum(accs[t * RS + r], axis=1), mask=valid[t] & (rows >= 0))
    else:
        pdl_wait(PDL)


@triton.jit
def _sum_slots(part_ptr, cnt_ptr, y_ptr, add_ptr, nb, rows, T: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
               RS: tl.constexpr, BN: tl.constexpr, HAS_ADD: tl.constexpr, SHARED: tl.constexpr = 0,
               norm=(), NORM: tl.constexpr = False, F16: tl.constexpr = False, INTERPRET: tl.constexpr = False,
               AT_ONCE: tl.constexpr = False):
    """Stage 2's end: the last of the T*K (+ SHARED) programs of row block nb (RS tiles of BN rows from
    `rows`) sums the slots' partials in slot order into y bf16, plus the shared expert's output (HAS_ADD:
    add_ptr; SHARED: part rows T*K + t, from the shared-expert programs), and resets the block's arrival
    counter (this program's stores -> barrier -> release).
    NORM: then the residual add and RMSNorm after the layer, as fp8_gemv's _add_norm_tail does them for
    an output projection: s = bf16(residual + y) and each row tile's sum of squares, and the last row
    block to finish (counter H / (RS*BN)) turns s into the norm's output for all H columns (and its F16
    form). norm = (residual, norm weight, s out, h out, sums of squares [T, H/BN], eps, h16, hd).
    NORM == 2: s and the sums of squares only; the GEMV reading the norm's output applies it as it loads s
    (fp8_gemv's x_norm), with no serial last block here.
    AT_ONCE (T > 1, no NORM): every token in the same [TP, BN] tiles, all loads before any store
    (_sum_slots_at_once), not one token after another."""
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + nb, 1, sem="acq_rel", scope="gpu")
    ONCE: tl.constexpr = AT_ONCE and T > 1 and not NORM
    if ONCE:
        if done == T * K + SHARED - 1:
            tl.debug_barrier()
            _sum_slots_at_once(part_ptr, y_ptr, add_ptr, rows, T, K, H, RS, BN, HAS_ADD, SHARED)
            tl.store(cnt_ptr + nb, 0)  # ready for the next launch
    elif done == T * K + SHARED - 1:
        tl.debug_barrier()
        for t in tl.static_range(T):
            for r in tl.static_range(RS):
                y = tl.zeros([BN], dtype=tl.float32)
                for k in tl.static_range(K):
                    y += tl.load(part_ptr + (t * K + k) * H + rows + r * BN, cache_modifier=".cg")
                y = y.to(tl.bfloat16)
                if HAS_ADD:  # the shared expert's output, added as torch adds two bf16 tensors
                    y = (y.to(tl.float32) + tl.load(add_ptr + t * H + rows + r * BN).to(tl.float32)).to(tl.bfloat16)
                if SHARED > 0:  # the same add, the shared output already a bf16 value
                    sh = tl.load(part_ptr + (T * K + t) * H + rows + r * BN, cache_modifier=".cg")
                    y = (y.to(tl.float32) + sh).to(tl.bfloat16)
                tl.store(y_ptr + t * H + rows + r * BN, y)
                if NORM:  # as ops.add_rms_norm rounds: s = bf16(residual + y)
                    sv = (tl.load(norm[0] + t * H + rows + r * BN).to(tl.float32) + y.to(tl.float32)).to(tl.bfloat16)
                    tl.store(norm[2] + t * H + rows + r * BN, sv)
                    sf = sv.to(tl.float32)
                    tl.store(norm[4] + t * (H // BN) + nb * RS + r, tl.sum(sf * sf, axis=0))
        tl.store(cnt_ptr + nb, 0)  # ready for the next launch
        if NORM == 1:
            NBLK: tl.constexpr = H // (RS * BN)
            tl.debug_barrier()  # s and the sums of squares -> the release below
            last = tl.atomic_add(cnt_ptr + NBLK, 1, sem="acq_rel", scope="gpu")
            if last == NBLK - 1:
                tl.debug_barrier()
                _norm_rows(norm[2], norm[4], norm[1], norm[3], norm[5], norm[6], norm[7], None, H // BN, T, H, F16,
                           False, INTERPRET)
                tl.store(cnt_ptr + NBLK, 0)


@triton.jit
def _sum_slots_at_once(part_ptr, y_ptr, add_ptr, rows, T: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
                       RS: tl.constexpr, BN: tl.constexpr, HAS_ADD: tl.constexpr, SHARED: tl.constexpr):
    """_sum_slots' sum for every token at once: each row tile's slots (and shared outputs) loaded for all
    tokens before any store, summed and rounded as _sum_slots does, then y written. Tokens padded to a
    power of two are clamped to the last one (read twice, stored once), which keeps the loads unmasked."""
    TP: tl.constexpr = 2 if T <= 2 else (4 if T <= 4 else 8)
    tt = tl.minimum(tl.arange(0, TP), T - 1)
    ys = ()
    adds = ()
    shs = ()
    for r in tl.static_range(RS):
        cols = rows[None, :] + r * BN
        y = tl.zeros([TP, BN], dtype=tl.float32)
        for k in tl.static_range(K):
            y += tl.load(part_ptr + (tt[:, None] * K + k) * H + cols, cache_modifier=".cg")
        ys = ys + (y,)
        if HAS_ADD:
            adds = adds + (tl.load(add_ptr + tt[:, None] * H + cols),)
        if SHARED > 0:
            shs = shs + (tl.load(part_ptr + (T * K + tt[:, None]) * H + cols, cache_modifier=".cg"),)
    for r in tl.static_range(RS):
        cols = rows[None, :] + r * BN
        y = ys[r].to(tl.bfloat16)
        if HAS_ADD:
            y = (y.to(tl.float32) + adds[r].to(tl.float32)).to(tl.bfloat16)
        if SHARED > 0:
            y = (y.to(tl.float32) + shs[r]).to(tl.bfloat16)
        if T == TP:
            tl.store(y_ptr + tt[:, None] * H + cols, y)
        else:
            tl.store(y_ptr + tt[:, None] * H + cols, y, mask=(tl.arange(0, TP) < T)[:, None])


@triton.jit
def _issue_fence():
    """A warp barrier (bar.warp.sync): ptxas keeps the global loads before it in front of it, so every
    load above is issued before the multiplies below (it sinks them next to their uses otherwise)."""
    tl.inline_asm_elementwise("bar.warp.sync -1; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fp8_rows_preload(w_ptr, s_ptr, r0, K: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
                      EVICT: tl.constexpr):
    """Rows [r0, r0 + BS) of an FP8 weight [*, K] with 128 x 128 block scales s [*, ceil(K / 128)]: every
    step's [BS, BK] tile and the block scale of each 16-column vector [BK // 16], loaded up front (the
    rows lie in one 128-row block: BS divides 128 and r0 is a multiple of BS)."""
    V: tl.constexpr = 16 if BK >= 16 else BK  # a thread's 16-byte vector: inside one scale block
    KB: tl.constexpr = (K + 127) // 128
    cols = tl.arange(0, BK)
    seg = tl.arange(0, BK // V) * V
    wp = w_ptr + (r0 + tl.arange(0, BS))[:, None] * K + cols[None, :]
    sp = s_ptr + (r0 // 128) * KB
    ws = ()
    ss = ()
    for k in tl.static_range(K // BK):
        ws = ws + (tl.load(wp + k * BK, eviction_policy=EVICT),)
        ss = ss + (tl.load(sp + (k * BK + seg) // 128, eviction_policy=EVICT),)
    return ws, ss


@triton.jit
def _fp8_rows_dot(ws, ss, x_ptr, K: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, GU: tl.constexpr = 0,
                  lim=float("inf"), T: tl.constexpr = 1, XROW: tl.constexpr = 0):
    """The preloaded rows (_fp8_rows_preload) . x_t [K] for T tokens (x_ptr + t * XROW, bf16 or fp32) ->
    T fp32 [BS]: each thread sums its own vector's 16 products and scales that sum once, into [BS, BK // 16]
    accumulators reduced across lanes only at the end; each step's weights are converted once for all
    tokens (a loop over tokens outside the steps would have the compiler hoist every step's converted
    weights out of it: 182 registers at T = 2). GU > 0: x_ptr holds a gate|up projection's bf16 output, up
    from column GU, and x is their clamped SwiGLU (limit lim), rounded to bf16 as fp8_block_gemv_swiglu
    rounds it."""
    V: tl.constexpr = 16 if BK >= 16 else BK
    cols = tl.arange(0, BK)
    accs = ()
    for t in tl.static_range(T):
        accs = accs + (tl.zeros([BS, BK // V], dtype=tl.float32),)
    for k in tl.static_range(K // BK):
        wf = ws[k].to(tl.float32)
        new = ()
        for t in tl.static_range(T):
            xv = tl.load(x_ptr + t * XROW + k * BK + cols).to(tl.float32)
            if GU > 0:
                up = tl.load(x_ptr + t * XROW + GU + k * BK + cols).to(tl.float32)
                xv = _bf16_round(tl.minimum(xv / (1.0 + tl.exp(-xv)), lim) * tl.minimum(tl.maximum(up, -lim), lim))
            p = tl.sum(tl.reshape(wf * xv[None, :], [BS, BK // V, V]), axis=2)
            new = new + (accs[t] + p * ss[k][None, :],)
        accs = new
    out = ()
    for t in tl.static_range(T):
        out = out + (tl.sum(accs[t], axis=1),)
    return out


@triton.jit
def _shared_programs_first(S: tl.constexpr, SHARED: tl.constexpr):
    """Stage 1's (slot, block) for a grid of (S + SHARED, blocks) programs, renumbered so that the shared
    expert's programs (slots S .. S + SHARED - 1) come first in launch order. With them the grid is
    larger than what fits the GPU at once (480 programs of 8 warps at Ling's shape, 396 resident on an
    H200); first, they are resident while the router runs — their weights stream then — and they end
    soon after the wait, making room for the routed programs that did not fit."""
    pid = tl.program_id(0) + tl.program_id(1) * (S + SHARED)
    n_shared = SHARED * tl.num_programs(1)
    q = pid - n_shared
    first = pid < n_shared
    return tl.where(first, S + pid % SHARED, q % S), tl.where(first, pid // SHARED, q // S)


@triton.jit
def _shared_gate_up(x_ptr, w_ptr, s_ptr, act_ptr, limit, r0, H: tl.constexpr, UP: tl.constexpr,
                    BS: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, FENCE: tl.constexpr,
                    EVICT: tl.constexpr):
    """Stage 1's shared-expert programs (MoE with `shared`): one token's gate rows [r0, r0 + BS) of the
    shared expert's fused FP8 gate|up weight and the matching up rows (at row UP + r), then the SwiGLU ->
    act_ptr[r0 : r0 + BS] fp32, rounded as the shared MLP's own kernels round it (its gate|up output to
    bf16, the SwiGLU to bf16). Nothing here depends on the routing, so all of it runs before the PDL
    wait, while the router's kernels do: x is the MoE's input, written by the norm or by the router's
    GEMV — two kernels back at least (pdl.py) — and act_ptr's row is read only by stage 2, after its
    own wait, and touched by neither kernel that can still be running (the top-k before this launch,
    stage 2 after it)."""
    gs, sgs = _fp8_rows_preload(w_ptr, s_ptr, r0, H, BS, BK, EVICT)
    us, sus = _fp8_rows_preload(w_ptr, s_ptr, UP + r0, H, BS, BK, EVICT)
    if FENCE:
        _issue_fence()
    g = _bf16_round(_fp8_rows_dot(gs, sgs, x_ptr, H, BS, BK)[0])
    u = _bf16_round(_fp8_rows_dot(us, sus, x_ptr, H, BS, BK)[0])
    lim = tl.where(limit > 0, limit, float("inf"))
    a = tl.minimum(g / (1.0 + tl.exp(-g)), lim) * tl.minimum(tl.maximum(u, -lim), lim)
    tl.store(act_ptr + r0 + tl.arange(0, BS), _bf16_round(a))
    pdl_wait(PDL)


@triton.jit
def _shared_down(act_ptr, w_ptr, s_ptr, out_ptr, r0, limit, T: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                 BS: tl.constexpr, BK: tl.constexpr, GU: tl.constexpr, GU_ROW: tl.constexpr, PDL: tl.constexpr,
                 FENCE: tl.constexpr, EVICT: tl.constexpr):
    """Stage 2's shared-expert programs: rows [r0, r0 + BS) of the shared expert's FP8 down projection, its
    weights and scales loaded before the PDL wait, then each of the T tokens' act -> out_ptr[t, r0 : r0 +
    BS] (rows of H) fp32, holding the bf16 the down GEMV would give (_sum_slots adds it). The act: stage
    1's (GU = 0; one token), or (GU > 0: up at column GU, rows of GU_ROW) the SwiGLU of the gate|up GEMV's
    output, made as it is loaded. That output was joined before this launch (a full dependency, not the
    PDL edge), so with it all of this runs before the wait; stage 1's act must wait."""
    ws, ss = _fp8_rows_preload(w_ptr, s_ptr, r0, I, BS, BK, EVICT)
    if FENCE:
        _issue_fence()
    if GU == 0:
        pdl_wait(PDL)
    lim = tl.where(limit > 0, limit, float("inf"))
    ys = _fp8_rows_dot(ws, ss, act_ptr, I, BS, BK, GU, lim, T, GU_ROW)
    for t in tl.static_range(T):
        tl.store(out_ptr + t * H + r0 + tl.arange(0, BS), _bf16_round(ys[t]))
    if GU > 0:
        pdl_wait(PDL)


@triton.jit
def _unaligned_zero(e):
    """0 for any expert id e, of an alignment the compiler cannot know. Added to a stage's scale-byte
    pointers it keeps Triton from loading two bytes a thread where it could, so the scales are laid out
    as the group sums they multiply already are (one byte a thread, lanes along the groups) and need no
    trip through shared memory (one-token stage 2: 3 such trips, 6 barriers a program; sm_90 SASS)."""
    return e >> 30


@triton.jit
def _group_dot(w, s, base, word, INTERPRET: tl.constexpr, PAIRED: tl.constexpr, XPACKED: tl.constexpr,
               PLANE: tl.constexpr, TILE: tl.constexpr = True):
    """Word tile w [BN, BKW] (a thread holding 4 consecutive words: whole groups, 16-byte loads) . the
    packed activations of words `word` [BKW] -> fp32 [BN, BKW // 4]: each group's 4 word dots summed in
    the thread, then times its E8M0 byte s [BN, BKW // 4] once.
    TILE: the activations are loaded as a whole [BN, BKW] tile (every row the same words), which gets
    w's layout: a thread loads its own 4 words, 16 bytes. Loaded as a row [BKW] (TILE off), Triton lays
    them out one word a thread and moves them through shared memory every step where the program is
    small (at four tokens: 20 stores, 20 loads and 40 barriers a program; sm_90 SASS, sass_stats.py)."""
    BN: tl.constexpr = w.shape[0]
    BKW: tl.constexpr = w.shape[1]
    if TILE:
        words = word[None, :] + tl.zeros([BN, 1], dtype=word.dtype)
        d = _word_dot(w, _pack_x(base, words, INTERPRET, XPACKED, PLANE), INTERPRET, PAIRED, TILE=True)
    else:
        d = _word_dot(w, _pack_x(base, word, INTERPRET, XPACKED, PLANE), INTERPRET, PAIRED)
    return tl.sum(tl.reshape(d, [BN, BKW // 4, 4]), axis=2) * _e8m0_scale(s)


@triton.jit
def mxfp4_moe_stage1_vec_kernel(
    x_ptr, ids_ptr, rw_ptr, w13_ptr, s13_ptr, act_ptr, limit,
    K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
    INTERPRET: tl.constexpr = False, PDL: tl.constexpr = False, PAIRED: tl.constexpr = False,
    ACT_PACKED: tl.constexpr = False, X_PACKED: tl.constexpr = False, FENCE: tl.constexpr = True,
    xs_ptr=None, shw_ptr=None, shs_ptr=None, sha_ptr=None, sh_limit=0.0,
    SHARED: tl.constexpr = 0, SH_UP: tl.constexpr = 0, SH_BK: tl.constexpr = 0, TILE: tl.constexpr = True,
    EVICT: tl.constexpr = "",
):
    """Stage 1 for one token per program (slot s, block nb of BN gate rows and the matching up rows), its
    weights in 16-byte loads: a thread holds whole MX groups (4 consecutive words, one scale byte), so a
    row step is BKW/4 vector loads and BKW/4 scale bytes where mxfp4_moe_stage1_kernel issues BKW word
    loads and BKW byte loads. Every step's loads are issued first — a warp barrier after them keeps ptxas
    from sinking them next to their multiplies (_issue_fence) — then multiplied, products in bf16x2 as
    _WORD_DOT_ASM, each group's sum scaled once: the packed stage 1's products, summed in another order.
    MoeConfig.maxnreg1 caps the registers that holding every load takes, so that the programs of one
    token (384 of 8 warps at Ling's shape) fit the GPU at once. SHARED: as mxfp4_moe_stage1_kernel's."""
    s = tl.program_id(0)  # slot t*K + k: token s // K
    nb = tl.program_id(1)
    if SHARED > 0:
        s, nb = _shared_programs_first(K, SHARED)
        if s >= K:  # one token
            BSH: tl.constexpr = BN // SHARED
            _shared_gate_up(xs_ptr, shw_ptr, shs_ptr, sha_ptr, sh_limit, nb * BN + (s - K) * BSH, H, SH_UP, BSH,
                            SH_BK, PDL, FENCE and not INTERPRET, EVICT)
        else:
            _stage1_vec_routed(x_ptr, ids_ptr, rw_ptr, w13_ptr, s13_ptr, act_ptr, limit, s, nb, K, H, I, BN, BKW,
                               INTERPRET, PDL, PAIRED, ACT_PACKED, X_PACKED, FENCE, TILE, EVICT)
    else:
        _stage1_vec_routed(x_ptr, ids_ptr, rw_ptr, w13_ptr, s13_ptr, act_ptr, limit, s, nb, K, H, I, BN, BKW,
                           INTERPRET, PDL, PAIRED, ACT_PACKED, X_PACKED, FENCE, TILE, EVICT)


@triton.jit
def _stage1_vec_routed(x_ptr, ids_ptr, rw_ptr, w13_ptr, s13_ptr, act_ptr, limit, s, nb,
                       K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
                       INTERPRET: tl.constexpr, PDL: tl.constexpr, PAIRED: tl.constexpr, ACT_PACKED: tl.constexpr,
                       X_PACKED: tl.constexpr, FENCE: tl.constexpr, TILE: tl.constexpr, EVICT: tl.constexpr):
    """mxfp4_moe_stage1_vec_kernel's routed programs: slot s, block nb."""
    pdl_wait(PDL)
    e = tl.load(ids_ptr + s).to(tl.int32)
    rw = tl.load(rw_ptr + s).to(tl.float32)
    HW: tl.constexpr = H // 8
    HG: tl.constexpr = H // 32
    G: tl.constexpr = BKW // 4
    rows = nb * BN + tl.arange(0, BN)
    word = tl.arange(0, BKW)
    w_e = w13_ptr + e.to(tl.int64) * (2 * I * HW)
    s_e = s13_ptr + e.to(tl.int64) * (2 * I * HG)
    wg_ptr = w_e + rows[:, None] * HW + word[None, :]
    sg_ptr = s_e + rows[:, None] * HG + tl.arange(0, G)[None, :]
    if TILE:
        sg_ptr += _unaligned_zero(e)
    ws = ()
    ss = ()
    for k in tl.static_range(HW // BKW):  # gate then up rows of each step, all loads first
        ws = ws + (tl.load(wg_ptr + k * BKW, eviction_policy=EVICT),
                   tl.load(wg_ptr + (I * HW + k * BKW), eviction_policy=EVICT))
        ss = ss + (tl.load(sg_ptr + k * G, eviction_policy=EVICT), tl.load(sg_ptr + (I * HG + k * G), eviction_policy=EVICT))
    if FENCE and not INTERPRET:
        _issue_fence()
    base = x_ptr + (s // K) * (H // 2 if X_PACKED else H)
    acc_g = tl.zeros([BN, G], dtype=tl.float32)
    acc_u = tl.zeros([BN, G], dtype=tl.float32)
    for k in tl.static_range(HW // BKW):
        acc_g += _group_dot(ws[2 * k], ss[2 * k], base, k * BKW + word, INTERPRET, PAIRED, X_PACKED, H // 8, TILE)
        acc_u += _group_dot(ws[2 * k + 1], ss[2 * k + 1], base, k * BKW + word, INTERPRET, PAIRED, X_PACKED, H // 8,
                            TILE)
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    lim = tl.where(limit > 0, limit, float("inf"))
    a = tl.minimum(g / (1.0 + tl.exp(-g)), lim)  # silu, clamped above
    u = tl.minimum(tl.maximum(u, -lim), lim)
    if ACT_PACKED:
        _store_packed(act_ptr + s * I, rows, a * u * rw, rows >= 0, I, INTERPRET)
    else:
        tl.store(act_ptr + s * I + rows, a * u * rw)


@triton.jit
def mxfp4_moe_stage2_vec_kernel(
    act_ptr, ids_ptr, w2_ptr, s2_ptr, part_ptr, cnt_ptr, y_ptr, add_ptr,
    T: tl.constexpr, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, HAS_ADD: tl.constexpr,
    BN: tl.constexpr, BKW: tl.constexpr, INTERPRET: tl.constexpr = False, PDL: tl.constexpr = False,
    PAIRED: tl.constexpr = False, ACT_PACKED: tl.constexpr = False, FENCE: tl.constexpr = True,
    shw_ptr=None, shs_ptr=None, sha_ptr=None, sh_limit=0.0, SHARED: tl.constexpr = 0, SH_BK: tl.constexpr = 0,
    SH_GU: tl.constexpr = 0, SH_ROW: tl.constexpr = 0,
    res_ptr=None, nw_ptr=None, s_out_ptr=None, h_ptr=None, ssq_ptr=None, eps=0.0, h16_ptr=None, hd_ptr=None,
    NORM: tl.constexpr = False, F16: tl.constexpr = False, TILE: tl.constexpr = True,
    SUM_AT_ONCE: tl.constexpr = False, EVICT: tl.constexpr = "",
):
    """Stage 2 for one token per program (row block nb of BN output rows, slot s) in 16-byte loads, as
    mxfp4_moe_stage1_vec_kernel: every step's down weights and scales are loaded, fenced, and only then
    does the program wait for stage 1 (PDL) and read its act (planes, 16 bytes a load when ACT_PACKED).
    SHARED: as mxfp4_moe_stage2_kernel's."""
    nb = tl.program_id(0)
    s = tl.program_id(1)  # slot t*K + k
    rows = nb * BN + tl.arange(0, BN)
    if SHARED > 0:
        if s >= T * K:
            BSH: tl.constexpr = BN // SHARED
            _shared_down(sha_ptr, shw_ptr, shs_ptr, part_ptr + T * K * H, nb * BN + (s - T * K) * BSH, sh_limit, T,
                         H, I, BSH, SH_BK, SH_GU, SH_ROW, PDL, FENCE and not INTERPRET, EVICT)
        else:
            _stage2_vec_routed(act_ptr, ids_ptr, w2_ptr, s2_ptr, part_ptr, s, rows, H, I, BN, BKW, INTERPRET, PDL,
                               PAIRED, ACT_PACKED, FENCE, TILE, EVICT)
    else:
        _stage2_vec_routed(act_ptr, ids_ptr, w2_ptr, s2_ptr, part_ptr, s, rows, H, I, BN, BKW, INTERPRET, PDL,
                           PAIRED, ACT_PACKED, FENCE, TILE, EVICT)
    _sum_slots(part_ptr, cnt_ptr, y_ptr, add_ptr, nb, rows, T, K, H, 1, BN, HAS_ADD, SHARED,
               (res_ptr, nw_ptr, s_out_ptr, h_ptr, ssq_ptr, eps, h16_ptr, hd_ptr), NORM, F16, INTERPRET, SUM_AT_ONCE)


@triton.jit
def _stage2_vec_routed(act_ptr, ids_ptr, w2_ptr, s2_ptr, part_ptr, s, rows, H: tl.constexpr, I: tl.constexpr,
                       BN: tl.constexpr, BKW: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
                       PAIRED: tl.constexpr, ACT_PACKED: tl.constexpr, FENCE: tl.constexpr, TILE: tl.constexpr,
                       EVICT: tl.constexpr):
    """mxfp4_moe_stage2_vec_kernel's routed programs: slot s -> part[s, rows]."""
    IW: tl.constexpr = I // 8
    IG: tl.constexpr = I // 32
    G: tl.constexpr = BKW // 4
    word = tl.arange(0, BKW)
    e = tl.load(ids_ptr + s).to(tl.int32)  # written by the router, two kernels back: safe before the wait
    w_ptr = w2_ptr + e.to(tl.int64) * (H * IW) + rows[:, None] * IW + word[None, :]
    sc_ptr = s2_ptr + e.to(tl.int64) * (H * IG) + rows[:, None] * IG + tl.arange(0, G)[None, :]
    if TILE:
        sc_ptr += _unaligned_zero(e)
    ws = ()
    ss = ()
    for k in tl.static_range(IW // BKW):
        ws = ws + (tl.load(w_ptr + k * BKW, eviction_policy=EVICT),)
        ss = ss + (tl.load(sc_ptr + k * G, eviction_policy=EVICT),)
    if FENCE and not INTERPRET:
        _issue_fence()
    pdl_wait(PDL)
    base = act_ptr + s * (I // 2 if ACT_PACKED else I)
    acc = tl.zeros([BN, G], dtype=tl.float32)
    for k in tl.static_range(IW // BKW):
        acc += _group_dot(ws[k], ss[k], base, k * BKW + word, INTERPRET, PAIRED, ACT_PACKED, I // 8, TILE)
    tl.store(part_ptr + s * H + rows, tl.sum(acc, axis=1))


@dataclass(frozen=True)
class MoeConfig:
    bn1: int = 16  # gate rows per stage-1 word tile (plus as many up rows)
    rs1: int = 2  # row tiles per stage-1 program, sharing each activation load
    bkw1: int = 32  # int32 words (8 codes each) per step along H
    unroll1: int = 1  # k-loop unroll factor
    warps1: int = 4
    bn2: int = 16  # output rows per stage-2 word tile
    rs2: int = 2
    bkw2: int = 32
    unroll2: int = 1
    warps2: int = 4
    dedupe: bool = True
    prefetch: bool = False  # one-step software pipelining of the k loop
    packed: bool = False  # bf16x2 products (_WORD_DOT_ASM); one token per program, so not with dedupe
    packed_act: bool = False  # stage 1 writes act as stage 2's bf16x2 words (ignored unless packed)
    preload1: bool = False  # stage 1 issues all its weight loads before multiplying (packed only)
    preload2: bool = False  # stage 2 likewise, all of them before its PDL wait
    vec1: bool = False  # stage 1 in 16-byte weight loads, a thread holding whole groups (packed only; preloads)
    maxnreg1: int = 0  # vec1: a register cap for ptxas (0: its choice), so that enough programs fit an SM
    vec2: bool = False  # stage 2 likewise in 16-byte loads, all of them before its PDL wait (packed only)
    tile_x: bool = True  # vec stages: activations and scale bytes loaded in the layout their products use


# Best measured on the H200 at the Ling-3.0-flash shape (H=2560, I=768, K=8); see docs/benchmarks.md.
_TUNED: dict[tuple[int, int, int], MoeConfig] = {
    (1, 2560, 768): MoeConfig(bn1=16, rs1=1, bkw1=64, unroll1=2, warps1=8, bn2=32, rs2=1, bkw2=32, warps2=4,
                              prefetch=True, preload1=True, preload2=True),
    (4, 2560, 768): MoeConfig(bn1=4, rs1=1, bkw1=32, unroll1=2, warps1=1, bn2=8, rs2=1, bkw2=32, warps2=1,
                              dedupe=False),
}


# The stages in 16-byte loads (vec1 / vec2; SPARKCHAT_MOE_VEC, default 3: H200, 2026-12-05, graphed step
# 2.257 -> 2.208 ms and verify of 4 4.14 -> 4.08 ms, docs/benchmarks.md session 23): per shape, stage 1's
# blocks that give each thread 40 weight words (as the preloaded one-token stage 1) under 80 registers;
# stage 2 keeps the tuned blocks.
_VEC1: dict[tuple[int, int, int], dict] = {
    (1, 2560, 768): dict(bn1=16, bkw1=64, warps1=8, maxnreg1=80),
    (4, 2560, 768): dict(bn1=4, bkw1=64, warps1=2, maxnreg1=80),
}


_SHARED_STAGE1_MAXNREG = 80  # stage 1's register cap when it runs the shared expert's gate|up too
_WINDOW_STAGE2_MAXNREG = 64  # stage 2's for several tokens when it runs the shared expert's down, or when
# its one-warp program sums its slots for every token at once (66 registers uncapped, sm_90; capped, no
# stack): what the plain one-warp program takes


def moe_config(T: int, H: int, I: int, vec: int | None = None) -> MoeConfig:
    """Tuned config for this shape, else a default. Several tokens default to per-slot programs: on
    the H200 DEDUPE's shared decode did not pay for its per-token arithmetic and registers (repeated
    experts are re-read from L2, not HBM, when their slots run side by side). Products are bf16x2
    (`packed`) wherever a program serves one token, and stage 1 then hands stage 2 its activations
    already as bf16x2 words (`packed_act`); SPARKCHAT_MOE_PACKED=0 / SPARKCHAT_MOE_PACKED_ACT=0 turn
    those off. The one-token stages issue all their weight loads up front (`preload1`/`preload2`);
    SPARKCHAT_MOE_PRELOAD=0 restores their k loops. SPARKCHAT_MOE_VEC runs the stages in 16-byte loads
    wherever a program serves one token: bit 0 stage 1 (`vec1`), bit 1 stage 2 (`vec2`); 3 both, the
    default; 0 the loads of the preloaded stages (`vec` given: that instead of the variable).
    SPARKCHAT_MOE_TILE_X=0 loads the vec stages' activations as a row and their scales as Triton likes
    (`tile_x` off: the layout before 2026-12-05, which moves them through shared memory; for A/Bs).
    SPARKCHAT_MOE_CONFIG overrides fields for experiments (moe_config_overrides)."""
    cfg = _TUNED.get((T, H, I)) or (MoeConfig() if T == 1 else MoeConfig(dedupe=False))
    one_token = T == 1 or not cfg.dedupe
    packed = one_token and os.environ.get("SPARKCHAT_MOE_PACKED", "1") != "0"
    # packed activations: H200, 2026-12-03, one-token step -0.02..-0.045 ms, 4-token verify -0.09 ms
    if (cfg.preload1 or cfg.preload2) and os.environ.get("SPARKCHAT_MOE_PRELOAD", "1") == "0":
        # the k loops; stage 1's loop was tuned with 4 warps (its 8 serve the preloaded body)
        cfg = replace(cfg, preload1=False, preload2=False, warps1=4 if cfg.preload1 else cfg.warps1)
    vec_bits = os.environ.get("SPARKCHAT_MOE_VEC", "3") if vec is None else str(vec)
    vec = int(vec_bits) if packed and vec_bits.isdigit() else 0
    if vec & 1:
        cfg = replace(cfg, vec1=True, **_VEC1.get((T, H, I), {}))
    if vec & 2:
        cfg = replace(cfg, vec2=True)
    cfg = replace(cfg, **moe_config_overrides(T))
    return replace(cfg, packed=packed,
                   packed_act=packed and os.environ.get("SPARKCHAT_MOE_PACKED_ACT", "1") != "0",
                   tile_x=os.environ.get("SPARKCHAT_MOE_TILE_X", "1") != "0")


def moe_config_overrides(T: int) -> dict:
    """SPARKCHAT_MOE_CONFIG: MoeConfig fields for one window size, e.g. `T1.bkw1:32/T1.warps1:4/T4.bn2:16`
    (`/` between fields, so that profile_step's --switch NAME=V1,V2 can list several), for timing blocks
    in the graphed step, where a config can rank otherwise than alone. "0" or unset: none."""
    return field_overrides("SPARKCHAT_MOE_CONFIG", MoeConfig, f"T{T}",
                           lambda key: key.startswith("T") and key[1:].isdigit(), "T<tokens>")


def pack_moe_x(x: torch.Tensor) -> torch.Tensor:
    """bf16 [T, H] -> bf16 [T, H]: x * 2^100 with element 8w + q stored at 2((q % 4) H/8 + w) + q // 4, so
    that int32 i * H/8 + w is the bf16x2 (x[8w + i], x[8w + i + 4]) a packed stage 1 multiplies (_pack_x
    in planes: a warp loading component i of consecutive words reads consecutive int32s).
    The torch twin of what the add+norm kernel writes for the MoE after it (fp8_gemv, MOE_X)."""
    T, H = x.shape
    c = torch.arange(H, device=x.device)
    q = c % 8
    dest = 2 * ((q % 4) * (H // 8) + c // 8) + q // 4
    out = torch.empty_like(x)
    out[:, dest] = (x.float() * 2.0 ** 100).to(torch.bfloat16)
    return out


@dataclass
class MoeWorkspace:
    """Scratch for one mxfp4_moe call shape; reusable across calls and layers (stream-ordered)."""
    act: torch.Tensor  # fp32 [T*K + 1, I]: the slots' act, then the shared expert's (when fused)
    part: torch.Tensor  # fp32 [T*K + T, H]: the slots' partial outputs, then the shared expert's
    count: torch.Tensor  # int32 [>= H / bn2], zero between launches


def mxfp4_moe_workspace(T: int, K: int, H: int, I: int, device) -> MoeWorkspace:
    """Scratch for one call shape. The counters are shared by every call (each launch leaves them zero):
    a fresh zeroed buffer per call cost a fill kernel per MoE layer."""
    return MoeWorkspace(
        act=torch.empty(T * K + 1, I, dtype=torch.float32, device=device),
        part=torch.empty(T * K + T, H, dtype=torch.float32, device=device),
        count=arrival_counters("mxfp4_moe", device, max(1, H // 4)),
    )


@dataclass(frozen=True)
class SharedExpert:
    """A MoE layer's shared expert in the release's FP8 form, for the routed stages to run alongside
    the routed experts (mxfp4_moe's `shared`): gate|up fused in one weight, down apart, 128 x 128 block
    scales (fp32 scale_inv) — the tensors the shared MLP's own Linear modules hold."""
    gate_up: torch.Tensor  # float8_e4m3fn [>= up + I, H]: gate rows 0..I-1, up rows from `up`
    gate_up_scale: torch.Tensor  # fp32 [rows / 128, ceil(H / 128)]
    up: int  # the up rows' first row (a multiple of 128: FusedLinear pads its parts to whole blocks)
    down: torch.Tensor  # float8_e4m3fn [H, I]
    down_scale: torch.Tensor  # fp32 [ceil(H / 128), ceil(I / 128)]
    limit: float  # its SwiGLU clamp (0: none)

    def unsupported(self, H: int, inter: int) -> str | None:
        """None when the routed stages can run this shared expert for experts of hidden size H and
        intermediate size `inter`, else why not."""
        fp8 = torch.float8_e4m3fn
        if self.gate_up.dtype != fp8 or self.down.dtype != fp8:
            return "the shared expert's weights are not FP8"
        if self.gate_up_scale.dtype != torch.float32 or self.down_scale.dtype != torch.float32:
            return "the shared expert's block scales are not fp32"
        if not (self.gate_up.is_contiguous() and self.down.is_contiguous()
                and self.gate_up_scale.is_contiguous() and self.down_scale.is_contiguous()):
            return "the shared expert's tensors are not contiguous"
        if self.gate_up.shape[1] != H or self.gate_up.shape[0] < self.up + inter or self.up % 128:
            return "the shared expert's gate|up does not match the routed experts' shape"
        if tuple(self.down.shape) != (H, inter):
            return "the shared expert's intermediate size differs from the routed experts'"
        if self.gate_up_scale.shape != (triton.cdiv(self.gate_up.shape[0], 128), triton.cdiv(H, 128)):
            return "the shared expert's gate|up scales are not 128 x 128 blocks"
        if self.down_scale.shape != (triton.cdiv(H, 128), triton.cdiv(inter, 128)):
            return "the shared expert's down scales are not 128 x 128 blocks"
        return None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fit(block: int, n: int) -> int:
    """Largest power of two <= block that divides n."""
    b = block
    while b > 1 and n % b:
        b //= 2
    return b



def mxfp4_moe(
    x: torch.Tensor,  # [T, H] bf16
    topk_ids: torch.Tensor,  # [T, K] int32/int64
    topk_weights: torch.Tensor,  # [T, K] fp32
    w13: torch.Tensor,  # [E, 2I, H/2] uint8
    w13_scale: torch.Tensor,  # [E, 2I, H/32] uint8
    w2: torch.Tensor,  # [E, H, I/2] uint8
    w2_scale: torch.Tensor,  # [E, H, I/32] uint8
    swiglu_limit: float = 0.0,
    *,
    out: torch.Tensor | None = None,  # [T, H] bf16
    add: torch.Tensor | None = None,  # [T, H] bf16 added to the result (the shared expert's output)
    join: Callable[[], None] | None = None,  # called before the launch that reads `add` (side stream)
    workspace: MoeWorkspace | None = None,
    config: MoeConfig | None = None,
    paired: bool = False,  # w13 and w2 in paired word order (kernels/mxfp4_layout.py)
    x_packed: torch.Tensor | None = None,  # x as pack_moe_x lays it out (bf16 [T, H]), or None
    shared: SharedExpert | None = None,  # the shared expert, run by the stages' own extra programs
    shared_gate_up: torch.Tensor | None = None,  # with `shared`: its gate|up GEMV's output (bf16 [1, rows])
    _norm: dict | None = None,  # mxfp4_moe_add_norm's stage-2 arguments
) -> torch.Tensor:
    """Routed MXFP4 experts for T tokens: sum_k w[t,k] * down_e(swiglu_L(gate_e x_t, up_e x_t)) -> bf16 [T, H].

    The experts of one token must be distinct (as top-k gives them); tokens may share experts.
    Pass `out` and `workspace` (mxfp4_moe_workspace) to allocate nothing, e.g. under CUDA graphs.
    `x_packed` (the add+norm kernel writes it): stage 1 reads its bf16x2 words instead of building them
    from x in every program; used where the products are packed, ignored elsewhere.
    `shared` (see shared_fusable): the shared expert's output is computed and added by the
    two stages themselves — its gate|up rows by extra stage-1 programs, its down rows by extra stage-2
    programs, each loading its FP8 weights before its PDL wait — instead of by a side stream's two
    GEMVs joined before stage 2 (`add`, `join`); one token. With `shared_gate_up` (its gate|up GEMV's
    output [T, rows], made on a side stream: pass its `join`) only the down rows run in stage 2, which makes
    their SwiGLU input as it loads it; any window. Same roundings as the shared MLP's kernels.
    """
    T, H = x.shape
    E = w13.shape[0]
    inter = w13.shape[1] // 2
    K = topk_ids.shape[1]
    assert x.dtype == torch.bfloat16 and x.is_contiguous(), "x must be contiguous bf16 [T, H]"
    assert 1 <= T <= 8, f"T={T}: this kernel serves decode windows of 1..8 tokens"
    assert topk_ids.shape == (T, K) and topk_ids.dtype in (torch.int32, torch.int64) and topk_ids.is_contiguous()
    assert topk_weights.shape == (T, K) and topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
    assert H % 32 == 0 and inter % 32 == 0, "H and I must be multiples of the MX group (32)"
    assert w13.dtype == torch.uint8 and w13.shape == (E, 2 * inter, H // 2) and w13.is_contiguous()
    assert w13_scale.dtype == torch.uint8 and w13_scale.shape == (E, 2 * inter, H // 32) and w13_scale.is_contiguous()
    assert w2.dtype == torch.uint8 and w2.shape == (E, H, inter // 2) and w2.is_contiguous()
    assert w2_scale.dtype == torch.uint8 and w2_scale.shape == (E, H, inter // 32) and w2_scale.is_contiguous()
    assert w13.storage_offset() % 4 == 0 and w2.storage_offset() % 4 == 0, "weights must be 4-byte aligned"
    if not interpreting():
        assert x.is_cuda, "mxfp4_moe runs on CUDA (mxfp4_moe_reference is the CPU twin)"
    cfg = config or moe_config(T, H, inter)
    if out is None:
        out = torch.empty(T, H, dtype=torch.bfloat16, device=x.device)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16 and out.is_contiguous()
    if workspace is None:
        workspace = mxfp4_moe_workspace(T, K, H, inter, x.device)
    ws = workspace
    assert ws.act.dtype == torch.float32 and ws.act.numel() >= T * K * inter
    assert ws.part.dtype == torch.float32 and ws.part.numel() >= T * K * H
    use_xp = x_packed is not None and cfg.packed
    if use_xp:
        assert x_packed.shape == (T, H) and x_packed.dtype == torch.bfloat16 and x_packed.is_contiguous()
    if shared is not None:
        assert add is None, "a fused shared expert replaces `add`"
        assert T == 1 or shared_gate_up is not None, "the shared gate|up inside stage 1 serves one token"
        assert (join is None) == (shared_gate_up is None), "join: the side stream making shared_gate_up"
        why = shared.unsupported(H, inter)
        assert why is None, why
        assert ws.act.numel() >= (T * K + 1) * inter and ws.part.numel() >= (T * K + T) * H, "no room for it"
        if shared_gate_up is not None:
            assert shared_gate_up.dtype == torch.bfloat16 and shared_gate_up.is_contiguous()
            assert shared_gate_up.shape == (T, shared.gate_up.shape[0])
    launch = _plan(T, K, H, inter, cfg, paired, x_packed=use_xp, shared_up=None if shared is None else shared.up,
                   shared_stage1=shared_gate_up is None,
                   shared_gate_up_row=0 if shared is None else shared.gate_up.shape[0])
    assert ws.count.dtype == torch.int32 and ws.count.numel() >= launch.grid2[0], "one arrival counter a row block"
    w13_i32, w2_i32 = w13.view(torch.int32), w2.view(torch.int32)
    launch.stage1(x_packed.view(torch.int32) if use_xp else x, topk_ids, topk_weights, w13_i32, w13_scale, ws.act,
                  float(swiglu_limit), shared=shared, x_plain=x)
    if join is not None:
        join()
    if add is not None:
        add = add.contiguous()
        assert add.shape == (T, H) and add.dtype == torch.bfloat16
    if _norm is not None:
        assert ws.count.numel() > launch.grid2[0], "one more arrival counter for the norm"
    launch.stage2(ws.act, topk_ids, w2_i32, w2_scale, ws.part, ws.count, out, add, shared=shared,
                  shared_gate_up=shared_gate_up, norm=_norm)
    return out


def mxfp4_moe_add_norm(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
    w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, swiglu_limit: float,
    residual: torch.Tensor,  # [T, H] bf16: the residual stream the layer's output is added to
    norm_w: torch.Tensor,  # [H] bf16: the next RMSNorm's weight
    eps: float,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer and the residual add + RMSNorm after it (the next layer's input norm):
    ops.add_rms_norm(residual, mxfp4_moe(...), norm_w, eps) -> (s, norm(s)), bf16 [T, H] each, with the
    add and the norm done by stage 2's last programs (_sum_slots) instead of a kernel of their own.
    Windows the tensor-core GEMVs serve also get the norm's fp16 form (`h.f16_acts`, as the add+norm
    kernel gives it). kwargs: mxfp4_moe's."""
    from sparkchat.engine.kernels.fp8_gemv import _f16_outputs

    T, H = x.shape
    assert residual.shape == (T, H) and residual.dtype == torch.bfloat16 and residual.is_contiguous()
    assert norm_w.shape == (H,) and norm_w.dtype == torch.bfloat16 and norm_w.is_contiguous()
    s_out = torch.empty_like(residual)
    h = torch.empty_like(residual)
    cfg = kwargs.get("config") or moe_config(T, H, w13.shape[1] // 2)
    bn2 = _fit(cfg.bn2, H)
    ssq = torch.empty(T, H // bn2, dtype=torch.float32, device=x.device)
    f16 = _f16_outputs(h)
    norm = dict(res_ptr=residual, nw_ptr=norm_w, s_out_ptr=s_out, h_ptr=h, ssq_ptr=ssq, eps=float(eps), NORM=True,
                h16_ptr=f16.get("h16_ptr"), hd_ptr=f16.get("hd_ptr"), F16=f16.get("F16", False))
    mxfp4_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, swiglu_limit, _norm=norm, **kwargs)
    return s_out, h


def mxfp4_moe_add_sumsq(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
    w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, swiglu_limit: float,
    residual: torch.Tensor,  # [T, H] bf16: the residual stream the layer's output is added to
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer and the first half of the RMSNorm after it: (s, sums of squares) where s = residual +
    mxfp4_moe(...) (bf16 [T, H], as ops.add_rms_norm rounds it) and the sums of squares of s are fp32
    [T, H / tile] by stage-2 row tile. The GEMV that reads the norm's output finishes it as it loads s
    (fp8_gemv.SplitNorm): no launch, and no serial last block, for the norm. kwargs: mxfp4_moe's."""
    T, H = x.shape
    assert residual.shape == (T, H) and residual.dtype == torch.bfloat16 and residual.is_contiguous()
    s_out = torch.empty_like(residual)
    cfg = kwargs.get("config") or moe_config(T, H, w13.shape[1] // 2)
    ssq = torch.empty(T, H // _fit(cfg.bn2, H), dtype=torch.float32, device=x.device)
    norm = dict(res_ptr=residual, s_out_ptr=s_out, ssq_ptr=ssq, NORM=2)
    mxfp4_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, swiglu_limit, _norm=norm, **kwargs)
    return s_out, ssq


def shared_fusable(shared: SharedExpert, T: int, H: int, inter: int, config: MoeConfig | None = None,
                   stage1: bool = True) -> bool:
    """True when mxfp4_moe can run `shared` inside its stages for T tokens of these shapes: a shared
    expert whose FP8 weights match the routed experts' shape (Ling-3.0-flash's: I = 768), and one token
    where its gate|up runs in stage 1 too (`stage1`), a decode window where only its down does."""
    cfg = config or moe_config(T, H, inter)
    return ((T == 1 or not stage1 and T <= 8) and shared.unsupported(H, inter) is None
            and _shared_split(cfg, inter, H) is not None)


def _shared_split(cfg: MoeConfig, inter: int, H: int) -> tuple[int, int] | None:
    """The shared expert's programs per stage-1 row block and per stage-2 row block: two, so that each
    reads about what a routed program reads (FP8 is twice the bytes of MXFP4 a weight), on fewer rows
    when a block holds fewer than two; None when a block's rows would not divide evenly."""
    bn1, bn2 = _fit(cfg.bn1, inter), _fit(cfg.bn2, H)
    rows1 = bn1 if cfg.vec1 and cfg.packed else bn1 * _fit(cfg.rs1, inter // bn1)
    rows2 = bn2 if cfg.vec2 and cfg.packed else bn2 * _fit(cfg.rs2, H // bn2)
    split1, split2 = min(2, rows1), min(2, rows2)
    if rows1 % split1 or rows2 % split2 or 128 % (rows1 // split1) or 128 % (rows2 // split2):
        return None
    return split1, split2


@dataclass(frozen=True)
class _Plan:
    """Grids and constexprs of both stages for one (T, K, H, I, config); the benchmark times them apart."""
    grid1: tuple
    grid2: tuple
    meta1: dict
    meta2: dict

    vec1: bool = False
    vec2: bool = False

    def eviction(self, device: torch.device) -> str:
        """Both stages' weight loads' L2 hint: one token's (bit 1) or a window's (bit 4), weight_eviction."""
        return weight_eviction(1 if self.meta2["T"] == 1 else 4, device)

    def stage1(self, x, ids, rw, w13_i32, s13, act, limit: float, shared: SharedExpert | None = None,
               x_plain: torch.Tensor | None = None) -> None:
        """`shared` (a plan made with shared=True): x_plain is the token's bf16 x; the shared expert's
        act goes to act's row T*K."""
        extra = {}
        if self.meta1.get("SHARED", 0):
            extra = dict(xs_ptr=x_plain, shw_ptr=shared.gate_up, shs_ptr=shared.gate_up_scale,
                         sha_ptr=act[-1], sh_limit=float(shared.limit))
        act = act.view(torch.bfloat16) if self.meta1["ACT_PACKED"] else act  # the fp32 workspace, reused
        kernel = mxfp4_moe_stage1_vec_kernel if self.vec1 else mxfp4_moe_stage1_kernel
        evict = self.eviction(x.device)
        if evict:
            extra["EVICT"] = evict
        kernel[self.grid1](x, ids, rw, w13_i32, s13, act, limit, **self.meta1, **extra, **pdl_args(x.device))

    def stage2(self, act, ids, w2_i32, s2, part, count, out, add=None, shared: SharedExpert | None = None,
               shared_gate_up: torch.Tensor | None = None, norm: dict | None = None) -> None:
        """`shared`: its act is act's row T*K (made by stage 1), or with a plan for it, shared_gate_up.
        `norm`: the add + RMSNorm after the layer (mxfp4_moe_add_norm's arguments)."""
        extra = dict(norm or {})
        if self.meta2.get("SHARED", 0):
            src = shared_gate_up if self.meta2["SH_GU"] else act[-1]
            extra.update(shw_ptr=shared.down, shs_ptr=shared.down_scale, sha_ptr=src, sh_limit=float(shared.limit))
        act = act.view(torch.int32) if self.meta2["ACT_PACKED"] else act
        kernel = mxfp4_moe_stage2_vec_kernel if self.vec2 else mxfp4_moe_stage2_kernel
        evict = self.eviction(act.device)
        if evict:
            extra["EVICT"] = evict
        kernel[self.grid2](act, ids, w2_i32, s2, part, count, out, out if add is None else add,
                           HAS_ADD=add is not None, **self.meta2, **extra, **pdl_args(act.device))


def _plan(T: int, K: int, H: int, inter: int, cfg: MoeConfig, paired: bool = False, x_packed: bool = False,
          shared_up: int | None = None, shared_stage1: bool = True, shared_gate_up_row: int = 0) -> _Plan:
    """shared_up: plan the shared expert's programs too (SharedExpert.up, its up rows' first row): its
    gate|up in stage 1 and down in stage 2, or (shared_stage1 False) only its down, in stage 2, from the
    gate|up GEMV's output (rows of shared_gate_up_row columns)."""
    dedupe = cfg.dedupe and T > 1
    bn1, bkw1 = _fit(cfg.bn1, inter), max(4, _fit(cfg.bkw1, H // 8))
    bn2, bkw2 = _fit(cfg.bn2, H), max(4, _fit(cfg.bkw2, inter // 8))
    rs1, rs2 = _fit(cfg.rs1, inter // bn1), _fit(cfg.rs2, H // bn2)
    assert not (cfg.packed and dedupe), "packed products serve one token per program: use dedupe=False"
    common = dict(T=T, K=K, H=H, I=inter, NT=_pow2(T) if dedupe else 1, K_PAD=_pow2(K), S_PAD=_pow2(T * K),
                  DEDUPE=dedupe, PREFETCH=cfg.prefetch, PACKED=cfg.packed, INTERPRET=interpreting(), PAIRED=paired,
                  ACT_PACKED=cfg.packed and cfg.packed_act)  # it feeds the bf16x2 stage 2 only
    vec1, vec2 = cfg.vec1 and cfg.packed, cfg.vec2 and cfg.packed  # one token a program, whole groups a thread
    if vec1:
        meta1 = dict(K=K, H=H, I=inter, BN=bn1, BKW=bkw1, INTERPRET=common["INTERPRET"], PAIRED=paired,
                     ACT_PACKED=common["ACT_PACKED"], X_PACKED=x_packed, TILE=cfg.tile_x, num_warps=cfg.warps1,
                     **({"maxnreg": cfg.maxnreg1} if cfg.maxnreg1 else {}))
    else:
        meta1 = dict(common, BN=bn1, RS=rs1, BKW=bkw1, UNROLL=cfg.unroll1, num_warps=cfg.warps1,
                     X_PACKED=x_packed and cfg.packed, PRELOAD=cfg.preload1 and cfg.packed)
    if vec2:
        rs2 = 1
        meta2 = dict(T=T, K=K, H=H, I=inter, BN=bn2, BKW=bkw2, INTERPRET=common["INTERPRET"], PAIRED=paired,
                     ACT_PACKED=common["ACT_PACKED"], TILE=cfg.tile_x, num_warps=cfg.warps2)
    else:
        meta2 = dict(common, BN=bn2, RS=rs2, BKW=bkw2, UNROLL=cfg.unroll2, num_warps=cfg.warps2,
                     PRELOAD=cfg.preload2 and cfg.packed)
    meta2.update(SUM_AT_ONCE=T > 1 and bool(tail_at_once() & 2))
    if meta2["SUM_AT_ONCE"] and cfg.warps2 == 1:  # a cap, not a target: ptxas fills what it is given
        meta2["maxnreg"] = _WINDOW_STAGE2_MAXNREG
    extra1 = extra2 = 0
    meta1.update(SHARED=0, SH_UP=0, SH_BK=0)
    meta2.update(SHARED=0, SH_BK=0, SH_GU=0, SH_ROW=0)
    if shared_up is not None:  # the shared expert's programs: extra slots after the routed ones
        assert T == 1 or not shared_stage1, "the shared gate|up inside stage 1 serves one token"
        split = _shared_split(cfg, inter, H)
        assert split is not None, "the stages' row blocks do not divide between shared-expert programs"
        extra1, extra2 = split
        if shared_stage1:
            meta1.update(SHARED=extra1, SH_UP=shared_up, SH_BK=_fit(512, H))
            # the shared branch alone would take 118 registers (sm_90) where the routed one takes 78: capped,
            # the routed programs keep 3 of 8 warps an SM (the shared branch spills a little instead)
            meta1.setdefault("maxnreg", _SHARED_STAGE1_MAXNREG)
        else:
            extra1 = 0
            assert shared_up > 0, "the up rows follow the gate rows"
        # a k step of one 16-byte vector a thread: wider steps keep more of the act (and with several
        # tokens their SwiGLU inputs) live at once (T = 4, one warp: 164 registers at 256 columns)
        rows2 = (bn2 if vec2 else bn2 * rs2) // extra2
        meta2.update(SHARED=extra2, SH_BK=_fit(min(256, max(16, _pow2(16 * 32 * cfg.warps2 // rows2))), inter),
                     SH_GU=0 if shared_stage1 else shared_up)
        meta2.update(SH_ROW=0 if shared_stage1 else shared_gate_up_row)
        if T > 1:  # the shared branch's T accumulators would take the one-warp programs from 64 registers to
            meta2.setdefault("maxnreg", _WINDOW_STAGE2_MAXNREG)  # 128 (sm_90), halving how many fit an SM
    return _Plan(grid1=(T * K + extra1, inter // (bn1 if vec1 else bn1 * rs1)),
                 grid2=(H // (bn2 * rs2), T * K + extra2),
                 meta1=meta1, meta2=meta2, vec1=vec1, vec2=vec2)


@triton.jit
def permute_words_kernel(src_ptr, dst_ptr, n, INVERSE: tl.constexpr, BLOCK: tl.constexpr):
    """Each int32 word of 8 E2M1 codes into paired order or back (kernels/mxfp4_layout.py, MOVES)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    w = tl.load(src_ptr + offs, mask=m, other=0).to(tl.int64) & 0xFFFFFFFF
    if INVERSE:
        v = (((w & 0x00380038) << 5) | ((w & 0x00070007) << 4) | ((w & 0x0C000C00) << 2)
             | ((w & 0x60006000) << 1) | ((w & 0x10001000) >> 1) | ((w & 0x02000200) >> 2)
             | ((w & 0x01C001C0) >> 6) | ((w & 0x80008000) >> 12))
    else:
        v = (((w & 0x07000700) >> 5) | ((w & 0x00700070) >> 4) | ((w & 0x30003000) >> 2)
             | ((w & 0xC000C000) >> 1) | ((w & 0x08000800) << 1) | ((w & 0x00800080) << 2)
             | ((w & 0x00070007) << 6) | ((w & 0x00080008) << 12))
    tl.store(dst_ptr + offs, v.to(tl.uint32).to(tl.int32, bitcast=True), mask=m)


def permute_words(src: torch.Tensor, dst: torch.Tensor, inverse: bool) -> torch.Tensor:
    """MXFP4 bytes src -> dst (may be src: elementwise, in place is safe) in paired order, or back to the
    checkpoint's with `inverse`. Use kernels/mxfp4_layout.py's permute_words_ / unpair_words."""
    assert src.dtype == dst.dtype == torch.uint8 and src.shape == dst.shape
    assert src.is_contiguous() and dst.is_contiguous() and src.shape[-1] % 4 == 0
    n = src.numel() // 4
    block = 1024
    permute_words_kernel[(triton.cdiv(n, block),)](src.view(torch.int32), dst.view(torch.int32), n,
                                                   INVERSE=inverse, BLOCK=block)
    return dst

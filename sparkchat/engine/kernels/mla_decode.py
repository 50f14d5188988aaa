"""A whole MLA decode/verify step after the input projections, in three Triton launches (the twin is
nn.mla.absorbed_step: mla_prepare, mla_absorbed, the per-head gate).

Decode and verify steps (T <= 8 tokens) attend over a fixed bucket of cache rows; what matters is reading
the cache once and keeping the step's launches few and chained (PDL):
1. `mla_prepare_kernel`: kv_b_proj's key half folded into the query (q_latent = q_nope · W_uk per head),
   RoPE on the query's rope dims, and in one extra program the latent's RMSNorm, the shared key's RoPE,
   both cache writes at the tokens' positions and the per-head output gate.
2. `mla_decode_split_kernel`, flash-decoding style: all heads share one latent C and one rope key per
   row, so a program takes a tile of BLOCK_M query rows (flattened (token, head) pairs: at the real shapes,
   one token's 32 heads) and streams its cache rows once for all of them: scores = q_latent·C + q_rope·KR
   on tensor cores, an fp32 online softmax with the causal-by-position mask, probs·C into an fp32
   [BLOCK_M, rank] accumulator. (All T tokens' heads in one program would need T x 64 KiB of
   accumulator; instead the T tiles of a cache range are launched side by side and share it through L2.)
   The live rows are split over S programs per tile so short contexts still fill the GPU. Rows past
   max(pos)+1 are never read and each program splits that live length, not the bucket, so a graph
   captured for a large bucket stays cheap at small positions.
3. `mla_combine_unfold_kernel`: merges the S partials by log-sum-exp, unfolds the latent with
   kv_b_proj's value half (W_uv) and applies the gate, writing the output projection's input [T, heads*v].
Each rounds to bf16 where the twin does: q_latent, the roped and normed values, o_latent, the unfolded
output and its gated product (the twin also rounds its scores and probabilities; the kernel keeps the
scores in fp32).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.device import interpreting, max_shared_memory
from sparkchat.engine.kernels.overrides import field_overrides
from sparkchat.engine.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def _round_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32: the GPU's cvt.rn, by bit
    arithmetic, because Triton's CPU interpreter truncates fp32->bf16 casts."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + (0x7FFF + ((b >> 16) & 1))) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    """a @ b with fp32 accumulation. The interpreter's tl.dot multiplies bf16 bit patterns as integers,
    so there the bf16 operands go in as fp32 (exact, like the tensor cores' bf16 products)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attend_block(q, qpe, c_ptr, kr_ptr, s_c, s_kr, pos, n0, end, qk_scale, m_i, l_i, acc,
                  R: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """One cache block [n0, n0+BLOCK_N) (rows >= end masked) folded into the online-softmax state."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < end
    c = tl.load(c_ptr + cols[:, None] * s_c + tl.arange(0, R)[None, :], mask=col_ok[:, None], other=0.0)  # [BN, R]
    kr = tl.load(kr_ptr + cols[:, None] * s_kr + tl.arange(0, P)[None, :], mask=col_ok[:, None], other=0.0)
    s = _dot(q, tl.trans(c), INTERPRET) + _dot(qpe, tl.trans(kr), INTERPRET)  # fp32 [BM, BN]
    # query t sees rows 0..pos[t]; rows past it in the bucket are stale (or another token's future)
    vis = (cols[None, :] <= pos[:, None]) & col_ok[None, :]
    s = tl.where(vis, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing visible yet (a later token's split, or padding) keeps m = -inf: shift by 0
    # there, so exp2 gives 0 instead of exp2(-inf - -inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    pr = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    # probs·C on tensor cores with the probabilities in bf16, as the twin rounds them
    if INTERPRET:
        acc = acc * alpha[:, None] + _dot(_round_bf16(pr), c, INTERPRET)
    else:
        acc = acc * alpha[:, None] + _dot(pr.to(c.dtype), c, INTERPRET)
    return m_new, l_i, acc


@triton.jit
def mla_decode_split_kernel(
    ql_ptr, qr_ptr, c_ptr, kr_ptr, pos_ptr, po_ptr, plse_ptr,
    attend, S, qk_scale,  # qk_scale = softmax scale * log2(e): the softmax runs in base 2
    s_ql_t, s_ql_h, s_qr_t, s_qr_h, s_c, s_kr,
    H: tl.constexpr, M: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr, ITERS: tl.constexpr,  # ITERS: the interpreter's loop bound only (0 on GPUs)
    PDL: tl.constexpr = False,
):
    """Query rows [pid_m*BLOCK_M, +BLOCK_M) (row = t*H + head) over split pid_s of the live cache rows.
    Writes the split's normalized output po[pid_s, row, :R] (fp32) and its base-2 log-sum-exp."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pdl_wait(PDL)  # q_latent and this step's cache rows come from the kernel before
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    t = rows // H
    hh = rows % H
    # padded rows (past M) get position 0: they see row 0 only, so stay finite, and are never stored
    pos = tl.load(pos_ptr + t, mask=row_ok, other=0).to(tl.int32)
    # The live length of this tile (its last token sees rows 0..max pos), split evenly in whole blocks.
    kv_len = tl.minimum(tl.max(pos, axis=0) + 1, attend)
    split_len = tl.cdiv(tl.cdiv(kv_len, S), BLOCK_N) * BLOCK_N
    start = pid_s * split_len
    end = tl.minimum(start + split_len, kv_len)

    r = tl.arange(0, R)
    p = tl.arange(0, P)
    q = tl.load(ql_ptr + t[:, None] * s_ql_t + hh[:, None] * s_ql_h + r[None, :], mask=row_ok[:, None], other=0.0)
    qpe = tl.load(qr_ptr + t[:, None] * s_qr_t + hh[:, None] * s_qr_h + p[None, :], mask=row_ok[:, None],
                  other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, R], tl.float32)
    if INTERPRET:
        # The interpreter cannot loop to a tensor bound: walk the split's largest possible block count
        # (from the bucket) instead; blocks at or past `end` are fully masked and change nothing.
        for i in range(0, ITERS):
            m_i, l_i, acc = _attend_block(q, qpe, c_ptr, kr_ptr, s_c, s_kr, pos, start + i * BLOCK_N, end, qk_scale,
                                          m_i, l_i, acc, R, P, BLOCK_N, INTERPRET)
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_block(q, qpe, c_ptr, kr_ptr, s_c, s_kr, pos, n0, end, qk_scale, m_i, l_i, acc,
                                          R, P, BLOCK_N, INTERPRET)
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(po_ptr + (pid_s * M + rows[:, None]) * R + r[None, :], o, mask=row_ok[:, None])
    tl.store(plse_ptr + pid_s * M + rows, lse, mask=row_ok)


@triton.jit
def _rope_pairs(x_ptr, c, sn, mask, P: tl.constexpr):
    """RoPE on P interleaved values at x_ptr (a [..] block of pointers to their starts, loaded where mask)
    with cos/sin c, sn (bf16-rounded, [.., P/2]): returns the rotated evens and odds, rounded as the
    twin's bf16 ops round."""
    i2 = 2 * tl.arange(0, P // 2)
    x1 = tl.load(x_ptr + i2, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + i2 + 1, mask=mask, other=0.0).to(tl.float32)
    ev = _round_bf16(_round_bf16(x1 * c) - _round_bf16(x2 * sn))
    od = _round_bf16(_round_bf16(x2 * c) + _round_bf16(x1 * sn))
    return ev, od


@triton.jit
def mla_prepare_kernel(
    q_ptr, kv_ptr, g_ptr, cos_ptr, sin_ptr, pos_ptr, lat_ptr, krc_ptr, nw_ptr, w_ptr,
    ql_ptr, qr_ptr, gate_ptr,
    eps, s_q, s_kv, s_g, s_cs, s_lat, s_krc, s_wh, s_wn,
    T: tl.constexpr, H: tl.constexpr, NOPE: tl.constexpr, P: tl.constexpr, R: tl.constexpr,
    BLOCK_R: tl.constexpr, HP: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
):
    """Programs 0 .. H*R/BLOCK_R-1: head h's q_latent columns [rb*BLOCK_R, +BLOCK_R) for all T tokens
    (and, for rb = 0, the head's roped q); the last program: latent norm, rope key, cache writes, gate.
    Outputs: q_latent [T, H, R], q_rope [T, H, P] (bf16), gate [T, H] (bf16)."""
    pid = tl.program_id(0)
    NRB: tl.constexpr = R // BLOCK_R
    t = tl.arange(0, 16)  # T <= 8 tokens padded to tl.dot's 16 rows
    tok = t < T
    i = tl.arange(0, P // 2)
    if pid < H * NRB:
        h = pid // NRB
        rb = pid % NRB
        n = tl.arange(0, NOPE)
        r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        w = tl.load(w_ptr + h * s_wh + n[:, None] * s_wn + r[None, :])  # W_uk tile: a weight, read pre-wait
        pdl_wait(PDL)
        qn = tl.load(q_ptr + t[:, None] * s_q + h * (NOPE + P) + n[None, :], mask=tok[:, None], other=0.0)
        ql = _round_bf16(_dot(qn, w, INTERPRET))  # [16, BLOCK_R]: the twin's bf16 q_latent
        tl.store(ql_ptr + (t[:, None] * H + h) * R + r[None, :], ql.to(ql_ptr.dtype.element_ty), mask=tok[:, None])
        if rb == 0:
            pos = tl.load(pos_ptr + t, mask=tok, other=0)
            c = _round_bf16(tl.load(cos_ptr + pos[:, None] * s_cs + i[None, :]))  # the twin casts cos/sin to bf16
            sn = _round_bf16(tl.load(sin_ptr + pos[:, None] * s_cs + i[None, :]))
            ev, od = _rope_pairs(q_ptr + t[:, None] * s_q + h * (NOPE + P) + NOPE, c, sn, tok[:, None], P)
            out = qr_ptr + (t[:, None] * H + h) * P + i[None, :]
            tl.store(out, ev.to(qr_ptr.dtype.element_ty), mask=tok[:, None])
            tl.store(out + P // 2, od.to(qr_ptr.dtype.element_ty), mask=tok[:, None])
    else:
        rr = tl.arange(0, R)
        nw = tl.load(nw_ptr + rr).to(tl.float32)
        hh = tl.arange(0, HP)
        pdl_wait(PDL)
        for tt in tl.static_range(T):
            p = tl.load(pos_ptr + tt)
            x = tl.load(kv_ptr + tt * s_kv + rr).to(tl.float32)
            y = _round_bf16(x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / R + eps)))  # rms_norm's cast, then w *
            tl.store(lat_ptr + p * s_lat + rr, _round_bf16(nw * y).to(lat_ptr.dtype.element_ty))
            c = _round_bf16(tl.load(cos_ptr + p * s_cs + i))
            sn = _round_bf16(tl.load(sin_ptr + p * s_cs + i))
            ev, od = _rope_pairs(kv_ptr + tt * s_kv + R, c, sn, i < P // 2, P)
            tl.store(krc_ptr + p * s_krc + i, ev.to(krc_ptr.dtype.element_ty))
            tl.store(krc_ptr + p * s_krc + P // 2 + i, od.to(krc_ptr.dtype.element_ty))
            gl = tl.load(g_ptr + tt * s_g + hh, mask=hh < H, other=0.0).to(tl.float32)
            tl.store(gate_ptr + tt * H + hh, _round_bf16(tl.sigmoid(gl)).to(gate_ptr.dtype.element_ty), mask=hh < H)


@triton.jit
def _merge_splits(po_ptr, plse_ptr, row, S, chunks, M: tl.constexpr, R: tl.constexpr, SC: tl.constexpr):
    """Query row `row`'s S split partials merged by exp2(lse_s - lse), rounded to bf16 (the twin's
    o_latent), [R] fp32. One pass, SC splits at a time, rescaling as the running max grows: a chunk's
    loads do not wait on the one before (at 1K context all S splits are one chunk)."""
    sc = tl.arange(0, SC)
    rr = tl.arange(0, R)
    m = tl.full([], float("-inf"), tl.float32)
    denom = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([R], tl.float32)
    for c in range(0, chunks):
        ss = c * SC + sc
        lse = tl.load(plse_ptr + ss * M + row, mask=ss < S, other=float("-inf"))
        part = tl.load(po_ptr + (ss[:, None] * M + row) * R + rr[None, :], mask=(ss < S)[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        # splits that saw nothing have lse = -inf; until one has, shift by 0 (exp2(-inf) = 0, not NaN)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        wt = tl.exp2(lse - m_safe)
        denom = denom * alpha + tl.sum(wt, axis=0)
        acc = acc * alpha + tl.sum(wt[:, None] * part, axis=0)
        m = m_new
    # denom > 0: the split holding cache row 0 sees something for every row
    return _round_bf16(acc / denom)


@triton.jit
def mla_combine_unfold_kernel(
    po_ptr, plse_ptr, w_ptr, gate_ptr, out_ptr, S, s_wh, s_wn, s_out,
    T: tl.constexpr, H: tl.constexpr, M: tl.constexpr, R: tl.constexpr, NOPE: tl.constexpr, V: tl.constexpr,
    BLOCK_V: tl.constexpr, SC: tl.constexpr, INTERPRET: tl.constexpr, CHUNKS: tl.constexpr,
    PDL: tl.constexpr = False,  # CHUNKS: cdiv(S, SC), the interpreter's loop bound only (0 on GPUs)
    MODE: tl.constexpr = 0,  # how a window's tokens share the work (MlaDecodeConfig.combine)
):
    """Head program_id(0), value columns [program_id(1)*BLOCK_V, +BLOCK_V), for all T tokens (MODE 2: for
    token program_id(2) only): merge the S split partials of the head's row by exp2(lse_s - lse), round
    (the twin's bf16 o_latent), unfold with W_uv, round, times the gate, round: out[t, h*V + v]. S is a
    runtime value so buckets share code. MODE 0: one token after another (each token's loads wait for the
    stores before them: the compiler cannot move a load above a store that may alias it); 1: every
    token's output made before any is stored; 2: a program per token."""
    h = tl.program_id(0)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rr = tl.arange(0, R)
    v_ok = v < V
    w = tl.load(w_ptr + h * s_wh + (NOPE + v)[:, None] * s_wn + rr[None, :], mask=v_ok[:, None],
                other=0.0).to(tl.float32)  # W_uv, a weight: read pre-wait
    pdl_wait(PDL)
    if MODE == 2:
        tt = tl.program_id(2)
        y = _unfold_token(po_ptr, plse_ptr, gate_ptr, w, tt, h, S, H, M, R, SC, INTERPRET, CHUNKS)
        tl.store(out_ptr + tt * s_out + h * V + v, y.to(out_ptr.dtype.element_ty), mask=v_ok)
    elif MODE == 1:
        ys = ()
        for tt in tl.static_range(T):
            ys = ys + (_unfold_token(po_ptr, plse_ptr, gate_ptr, w, tt, h, S, H, M, R, SC, INTERPRET, CHUNKS),)
        for tt in tl.static_range(T):
            tl.store(out_ptr + tt * s_out + h * V + v, ys[tt].to(out_ptr.dtype.element_ty), mask=v_ok)
    else:
        for tt in tl.static_range(T):
            y = _unfold_token(po_ptr, plse_ptr, gate_ptr, w, tt, h, S, H, M, R, SC, INTERPRET, CHUNKS)
            tl.store(out_ptr + tt * s_out + h * V + v, y.to(out_ptr.dtype.element_ty), mask=v_ok)


@triton.jit
def _unfold_token(po_ptr, plse_ptr, gate_ptr, w, tt, h, S, H: tl.constexpr, M: tl.constexpr, R: tl.constexpr,
                  SC: tl.constexpr, INTERPRET: tl.constexpr, CHUNKS: tl.constexpr):
    """Token tt's output columns of head h (w: their W_uv rows, fp32 [BLOCK_V, R]): merged, unfolded,
    gated, each step rounded to bf16 as the twin rounds."""
    if INTERPRET:  # the interpreter cannot loop to a scalar argument
        o = _merge_splits(po_ptr, plse_ptr, tt * H + h, S, CHUNKS, M, R, SC)
    else:
        o = _merge_splits(po_ptr, plse_ptr, tt * H + h, S, tl.cdiv(S, SC), M, R, SC)
    y = _round_bf16(tl.sum(w * o[None, :], axis=1))
    gt = tl.load(gate_ptr + tt * H + h).to(tl.float32)
    return _round_bf16(y * gt)


@dataclass(frozen=True)
class MlaDecodeConfig:
    """Launch shape. block_m 32 keeps one token's 32 heads and the fp32 [32, 512] accumulator in one
    program (64 registers a thread at 8 warps). block_n 64 was faster than 32 in the graphed step on the
    H200 (docs/benchmarks.md, session 11). The split kernel's shared memory grows with block_n (compiled
    at the Ling shapes: 132 KiB at 64, 100 KiB at 32, 60 KiB at 16, on sm_90 and sm_121 alike), so
    `default_config` halves it until it fits the device (sm_12x such as the DGX Spark: 99 KiB, so 16)."""

    block_m: int = 32  # query rows (token, head) per program; >= 16 for tl.dot
    block_n: int = 64  # cache rows per step
    warps: int = 8
    stages: int = 2
    # Rows per split at least: a split writes block_m x (rank + 1) fp32 partials (64 KiB at 32 x 512),
    # about what 64 rows of cache are (72 KiB); shorter splits would move more partials than cache.
    min_rows: int = 64
    programs: int | None = None  # target programs per launch; None: the device's SM count
    prepare_block_r: int = 64  # q_latent columns per fold program: heads x rank/64 programs
    unfold_block_v: int = 32  # output columns per unfold program: heads x v_dim/32 programs
    unfold_warps: int = 8  # holds a [32, rank] W_uv tile and a [16, rank] fp32 tile of partials
    combine_chunk: int = 16  # splits merged at a time: the 16 splits of a 1K context in one go
    # a verify window's tokens in the merge + unfold (mla_combine_unfold_kernel's MODE): 0 one after another
    # in each program, 1 all made before any is stored, 2 a program each (SPARKCHAT_MLA_COMBINE). 2 by
    # default: H100 4-token verify traces, 15.9 -> 13.1 µs exposed a call (1: 14.3), the same output bits
    combine: int = 2


def split_smem_estimate(block_m: int, block_n: int, stages: int, rank: int, rope: int) -> int:
    """The split kernel's shared memory, an upper estimate: `stages` bf16 cache tiles [block_n, rank + rope]
    and the query's [block_m, rank] (tests/test_sass.py holds it to Triton's own figure)."""
    return stages * block_n * (rank + rope) * 2 + block_m * rank * 2


def config_overrides(T: int) -> dict:
    """SPARKCHAT_MLA_CONFIG: MlaDecodeConfig fields for T-token steps, `<T>.<field>:<value>` joined by `/`
    (e.g. `1.block_m:16/1.warps:4`), for timing launch shapes inside the graphed step (profile_step
    --switch). "0" or unset: none."""
    return field_overrides("SPARKCHAT_MLA_CONFIG", MlaDecodeConfig, str(T), str.isdigit, "<T>")


def default_config(device: torch.device, rank: int, rope: int, T: int = 1) -> MlaDecodeConfig:
    """MlaDecodeConfig() (with SPARKCHAT_MLA_CONFIG's fields for T tokens) with block_n halved until the
    split kernel fits `device`'s shared memory."""
    cfg = replace(MlaDecodeConfig(), **config_overrides(T))
    cfg = replace(cfg, combine=int(os.environ.get("SPARKCHAT_MLA_COMBINE", str(cfg.combine))))
    limit = max_shared_memory(device)
    block_n = cfg.block_n
    while block_n > 16 and split_smem_estimate(cfg.block_m, block_n, cfg.stages, rank, rope) > 0.9 * limit:
        block_n //= 2
    return cfg if block_n == cfg.block_n else replace(cfg, block_n=block_n)



@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _block_m(M: int, cfg: MlaDecodeConfig) -> int:
    return min(cfg.block_m, max(16, triton.next_power_of_2(M)))  # small models: fewer idle rows


def num_splits(T: int, heads: int, attend: int, device: torch.device, config: MlaDecodeConfig | None = None) -> int:
    """How many programs share each tile's cache rows: about one wave of programs in all, no split
    shorter than min_rows. A host-side function of shapes only (attend is fixed per CUDA graph)."""
    cfg = config or MlaDecodeConfig()
    tiles = triton.cdiv(T * heads, _block_m(T * heads, cfg))
    target = cfg.programs or (_sm_count(device.index or 0) if device.type == "cuda" else 8)
    return max(1, min(target // tiles, triton.cdiv(attend, cfg.min_rows)))


def mla_decode_step(q: torch.Tensor, kv_a: torch.Tensor, g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    pos: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor, norm_w: torch.Tensor,
                    eps: float, w_kv: torch.Tensor, attend: int, scale: float, nope: int, *,
                    splits: int | None = None, config: MlaDecodeConfig | None = None) -> torch.Tensor:
    """nn.mla.absorbed_step's result, the output projection's input [T, heads * v_dim], with the mask
    given as positions: query t sees cache rows 0..pos[t] of the first `attend` rows. q [T, heads*(nope+rope)],
    kv_a [T, rank+rope] and g [T, heads] are the input projections' outputs (row-strided views are fine);
    the latent and rope key of each token are written into the caches at pos, as mla_prepare does."""
    T = q.shape[0]
    H, _, R = w_kv.shape
    P = rope_cache.shape[1]
    cfg = config or default_config(q.device, R, P, T)
    V = w_kv.shape[1] - nope
    assert 1 <= T <= 8, "decode and verify windows only (prefill expands the latents)"
    assert q.shape[1] == H * (nope + P) and kv_a.shape[1] == R + P and g.shape[1] == H, "shapes disagree"
    assert pos.shape == (T,) and pos.dtype == torch.int64 and latent_cache.shape[1] == R
    assert latent_cache.shape[0] >= attend and rope_cache.shape[0] >= attend and attend >= 1
    assert q.dtype == kv_a.dtype == w_kv.dtype == latent_cache.dtype == rope_cache.dtype == torch.bfloat16, "bf16 only"
    for name, x in (("q", q), ("kv_a", kv_a), ("g", g), ("latent cache", latent_cache), ("rope cache", rope_cache),
                    ("w_kv", w_kv), ("cos", cos), ("sin", sin), ("norm weight", norm_w)):
        assert x.stride(-1) == 1, f"{name}: the kernels want unit stride in the last dim"
    assert w_kv.stride(0) == w_kv.shape[1] * w_kv.stride(1) and cos.stride(0) == sin.stride(0)
    for n, v in (("rank", R), ("rope dims", P), ("nope dims", nope)):
        assert v >= 16 and v & (v - 1) == 0, f"{n}={v}: the kernels want a power of two >= 16"
    assert cfg.block_m >= 16 and cfg.block_n >= 16
    interp = interpreting()
    if not interp:
        assert q.is_cuda, "mla_decode_step runs on CUDA (use nn.mla.absorbed_step on the CPU)"
    M = T * H
    S = splits or num_splits(T, H, attend, q.device, cfg)
    block_m = _block_m(M, cfg)
    dev = q.device
    pdl = pdl_args(dev)
    q_lat = torch.empty(T, H, R, dtype=q.dtype, device=dev)
    q_rope = torch.empty(T, H, P, dtype=q.dtype, device=dev)
    gate = torch.empty(T, H, dtype=q.dtype, device=dev)
    block_r = min(cfg.prepare_block_r, R)
    mla_prepare_kernel[(H * (R // block_r) + 1,)](
        q, kv_a, g, cos, sin, pos, latent_cache, rope_cache, norm_w, w_kv, q_lat, q_rope, gate,
        float(eps), q.stride(0), kv_a.stride(0), g.stride(0), cos.stride(0), latent_cache.stride(0),
        rope_cache.stride(0), w_kv.stride(0), w_kv.stride(1),
        T=T, H=H, NOPE=nope, P=P, R=R, BLOCK_R=block_r, HP=triton.next_power_of_2(H), INTERPRET=interp,
        num_warps=4, **pdl,
    )
    po = torch.empty(S, M, R, dtype=torch.float32, device=dev)
    plse = torch.empty(S, M, dtype=torch.float32, device=dev)
    # The tiles of one split are adjacent in launch order (axis 0), so they run together and share
    # each cache block through L2.
    mla_decode_split_kernel[(triton.cdiv(M, block_m), S)](
        q_lat, q_rope, latent_cache, rope_cache, pos, po, plse, attend, S, float(scale) * math.log2(math.e),
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), latent_cache.stride(0),
        rope_cache.stride(0), H=H, M=M, R=R, P=P, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        INTERPRET=interp, ITERS=triton.cdiv(triton.cdiv(attend, S), cfg.block_n) if interp else 0,
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl,
    )
    out = torch.empty(T, H * V, dtype=q.dtype, device=dev)
    block_v = min(cfg.unfold_block_v, triton.next_power_of_2(V))
    sc = min(cfg.combine_chunk, triton.next_power_of_2(S))
    mode = cfg.combine if T > 1 else 0  # one token: the same program either way
    mla_combine_unfold_kernel[(H, triton.cdiv(V, block_v), T if mode == 2 else 1)](
        po, plse, w_kv, gate, out, S, w_kv.stride(0), w_kv.stride(1), out.stride(0),
        T=T, H=H, M=M, R=R, NOPE=nope, V=V, BLOCK_V=block_v, SC=sc, INTERPRET=interp,
        CHUNKS=triton.cdiv(S, sc) if interp else 0, MODE=mode, num_warps=cfg.unfold_warps, **pdl,
    )
    return out

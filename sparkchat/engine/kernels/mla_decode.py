"""MLA absorbed decode attention over the latent cache, flash-decoding style (the twin is nn.mla.mla_absorbed).

Decode and verify steps (T <= 8 tokens) attend over a fixed bucket of cache rows; what matters is reading
the cache once. All heads share one latent C and one rope key per row, so a program takes a tile of
BLOCK_M query rows (flattened (token, head) pairs: at the real shapes, one token's 32 heads) and streams
its cache rows once for all of them: scores = q_latent·C + q_rope·KR on tensor cores, an fp32 online
softmax with the causal-by-position mask, probs·C into an fp32 [BLOCK_M, rank] accumulator. (All T
tokens' heads in one program would need T x 64 KiB of accumulator; instead the T tiles of a cache range
are launched side by side and share it through L2.) The live rows are split over S programs per tile so
short contexts still fill the GPU, and a small second kernel merges the S partials by log-sum-exp.
Rows past max(pos)+1 are never read and each program splits that live length, not the bucket, so a graph
captured for a large bucket stays cheap at small positions. kv_b_proj's fold into q and unfold out of
the latent stay two batched torch GEMVs (cuBLAS).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


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
):
    """Query rows [pid_m*BLOCK_M, +BLOCK_M) (row = t*H + head) over split pid_s of the live cache rows.
    Writes the split's normalized output po[pid_s, row, :R] (fp32) and its base-2 log-sum-exp."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
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
def mla_decode_combine_kernel(
    po_ptr, plse_ptr, out_ptr, S, s_out_t, s_out_h,
    H: tl.constexpr, M: tl.constexpr, R: tl.constexpr, SP: tl.constexpr, SC: tl.constexpr,
    BLOCK_R: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One query row, BLOCK_R latent columns: the S partial outputs weighted by exp2(lse_s - lse).
    S is a runtime value (SP, its next power of two, bounds the loops) so buckets share compiled code."""
    row = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    sp = tl.arange(0, SP)
    lse = tl.load(plse_ptr + sp * M + row, mask=sp < S, other=float("-inf"))
    top = tl.max(lse, axis=0)  # finite: the split holding cache row 0 sees something for every row
    denom = tl.sum(tl.exp2(lse - top), axis=0)
    acc = tl.zeros([BLOCK_R], tl.float32)
    sc = tl.arange(0, SC)
    for s0 in tl.static_range(0, SP, SC):  # SC splits at a time keeps the [SC, BLOCK_R] tile in registers
        ss = s0 + sc
        w = tl.exp2(tl.load(plse_ptr + ss * M + row, mask=ss < S, other=float("-inf")) - top)
        part = tl.load(po_ptr + (ss[:, None] * M + row) * R + r[None, :], mask=(ss < S)[:, None], other=0.0)
        acc += tl.sum(w[:, None] * part, axis=0)
    o = acc / denom
    if INTERPRET:
        o = _round_bf16(o)  # then the cast below is exact
    t = row // H
    hh = row % H
    tl.store(out_ptr + t * s_out_t + hh * s_out_h + r, o.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class MlaDecodeConfig:
    """Launch shape. Not yet measured on a GPU: block_m 32 keeps one token's 32 heads and the fp32
    [32, 512] accumulator in one program (64 registers a thread at 8 warps)."""

    block_m: int = 32  # query rows (token, head) per program; >= 16 for tl.dot
    block_n: int = 32  # cache rows per step
    warps: int = 8
    stages: int = 2
    # Rows per split at least: a split writes block_m x (rank + 1) fp32 partials (64 KiB at 32 x 512),
    # about what 64 rows of cache are (72 KiB); shorter splits would move more partials than cache.
    min_rows: int = 64
    programs: int | None = None  # target programs per launch; None: the device's SM count
    combine_block_r: int = 128
    combine_chunk: int = 16


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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


def mla_decode(q_nope: torch.Tensor, q_rope: torch.Tensor, C: torch.Tensor, KR: torch.Tensor, w_kv: torch.Tensor,
               pos: torch.Tensor, attend: int, scale: float, nope: int, *, splits: int | None = None,
               config: MlaDecodeConfig | None = None) -> torch.Tensor:
    """mla_absorbed's result ([T, heads, v_dim]) with the mask given as positions: query t sees cache rows
    0..pos[t] of the first `attend` rows of C [>= attend, rank] and KR [>= attend, rope]."""
    cfg = config or MlaDecodeConfig()
    T, H, _ = q_nope.shape
    R, P = C.shape[1], KR.shape[1]
    assert w_kv.shape[0] == H and w_kv.shape[2] == R, f"w_kv {tuple(w_kv.shape)} vs heads={H}, rank={R}"
    assert q_rope.shape == (T, H, P) and pos.shape == (T,) and pos.dtype == torch.int64
    assert C.shape[0] >= attend and KR.shape[0] >= attend and attend >= 1
    assert C.dtype == KR.dtype == q_nope.dtype == q_rope.dtype == w_kv.dtype == torch.bfloat16, "bf16 only"
    assert C.stride(1) == 1 and KR.stride(1) == 1 and q_rope.stride(2) == 1
    for n, v in (("rank", R), ("rope dims", P)):
        assert v >= 16 and v & (v - 1) == 0, f"{n}={v}: the kernel wants a power of two >= 16"
    assert cfg.block_m >= 16 and cfg.block_n >= 16
    if not _interpreting():
        assert C.is_cuda, "mla_decode runs on CUDA (use nn.mla.mla_absorbed on the CPU)"
    M = T * H
    S = splits or num_splits(T, H, attend, C.device, cfg)
    block_m = _block_m(M, cfg)
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [h, nope, r], [h, v, r]
    # Fold W_uk into q as the twin does (bf16 result): [h, T, r], batched over heads.
    q_lat = torch.matmul(q_nope.transpose(0, 1), w_uk)
    po = torch.empty(S, M, R, dtype=torch.float32, device=C.device)
    plse = torch.empty(S, M, dtype=torch.float32, device=C.device)
    o_lat = torch.empty(H, T, R, dtype=C.dtype, device=C.device)  # head-major: the unfold's batch dim
    interp = _interpreting()
    # The tiles of one split are adjacent in launch order (axis 0), so they run together and share
    # each cache block through L2.
    mla_decode_split_kernel[(triton.cdiv(M, block_m), S)](
        q_lat, q_rope, C, KR, pos, po, plse, attend, S, float(scale) * math.log2(math.e),
        q_lat.stride(1), q_lat.stride(0), q_rope.stride(0), q_rope.stride(1), C.stride(0), KR.stride(0),
        H=H, M=M, R=R, P=P, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        INTERPRET=interp, ITERS=triton.cdiv(triton.cdiv(attend, S), cfg.block_n) if interp else 0,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    block_r = min(cfg.combine_block_r, R)
    sc = min(cfg.combine_chunk, triton.next_power_of_2(S))
    mla_decode_combine_kernel[(M, R // block_r)](
        po, plse, o_lat, S, o_lat.stride(1), o_lat.stride(0), H=H, M=M, R=R, SP=triton.next_power_of_2(S),
        SC=sc, BLOCK_R=block_r, INTERPRET=interp, num_warps=4,
    )
    # Unfold with W_uv: [h, T, r] @ [h, r, v] -> [h, T, v], returned as a [T, h, v] view.
    return torch.matmul(o_lat, w_uv.transpose(1, 2)).transpose(0, 1)

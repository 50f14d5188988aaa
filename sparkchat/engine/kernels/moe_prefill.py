"""Grouped MXFP4 MoE GEMM for prefill (T > 8 tokens; built for up to ~8K tokens per call).

The decode kernel (mxfp4_moe) streams each selected expert's weights once per token slot; a long
prompt instead sends hundreds of tokens to every expert, so here each expert's weights are decoded once
per block of BM tokens and fed to tensor cores (tl.dot, bf16 x bf16 -> fp32). No host sync anywhere:
the whole call can be captured in a CUDA graph.

Grouping (torch ops on the device, `group_by_expert`):
  the T*K (token, slot) pairs, flattened as s = t*K + k, are sorted by expert (stable, so a block's rows
  keep token order); `searchsorted` on the sorted ids gives each expert's first sorted position and its
  count; each expert's run is cut into blocks of at most BM rows, and a block table of a fixed size
  (ceil(T*K / BM) + min(E, T*K), an upper bound on the number of blocks) holds, per block, its expert,
  first sorted position and row count. Blocks past the real ones have expert -1: their programs return
  at once.

Three launches:
  stage 1  grid (block, I-tile): gather the block's token rows of x [BM, H], decode the expert's gate and
           up rows (w13 [2I, H/2] E2M1 bytes + E8M0 scales) to bf16 in registers, two tl.dot accumulators
           in fp32, clamped SwiGLU -> act[sorted position, I] bf16.
  stage 2  grid (block, H-tile): act rows of the block [BM, I] x decoded w2 [H, I/2] -> fp32, times each
           row's routing weight -> part[t*K + k, H] bf16 (every (token, slot) row written exactly once).
  combine  grid (token block, H-tile): out[t] = bf16(sum over k in slot order of part[t*K + k]) (+ add,
           rounded as torch adds two bf16 tensors). Deterministic: a fixed order, no atomics.
Within stage 1 and 2 the H / I tiles of one block are adjacent program ids, so the block's activation
rows are re-read from L2 and an expert's weights stream from HBM about once per BM tokens. Scratch:
act [T*K, I] + part [T*K, H] bf16, 436 MB at T = 8192 with Ling's shapes (allocated per call; torch's
caching allocator hands the same blocks to every layer).

Operand order (PrefillConfig.swap, default on): the decoded weight tile is the MMA's left operand
(acc [BN, BM] = W [BN, BK] @ x^T [BK, BM]), so it goes from registers straight into the MMA and the
tokens are its N side, which may be as small as 16 (short prompts). Triton lowers the same tl.dot to
wgmma on sm_90 and to mma.sync on sm_80..sm_121; the code uses nothing architecture-specific.

Decoding (`_decode`): a byte holds two E2M1 codes (low nibble = even input). Each code's 3 magnitude
bits go to bits 24:22 of an int32 and its sign to bit 31: read as fp32 that is the E2M1 value times
2^-126 (codes 0 and 1 are fp32 subnormals: exact, Triton's mul.f32 does not flush them). One fp32
multiply by 2^(s-1) (E8M0 s, i.e. 2^(s-127) * 2^126, built from bits) gives the weight, then bf16
(exact: 3 significant bits; pairs convert with one cvt.rn.bf16x2). Scales are exact for s <= 128
(scales up to 2, |w| up to 12; a release's experts are far below: ~2^-9..2^-3); larger ones clamp to
2; 255 (NaN) is not special-cased. On the engine's paired words (kernels/mxfp4_layout.py) `_decode_paired`
reads int32 words, takes each code pair with a shift and a mask, and joins the 8 codes back into input
order: fewer integer ops than the byte decode, 7-19% faster at 512-8192 tokens on the H200.

Numerics against the dequantize-then-matmul oracle (Experts.forward): the same products, with fp32
accumulation; gate/up stay fp32 through the SwiGLU (the oracle rounds them to bf16), the SwiGLU output
and each slot's weighted down projection round to bf16 as the oracle's do, slots sum in fp32.

Triton's CPU interpreter (TRITON_INTERPRET=1) gets the same kernels with two workarounds, chosen by the
INTERPRET constexpr: tl.dot on fp32 copies of the bf16 operands (its dot multiplies bf16 as raw
uint16 bits) and round-to-nearest-even done on the bits before each bf16 cast (its casts truncate).

Configs: PrefillConfig / prefill_config (block sizes from the mean rows per expert, shrunk to the
device's shared memory) and sweep_configs (the benchmark's neighbourhood).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.device import interpreting, max_shared_memory
from sparkchat.engine.kernels.mma_tiles import mma, per_col, per_row, to_bf16, zeros_acc


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _decode(wb, sb, BN: tl.constexpr, BK: tl.constexpr):
    """MXFP4 tile -> bf16 [BN, BK]: wb uint8 [BN, BK/2] (two E2M1 codes per byte, low nibble = even
    input), sb uint8 [BN, BK/32] (E8M0, one per 32 inputs)."""
    w = wb.to(tl.int32)
    lo = (((w & 0x07) << 22) | ((w & 0x08) << 28)).to(tl.float32, bitcast=True)  # even inputs, x 2^-126
    hi = (((w & 0x70) << 18) | ((w & 0x80) << 24)).to(tl.float32, bitcast=True)  # odd inputs, x 2^-126
    sc = ((tl.minimum(sb.to(tl.int32), 128) + 126) << 23).to(tl.float32, bitcast=True)  # 2^(s-1)
    sc = tl.reshape(sc, [BN, BK // 32, 1])
    lo = (tl.reshape(lo, [BN, BK // 32, 16]) * sc).to(tl.bfloat16)
    hi = (tl.reshape(hi, [BN, BK // 32, 16]) * sc).to(tl.bfloat16)
    return tl.reshape(tl.join(lo, hi), [BN, BK])  # [.., 16, 2] -> even, odd, even, odd, ...


@triton.jit
def _decode_paired(ww, sb, BN: tl.constexpr, BK: tl.constexpr):
    """_decode for int32 words in paired order (kernels/mxfp4_layout.py): ww [BN, BK/8], codes (j, j+4)
    of a word at the bf16 bits of its two halves (sign 15, e1 e0 m 8:6), shifted into the top of an
    fp32 as in _decode."""
    sc = tl.reshape(((tl.minimum(sb.to(tl.int32), 128) + 126) << 23).to(tl.float32, bitcast=True), [BN, BK // 32, 1])
    pairs = (ww & -0x7E3F7E40, (ww << 6) & -0x7E3F7E40, (ww << 3) & -0x7E3F7E40,  # 0x81C081C0
             ((ww >> 4) & 0x00C000C0) | ((ww >> 5) & 0x01000100) | ((ww << 1) & -0x7FFF8000))
    lo = ()
    hi = ()
    for i in tl.static_range(4):
        c_lo = tl.reshape((pairs[i] << 16).to(tl.float32, bitcast=True), [BN, BK // 32, 4])
        c_hi = tl.reshape((pairs[i] & -0x10000).to(tl.float32, bitcast=True), [BN, BK // 32, 4])
        lo = lo + ((c_lo * sc).to(tl.bfloat16),)  # code i of each word
        hi = hi + ((c_hi * sc).to(tl.bfloat16),)  # code i + 4
    # codes 0..7 of each word in order: the last three joined axes are the index's bits 2, 1, 0
    even = tl.join(tl.join(lo[0], hi[0]), tl.join(lo[2], hi[2]))
    odd = tl.join(tl.join(lo[1], hi[1]), tl.join(lo[3], hi[3]))
    return tl.reshape(tl.join(even, odd), [BN, BK])


@triton.jit
def _tile(w, sb, BN: tl.constexpr, BK: tl.constexpr, PAIRED: tl.constexpr):
    if PAIRED:
        return _decode_paired(w, sb, BN, BK)
    else:
        return _decode(w, sb, BN, BK)


@triton.jit
def _block(meta_ptr, NB, BN_TILES: tl.constexpr):
    """This program's (block, column tile) and the block's (expert, first sorted position, rows)."""
    pid = tl.program_id(0)
    b = pid // BN_TILES
    nt = pid % BN_TILES
    e = tl.load(meta_ptr + b)
    start = tl.load(meta_ptr + NB + b)
    rows = tl.load(meta_ptr + 2 * NB + b)
    return nt, e, start, rows


@triton.jit
def moe_prefill_gate_up_kernel(
    x_ptr, order_ptr, meta_ptr, w_ptr, s_ptr, act_ptr, limit, NB,
    H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, INTERPRET: tl.constexpr,
    PAIRED: tl.constexpr = False, KD: tl.constexpr = 2,
):
    """KD: inputs per element of w_ptr (2: E2M1 bytes; 8: int32 words in paired order, PAIRED)."""
    nt, e, start, rows = _block(meta_ptr, NB, I // BN)
    if e < 0:
        return
    m = tl.arange(0, BM)
    rmask = m < rows
    slot = tl.load(order_ptr + start + m, mask=rmask, other=0)
    tok = slot // K
    kk = tl.arange(0, BK)
    a_ptrs = x_ptr + tok[:, None] * H + kk[None, :]
    n = nt * BN + tl.arange(0, BN)
    w_e = w_ptr + e.to(tl.int64) * (2 * I * (H // KD))
    s_e = s_ptr + e.to(tl.int64) * (2 * I * (H // 32))
    wg_ptrs = w_e + n[:, None] * (H // KD) + tl.arange(0, BK // KD)[None, :]  # gate rows n
    sg_ptrs = s_e + n[:, None] * (H // 32) + tl.arange(0, BK // 32)[None, :]
    wu_ptrs = wg_ptrs + I * (H // KD)  # up rows I + n
    su_ptrs = sg_ptrs + I * (H // 32)
    acc_g = zeros_acc(BM, BN, SWAP)
    acc_u = zeros_acc(BM, BN, SWAP)
    for k0 in range(0, H, BK):
        a = tl.load(a_ptrs + k0, mask=rmask[:, None], other=0.0)
        wg = _tile(tl.load(wg_ptrs + k0 // KD), tl.load(sg_ptrs + k0 // 32), BN, BK, PAIRED)
        wu = _tile(tl.load(wu_ptrs + k0 // KD), tl.load(su_ptrs + k0 // 32), BN, BK, PAIRED)
        acc_g = mma(a, wg, acc_g, SWAP, INTERPRET)
        acc_u = mma(a, wu, acc_u, SWAP, INTERPRET)
    # clamped SwiGLU (limit <= 0: no clamp): min(silu(g), L) * clip(u, -L, L)
    lim = tl.where(limit > 0, limit, float("inf"))
    g = tl.minimum(acc_g / (1.0 + tl.exp(-acc_g)), lim)
    u = tl.minimum(tl.maximum(acc_u, -lim), lim)
    h = to_bf16(g * u, INTERPRET)
    tl.store(act_ptr + per_row((start + m) * I, SWAP) + per_col(n, SWAP), h, mask=per_row(rmask, SWAP))


@triton.jit
def moe_prefill_down_kernel(
    act_ptr, order_ptr, meta_ptr, rw_ptr, w_ptr, s_ptr, part_ptr, NB,
    H: tl.constexpr, I: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, INTERPRET: tl.constexpr,
    PAIRED: tl.constexpr = False, KD: tl.constexpr = 2,
):
    nt, e, start, rows = _block(meta_ptr, NB, H // BN)
    if e < 0:
        return
    m = tl.arange(0, BM)
    rmask = m < rows
    kk = tl.arange(0, BK)
    a_ptrs = act_ptr + (start + m)[:, None] * I + kk[None, :]
    n = nt * BN + tl.arange(0, BN)
    w_ptrs = w_ptr + e.to(tl.int64) * (H * (I // KD)) + n[:, None] * (I // KD) + tl.arange(0, BK // KD)[None, :]
    s_ptrs = s_ptr + e.to(tl.int64) * (H * (I // 32)) + n[:, None] * (I // 32) + tl.arange(0, BK // 32)[None, :]
    acc = zeros_acc(BM, BN, SWAP)
    for k0 in range(0, I, BK):
        a = tl.load(a_ptrs + k0, mask=rmask[:, None], other=0.0)
        w = _tile(tl.load(w_ptrs + k0 // KD), tl.load(s_ptrs + k0 // 32), BN, BK, PAIRED)
        acc = mma(a, w, acc, SWAP, INTERPRET)
    slot = tl.load(order_ptr + start + m, mask=rmask, other=0)
    rw = tl.load(rw_ptr + slot, mask=rmask, other=0.0)
    y = to_bf16(acc * per_row(rw, SWAP), INTERPRET)
    tl.store(part_ptr + per_row(slot * H, SWAP) + per_col(n, SWAP), y, mask=per_row(rmask, SWAP))


@triton.jit
def moe_prefill_combine_kernel(part_ptr, add_ptr, out_ptr, T, H: tl.constexpr, K: tl.constexpr,
                               BT: tl.constexpr, BH: tl.constexpr, HAS_ADD: tl.constexpr,
                               INTERPRET: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    tmask = (t < T)[:, None]
    y = tl.zeros([BT, BH], dtype=tl.float32)
    for k in tl.static_range(K):  # slot order: deterministic
        y += tl.load(part_ptr + (t * K + k)[:, None] * H + cols[None, :], mask=tmask, other=0.0).to(tl.float32)
    y = to_bf16(y, INTERPRET)
    offs = t[:, None] * H + cols[None, :]
    if HAS_ADD:  # the shared expert's output, added as torch adds two bf16 tensors
        y = to_bf16(y.to(tl.float32) + tl.load(add_ptr + offs, mask=tmask, other=0.0).to(tl.float32), INTERPRET)
    tl.store(out_ptr + offs, y, mask=tmask)


# ---------------------------------------------------------------------------------------------- host side
@dataclass(frozen=True)
class PrefillConfig:
    bm: int = 128  # (token, slot) rows per block: the tokens of one expert sharing each decoded weight tile
    bn1: int = 64  # intermediate columns per stage-1 program (it computes bn1 gate + bn1 up columns)
    bk1: int = 128  # k step along H
    warps1: int = 8
    stages1: int = 3
    bn2: int = 128  # output columns (along H) per stage-2 program
    bk2: int = 128  # k step along I
    warps2: int = 8
    stages2: int = 3
    bt: int = 4  # tokens per combine program
    bh: int = 512  # columns per combine program
    swap: bool = True  # decoded weights as the MMA's left operand (acc [BN, BM]); False: tokens on the left


def _fit(block: int, n: int) -> int:
    """Largest power of two <= block that divides n."""
    b = block
    while b > 1 and n % b:
        b //= 2
    return b


def _smem_estimate(bm: int, bn: int, bk: int, stages: int, mats: int) -> int:
    """Shared memory of one program, an upper estimate: pipelined token tiles and weight bytes, plus a
    decoded bf16 tile per weight matrix (mats = 2 for gate and up). Triton's own figure, read from
    sm_90 / sm_121 builds, came out 10-40% lower."""
    return stages * (bm * bk * 2 + mats * (bn * bk // 2 + bn * bk // 32)) + mats * bn * bk * 2


_smem_limit = max_shared_memory  # a module global, so tests can pretend to be a smaller GPU


def prefill_config(T: int, K: int, E: int, H: int, I: int, device=None) -> PrefillConfig:
    """Default config for T tokens. The row block follows the mean rows per expert (T*K/E), so that a
    short prompt does not pad every expert's block to 128 rows (512 experts, top-8: 8 rows at T=512,
    32 at 2048, 128 at 8192); then it is shrunk until the estimate fits the device's shared memory
    (~99 KB per block on the DGX Spark's sm_121, 227 KB on an H100/H200): k steps of 64 first (on
    sm_121, whose mma.sync keeps both operands in registers, k steps of 128 spill at 64-row blocks),
    then 2 stages, then smaller row blocks. Every default was compiled for sm_90 and sm_121 with
    Triton 3.6 (no spills)."""
    rows = T * K / max(1, E)
    if rows <= 12:
        cfg = PrefillConfig(bm=16, warps1=4, warps2=4, stages1=4, stages2=4)
    elif rows <= 24:
        cfg = PrefillConfig(bm=32, warps1=4, warps2=4, stages1=4, stages2=4)
    elif rows <= 64:
        cfg = PrefillConfig(bm=64, warps1=4, warps2=4)
    else:
        cfg = PrefillConfig()
    return _shrink(cfg, H, I, _smem_limit(device))


def _fits(cfg: PrefillConfig, H: int, I: int, limit: int) -> bool:
    return max(_smem_estimate(cfg.bm, _fit(cfg.bn1, I), _fit(cfg.bk1, H), cfg.stages1, 2),
               _smem_estimate(cfg.bm, _fit(cfg.bn2, H), _fit(cfg.bk2, I), cfg.stages2, 1)) <= limit


def _shrink(cfg: PrefillConfig, H: int, I: int, limit: int) -> PrefillConfig:
    for _ in range(8):
        if _fits(cfg, H, I, limit):
            break
        if cfg.bk1 > 64 or cfg.bk2 > 64:
            cfg = replace(cfg, bk1=64, bk2=64)
        elif cfg.stages1 > 2 or cfg.stages2 > 2:
            cfg = replace(cfg, stages1=2, stages2=2)
        elif cfg.bm > 32:
            cfg = replace(cfg, bm=cfg.bm // 2)
        else:
            break
    return cfg


def sweep_configs(T: int, K: int, E: int, H: int, I: int, device=None) -> list[PrefillConfig]:
    """prefill_config's choice first, then a small neighbourhood for the benchmark's --sweep: row blocks
    of half and twice the size, wider gate/up tiles with shorter k steps, k steps of 64 with a deeper
    pipeline, narrower tiles, more warps, 2 stages, and (128-row blocks) tokens as the left operand.
    Configs over the device's shared memory are left out. (Tokens on the left with 64-row blocks, 128
    output columns and 4 warps crashes Triton 3.6's sm_90 compiler: "Illegal shared layout".)"""
    base = prefill_config(T, K, E, H, I, device)
    out = [base]
    for bm in (base.bm // 2, base.bm * 2):
        if 16 <= bm <= 128:
            w = 8 if bm >= 128 else 4
            out.append(replace(base, bm=bm, warps1=w, warps2=w))
    out += [replace(base, bn1=128, bk1=64), replace(base, bk1=64, bk2=64, stages1=4, stages2=4),
            replace(base, bn1=32, bn2=64), replace(base, stages1=2, stages2=2)]
    if base.warps1 < 8:
        out.append(replace(base, warps1=8, warps2=8))
    if base.bm >= 128:
        out.append(replace(base, swap=False))
    limit = _smem_limit(device)
    seen, keep = set(), []
    for c in out:
        if _fits(c, H, I, limit) and c not in seen:
            seen.add(c)
            keep.append(c)
    return keep


@dataclass(frozen=True)
class ExpertBlocks:
    """Token slots grouped by expert (see group_by_expert)."""
    order: torch.Tensor  # int32 [T*K]: sorted position -> flat slot t*K + k, by expert, stable
    meta: torch.Tensor  # int32 [3, NB]: per block expert (-1: unused), first sorted position, rows
    num_blocks: int  # NB, the static bound (the grid size in blocks)


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, bm: int) -> ExpertBlocks:
    """Sort the T*K token slots by expert and cut each expert's run into blocks of <= bm rows, on the
    ids' device with torch ops only (no host sync, fixed shapes: CUDA-graph safe)."""
    T, K = topk_ids.shape
    S, E = T * K, num_experts
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    sorted_ids, order = torch.sort(flat, stable=True)
    first = torch.searchsorted(sorted_ids, torch.arange(E + 1, device=dev, dtype=torch.int64))  # [E+1]
    counts = first[1:] - first[:-1]
    nblk = (counts + bm - 1) // bm
    blk_end = torch.cumsum(nblk, 0)
    NB = -(-S // bm) + min(E, S)  # >= sum over experts of ceil(count / bm)
    b = torch.arange(NB, device=dev, dtype=torch.int64)
    e = torch.searchsorted(blk_end, b, right=True)  # the expert whose blocks cover b; E past the last
    ec = e.clamp(max=E - 1)
    local = b - (blk_end[ec] - nblk[ec])  # block index within its expert
    start = first[ec] + local * bm
    rows = (counts[ec] - local * bm).clamp(0, bm)
    expert = torch.where(e < E, ec, torch.full_like(ec, -1))
    meta = torch.stack([expert, start.clamp(max=max(S - 1, 0)), rows]).to(torch.int32).contiguous()
    return ExpertBlocks(order=order.to(torch.int32), meta=meta, num_blocks=NB)



@dataclass(frozen=True)
class _Launch:
    """The three launches of one call, kept apart so the benchmark can time them separately."""
    T: int
    K: int
    H: int
    I: int
    cfg: PrefillConfig
    paired: bool = False  # weights as int32 words in paired order (kernels/mxfp4_layout.py)

    def _weights(self, w: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if self.paired:
            return w.view(torch.int32), dict(PAIRED=True, KD=8)
        return w, dict(PAIRED=False, KD=2)

    def stage1(self, x, blocks: ExpertBlocks, w13, w13_scale, act, limit: float) -> None:
        c = self.cfg
        bn, bk = _fit(c.bn1, self.I), _fit(c.bk1, self.H)
        grid = (blocks.num_blocks * (self.I // bn),)
        w13, layout = self._weights(w13)
        moe_prefill_gate_up_kernel[grid](
            x, blocks.order, blocks.meta, w13, w13_scale, act, float(limit), blocks.num_blocks,
            H=self.H, I=self.I, K=self.K, BM=c.bm, BN=bn, BK=bk, SWAP=c.swap, INTERPRET=interpreting(),
            num_warps=c.warps1, num_stages=c.stages1, **layout)

    def stage2(self, act, blocks: ExpertBlocks, rw, w2, w2_scale, part) -> None:
        c = self.cfg
        bn, bk = _fit(c.bn2, self.H), _fit(c.bk2, self.I)
        grid = (blocks.num_blocks * (self.H // bn),)
        w2, layout = self._weights(w2)
        moe_prefill_down_kernel[grid](
            act, blocks.order, blocks.meta, rw, w2, w2_scale, part, blocks.num_blocks,
            H=self.H, I=self.I, BM=c.bm, BN=bn, BK=bk, SWAP=c.swap, INTERPRET=interpreting(),
            num_warps=c.warps2, num_stages=c.stages2, **layout)

    def combine(self, part, out, add=None) -> None:
        bt, bh = self.cfg.bt, _fit(self.cfg.bh, self.H)
        moe_prefill_combine_kernel[(triton.cdiv(self.T, bt), self.H // bh)](
            part, out if add is None else add, out, self.T, H=self.H, K=self.K, BT=bt, BH=bh,
            HAS_ADD=add is not None, INTERPRET=interpreting(), num_warps=4)


def moe_prefill(
    x: torch.Tensor,  # [T, H] bf16
    topk_ids: torch.Tensor,  # [T, K] int32/int64, distinct experts per token
    topk_weights: torch.Tensor,  # [T, K] fp32
    w13: torch.Tensor,  # [E, 2I, H/2] uint8
    w13_scale: torch.Tensor,  # [E, 2I, H/32] uint8
    w2: torch.Tensor,  # [E, H, I/2] uint8
    w2_scale: torch.Tensor,  # [E, H, I/32] uint8
    swiglu_limit: float = 0.0,
    *,
    add: torch.Tensor | None = None,  # [T, H] bf16 added to the result (the shared expert's output)
    out: torch.Tensor | None = None,  # [T, H] bf16
    config: PrefillConfig | None = None,
    paired: bool = False,  # w13 and w2 in paired word order (kernels/mxfp4_layout.py)
) -> torch.Tensor:
    """Routed MXFP4 experts for a prompt: sum_k w[t,k] * down_e(swiglu_L(gate_e x_t, up_e x_t)) (+ add)
    -> bf16 [T, H], e = topk_ids[t, k]. Any T >= 1 works; it is meant for T > 8 (mxfp4_moe serves
    decode windows). Scratch: act [T*K, I] and part [T*K, H] bf16, allocated per call."""
    T, H = x.shape
    E = w13.shape[0]
    inter = w13.shape[1] // 2
    K = topk_ids.shape[1]
    assert x.dtype == torch.bfloat16 and x.is_contiguous(), "x must be contiguous bf16 [T, H]"
    assert topk_ids.shape == (T, K) and topk_ids.dtype in (torch.int32, torch.int64)
    assert topk_weights.shape == (T, K), "topk_weights must be [T, K]"
    assert H % 32 == 0 and inter % 32 == 0, "H and I must be multiples of the MX group (32)"
    assert w13.dtype == torch.uint8 and w13.shape == (E, 2 * inter, H // 2) and w13.is_contiguous()
    assert w13_scale.dtype == torch.uint8 and w13_scale.shape == (E, 2 * inter, H // 32) and w13_scale.is_contiguous()
    assert w2.dtype == torch.uint8 and w2.shape == (E, H, inter // 2) and w2.is_contiguous()
    assert w2_scale.dtype == torch.uint8 and w2_scale.shape == (E, H, inter // 32) and w2_scale.is_contiguous()
    assert T * K * max(H, inter) < 2**31, "too many tokens for int32 offsets: split the call"
    if not interpreting():
        assert x.is_cuda, "moe_prefill runs on CUDA (Experts.forward is the CPU path)"
    cfg = config or prefill_config(T, K, E, H, inter, x.device)
    assert cfg.bm >= 16 and cfg.bm & (cfg.bm - 1) == 0, "bm must be a power of two >= 16 (tl.dot)"
    if out is None:
        out = torch.empty(T, H, dtype=torch.bfloat16, device=x.device)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16 and out.is_contiguous()
    if add is not None:
        assert add.shape == (T, H) and add.dtype == torch.bfloat16 and add.is_contiguous()
    if T == 0:
        return out
    launch = _Launch(T, K, H, inter, cfg, paired)
    blocks = group_by_expert(topk_ids, E, cfg.bm)
    rw = topk_weights.to(torch.float32).reshape(-1).contiguous()
    act = torch.empty(T * K, inter, dtype=torch.bfloat16, device=x.device)
    part = torch.empty(T * K, H, dtype=torch.bfloat16, device=x.device)
    launch.stage1(x, blocks, w13, w13_scale, act, swiglu_limit)
    launch.stage2(act, blocks, rw, w2, w2_scale, part)
    launch.combine(part, out, add)
    return out

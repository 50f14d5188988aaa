"""FP8 block-scaled linears for prompts (more than 8 tokens): y = x @ (w * 128x128 block scales)^T.

The decode and verify windows stream FP8 weights through fp8_gemv. A prompt used to dequantize every
FP8 linear to a bf16 copy first (quant.dequant_fp8_block: fp8 -> fp32 -> scaled -> bf16, ~19 bytes of
memory traffic per weight, then the bf16 matmul reads 2 more) — on every prompt, whatever its length:
~52 GB for Ling-3.0-flash's 2.73 G FP8 weights, by bytes alone 0.22 s at the DGX Spark's 234 GB/s. Here
each program reads its weight tiles as FP8 (1 byte per weight) and scales them in registers, exactly
as dequant_fp8_block does (fp32 product, rounded to nearest bf16), so the MMA sees the very bf16
weights the dequantized copy held; bf16 x bf16 products accumulate in fp32 on the tensor cores
(tl.dot: wgmma on sm_90, mma.sync on sm_80..sm_121 — nothing architecture-specific).

Tiles: the weight tile [BN, BK] is the MMA's left operand (mma_tiles' SWAP) and the tokens its right,
so a 16-token tile is as cheap as a 128-token one per weight byte. BK divides 128, so each k step of
a weight row sits in one scale block: one scale per row per step. Programs are ordered so that GROUP
token tiles take each weight tile in turn (its bytes come from HBM once, then from L2).

Long prompts are compute-bound, and there a bf16 torch matmul (cuBLAS) outruns this kernel (H200: ~2x at
8192 tokens), so `fp8_prompt_linear` hands prompts over GEMM_MAX_TOKENS to it, on a bf16 copy that
`fp8_dequant_kernel` writes in one pass (1 byte read, 2 written per weight, where the torch dequant
moved ~19) and the caching allocator takes back right after.

Numerics against the oracle `x @ dequant_fp8_block(w, s).T` in fp32, rounded to bf16 (reference.
fp8_block_gemv_reference, which the GEMV shares): identical weights, fp32 sums in another order.
Shapes N and K are constexpr (the model's exact shapes); the token count is not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.device import interpreting, max_shared_memory
from sparkchat.engine.kernels.fp8_gemv import SCALE_BLOCK  # the release's weight_block_size, both ways
from sparkchat.engine.kernels.mma_tiles import mma, per_col, per_row, to_bf16, zeros_acc


@triton.jit
def fp8_block_gemm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M,
    N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP: tl.constexpr, SWAP: tl.constexpr, INTERPRET: tl.constexpr,
):
    """x bf16 [M, K], w fp8 [N, K], s fp32 [ceil(N/128), ceil(K/128)] -> y bf16 [M, N]."""
    KB: tl.constexpr = (K + SCALE_BLOCK - 1) // SCALE_BLOCK
    N_TILES: tl.constexpr = (N + BN - 1) // BN
    EVEN_N: tl.constexpr = N % BN == 0
    EVEN_K: tl.constexpr = K % BK == 0
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BM)
    per_group = GROUP * N_TILES
    first_m = (pid // per_group) * GROUP
    group_m = tl.minimum(m_tiles - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm[:, None] * K + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * K + rk[None, :]
    s_ptrs = s_ptr + (rn // SCALE_BLOCK) * KB
    acc = zeros_acc(BM, BN, SWAP)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs + k0)
            else:
                w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + rk) < K
            a = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if EVEN_N:
            s = tl.load(s_ptrs + k0 // SCALE_BLOCK)
        else:
            s = tl.load(s_ptrs + k0 // SCALE_BLOCK, mask=n_ok, other=0.0)
        wb = to_bf16(w.to(tl.float32) * s[:, None], INTERPRET)  # dequant_fp8_block's own rounding
        acc = mma(a, wb, acc, SWAP, INTERPRET)
    y = to_bf16(acc, INTERPRET)
    tl.store(y_ptr + per_row(rm * N, SWAP) + per_col(rn, SWAP), y,
             mask=per_row(m_ok, SWAP) & per_col(n_ok, SWAP))


@triton.jit
def fp8_dequant_kernel(w_ptr, s_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, INTERPRET: tl.constexpr):
    """w fp8 [N, K] * block scales -> bf16 [N, K], rounded as quant.dequant_fp8_block rounds."""
    KB: tl.constexpr = (K + SCALE_BLOCK - 1) // SCALE_BLOCK
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    ok = (rn < N)[:, None] & (rk < K)[None, :]
    offs = rn[:, None] * K + rk[None, :]
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    s = tl.load(s_ptr + (rn // SCALE_BLOCK)[:, None] * KB + (rk // SCALE_BLOCK)[None, :], mask=ok, other=0.0)
    tl.store(out_ptr + offs, to_bf16(w.to(tl.float32) * s, INTERPRET), mask=ok)


@dataclass(frozen=True)
class GemmConfig:
    bm: int = 128  # tokens per tile
    bn: int = 128  # weight rows per tile
    bk: int = 128  # k step (divides the 128-column scale block)
    warps: int = 8
    stages: int = 3
    group: int = 8  # token tiles that take each weight tile in turn
    swap: bool = True  # weights as the MMA's left operand (see mma_tiles)


def _smem_estimate(cfg: GemmConfig) -> int:
    """Shared memory of one program, an upper estimate: pipelined token tiles (bf16) and weight tiles
    (fp8), plus a bf16 weight tile where the MMA takes it from shared memory (tokens on the left)."""
    staged = cfg.stages * (cfg.bm * cfg.bk * 2 + cfg.bn * cfg.bk)
    return staged + (0 if cfg.swap else cfg.bn * cfg.bk * 2)


def _shrink(cfg: GemmConfig, limit: int) -> GemmConfig:
    """Smaller k steps, then fewer stages, then narrower tiles, until the estimate fits `limit` bytes
    (~99 KB per block on sm_12x such as the DGX Spark's GB10; 227 KB on the H200)."""
    for _ in range(8):
        if _smem_estimate(cfg) <= limit:
            break
        if cfg.bk > 64:
            cfg = replace(cfg, bk=64)
        elif cfg.stages > 2:
            cfg = replace(cfg, stages=2)
        elif cfg.bm > 32:
            cfg = replace(cfg, bm=cfg.bm // 2)
        else:
            break
    return cfg


def gemm_config(M: int, N: int, K: int, device=None) -> GemmConfig:
    """The token tile follows the prompt's length (a 20-token prompt does not pad to 128 rows); the
    rest is the H200 sweep's best (docs/benchmarks.md, session 19: 64-row weight tiles and 4 warps won
    at every shape past 64 tokens), shrunk to the device's shared memory."""
    if M <= 16:
        cfg = GemmConfig(bm=16, bn=64, warps=4, stages=4)
    elif M <= 32:
        cfg = GemmConfig(bm=32, bn=64, warps=4, stages=4)
    elif M <= 64:
        cfg = GemmConfig(bm=32, bn=64, warps=4, stages=3)
    else:
        cfg = GemmConfig(bm=128, bn=64, warps=4, stages=3)
    return _shrink(cfg, max_shared_memory(device))


def sweep_configs(M: int, N: int, K: int, device=None) -> list[GemmConfig]:
    """gemm_config's choice first, then a neighbourhood for the benchmark: half and twice the token
    tile, narrower and wider weight tiles, k steps of 64 with more stages, more warps, tokens on the
    left. Configs over the device's shared memory are left out."""
    base = gemm_config(M, N, K, device)
    out = [base]
    for bm in (base.bm // 2, base.bm * 2):
        if 16 <= bm <= 256:
            out.append(replace(base, bm=bm, warps=8 if bm >= 128 else 4))
    for bn in (64, 128, 256):
        if bn != base.bn:
            out.append(replace(base, bn=bn, warps=8 if bn >= 128 else 4))
    out += [replace(base, bk=64, stages=4), replace(base, stages=2), replace(base, warps=8 if base.warps == 4 else 4),
            replace(base, group=1), replace(base, swap=False)]
    limit = max_shared_memory(device)
    seen, keep = set(), []
    for c in out:
        if _smem_estimate(c) <= limit and c not in seen:
            seen.add(c)
            keep.append(c)
    return keep



# Prompts longer than this go to fp8_dequant + a bf16 torch matmul: on the H200 the two are even at 512
# tokens (docs/benchmarks.md, session 19); where bandwidth is scarcer (the DGX Spark) the GEMM's saving
# of 4 bytes a weight counts for more, so the line is not drawn lower.
GEMM_MAX_TOKENS = 512


def _check_weight(w: torch.Tensor, scale_inv: torch.Tensor) -> None:
    N, K = w.shape
    assert w.dtype == torch.float8_e4m3fn and w.is_contiguous(), "w: contiguous fp8 [N, K]"
    assert scale_inv.dtype == torch.float32 and scale_inv.is_contiguous()
    block = SCALE_BLOCK.value
    assert scale_inv.shape == (triton.cdiv(N, block), triton.cdiv(K, block)), \
        f"scale_inv {tuple(scale_inv.shape)} for w {tuple(w.shape)}"
    if not interpreting():
        assert w.is_cuda, "the FP8 prompt kernels run on CUDA (quant.dequant_fp8_block is their twin)"


def fp8_dequant(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp8 [N, K] with 128x128 block scales -> bf16 [N, K], equal to quant.dequant_fp8_block(w, scale_inv)."""
    _check_weight(w, scale_inv)
    N, K = w.shape
    out = torch.empty(N, K, dtype=torch.bfloat16, device=w.device)
    bn, bk = 32, 256
    fp8_dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](w, scale_inv, out, N=N, K=K, BN=bn, BK=bk,
                                                                  INTERPRET=interpreting(), num_warps=4)
    return out


def fp8_prompt_linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """A prompt's FP8 linear, x [M, K] bf16 -> bf16 [M, N]: the FP8 GEMM up to GEMM_MAX_TOKENS tokens
    (weight bytes dominate: read once, as FP8), beyond it a bf16 matmul on a one-pass dequantized copy
    (compute dominates)."""
    if x.shape[0] <= GEMM_MAX_TOKENS:
        return fp8_block_gemm(x, w, scale_inv)
    return torch.nn.functional.linear(x, fp8_dequant(w, scale_inv))


def fp8_block_gemm(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, *,
                   out: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] bf16 @ (w fp8 [N, K] * 128x128 block scale_inv).T -> bf16 [M, N], any M >= 1 (meant for
    prompts: fp8_block_gemv serves M <= 8). No dequantized copy of w is made."""
    M, K = x.shape
    N = w.shape[0]
    assert x.dtype == torch.bfloat16 and x.is_contiguous(), "x must be contiguous bf16 [M, K]"
    assert w.shape == (N, K), f"w {tuple(w.shape)} for x {tuple(x.shape)}"
    _check_weight(w, scale_inv)
    if out is None:
        out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16 and out.is_contiguous()
    if M == 0:
        return out
    cfg = config or gemm_config(M, N, K, x.device)
    assert SCALE_BLOCK.value % cfg.bk == 0 and cfg.bm >= 16 and cfg.bn >= 16, "bk divides 128; tiles >= 16 (tl.dot)"
    rows = max(cfg.bm, (2**31 - 1) // max(N, K) // cfg.bm * cfg.bm)  # int32 offsets inside the kernel
    for r0 in range(0, M, rows):
        xs, ys = x[r0:r0 + rows], out[r0:r0 + rows]
        m = xs.shape[0]
        grid = (triton.cdiv(m, cfg.bm) * triton.cdiv(N, cfg.bn),)
        fp8_block_gemm_kernel[grid](xs, w, scale_inv, ys, m, N=N, K=K, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
                                    GROUP=cfg.group, SWAP=cfg.swap, INTERPRET=interpreting(),
                                    num_warps=cfg.warps, num_stages=cfg.stages)
    return out

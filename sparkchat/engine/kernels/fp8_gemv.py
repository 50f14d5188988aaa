"""FP8 (e4m3) weight-streaming GEMV for decode windows of T = 1..8 tokens.

One kernel, `fp8_gemv_kernel`, streams each weight row block once for all T tokens (fp32 FMAs into
per-lane accumulators reduced once at the end) and has three front ends:
  fp8_block_gemv   128x128 block scales (the release's non-expert linears)  -> bf16 [T, N]
  fp8_head_gemv    one fp32 scale per row (the FP8 lm_head)                  -> fp32 logits [T, V]
  fp8_head_argmax  same GEMV, greedy argmax fused: each program writes only its (max, index) per
                   token, a second one-program-per-token kernel reduces them -> int64 [T]
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SCALE_BLOCK: tl.constexpr = tl.constexpr(128)


@triton.jit
def _gemv_loads(x_ptr, w_ptr, r0, k0, sub, kk, T: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                BN: tl.constexpr, RS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """Raw fp8 tiles [BN, BK] of the RS row tiles and each token's bf16 chunk [BK] at k0."""
    cols = k0 + kk
    kmask = cols < K
    ws = ()
    for r in tl.static_range(RS):
        rows = r0 + r * BN + sub
        wp = w_ptr + rows[:, None] * K + cols[None, :]
        if EVEN_N and EVEN_K:
            w = tl.load(wp)
        elif EVEN_K:
            w = tl.load(wp, mask=(rows < N)[:, None], other=0.0)
        else:
            w = tl.load(wp, mask=(rows < N)[:, None] & kmask[None, :], other=0.0)
        ws = ws + (w,)
    xs = ()
    for t in tl.static_range(T):
        if EVEN_K:
            xs = xs + (tl.load(x_ptr + t * K + cols),)
        else:
            xs = xs + (tl.load(x_ptr + t * K + cols, mask=kmask, other=0.0),)
    return ws, xs


@triton.jit
def _gemv_step(accs, ws, xs, s_ptr, r0, k0, T: tl.constexpr, RS: tl.constexpr, KB: tl.constexpr,
               ROW_SCALE: tl.constexpr):
    """accs[t*RS + r] += w_r * x_t (elementwise, [BN, BK]) for one k step."""
    if not ROW_SCALE:
        # BN*RS and BK divide 128: one block scale for this program's rows and this k step.
        sc = tl.load(s_ptr + (r0 // SCALE_BLOCK) * KB + k0 // SCALE_BLOCK)
    wf = ()
    for r in tl.static_range(RS):
        if ROW_SCALE:
            wf = wf + (ws[r].to(tl.float32),)
        else:
            wf = wf + (ws[r].to(tl.float32) * sc,)
    new = ()
    for t in tl.static_range(T):
        xv = xs[t].to(tl.float32)[None, :]
        for r in tl.static_range(RS):
            new = new + (accs[t * RS + r] + wf[r] * xv,)
    return new


@triton.jit
def fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, pmax_ptr, pidx_ptr,
    T: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
    BN: tl.constexpr, RS: tl.constexpr, BK: tl.constexpr, UNROLL: tl.constexpr,
    ROW_SCALE: tl.constexpr,  # False: scale_inv [ceil(N/128), ceil(K/128)]; True: scale [N]
    OUT: tl.constexpr,  # 0: bf16 y [T, N]; 1: fp32 y [T, N]; 2: per-program (max, argmax) only
    PREFETCH: tl.constexpr,
):
    """Rows [pid*RS*BN, +RS*BN) of y = x @ w.T for T tokens. The program holds RS row tiles of
    [BN, BK] fp8 per k step; each token's activation chunk is loaded once and used for every tile;
    accumulators ([BN, BK] fp32 per token and tile) are reduced over k once at the end."""
    pid = tl.program_id(0)
    NP = tl.num_programs(0)
    r0 = pid * (RS * BN)
    sub = tl.arange(0, BN)
    kk = tl.arange(0, BK)
    EVEN_K: tl.constexpr = K % BK == 0
    EVEN_N: tl.constexpr = N % (RS * BN) == 0
    KB: tl.constexpr = (K + SCALE_BLOCK - 1) // SCALE_BLOCK
    accs = ()
    for i in tl.static_range(T * RS):
        accs = accs + (tl.zeros([BN, BK], dtype=tl.float32),)
    if PREFETCH:
        # Software-pipelined by one k step: step k+1's weights and activations are in flight while
        # step k multiplies (the last step re-reads its own chunk: cache hits).
        ws, xs = _gemv_loads(x_ptr, w_ptr, r0, 0, sub, kk, T, N, K, BN, RS, EVEN_N, EVEN_K)
        for k0 in tl.range(0, K, BK, loop_unroll_factor=UNROLL):
            kn = tl.minimum(k0 + BK, (K - 1) // BK * BK)
            ws_n, xs_n = _gemv_loads(x_ptr, w_ptr, r0, kn, sub, kk, T, N, K, BN, RS, EVEN_N, EVEN_K)
            accs = _gemv_step(accs, ws, xs, s_ptr, r0, k0, T, RS, KB, ROW_SCALE)
            ws = ws_n
            xs = xs_n
    else:
        for k0 in tl.range(0, K, BK, loop_unroll_factor=UNROLL):
            ws, xs = _gemv_loads(x_ptr, w_ptr, r0, k0, sub, kk, T, N, K, BN, RS, EVEN_N, EVEN_K)
            accs = _gemv_step(accs, ws, xs, s_ptr, r0, k0, T, RS, KB, ROW_SCALE)
    best_v = ()
    best_i = ()
    for t in tl.static_range(T):
        for r in tl.static_range(RS):
            rows = r0 + r * BN + sub
            y = tl.sum(accs[t * RS + r], axis=1)
            if ROW_SCALE:
                y = y * tl.load(s_ptr + rows, mask=rows < N, other=0.0)
            if OUT == 2:
                y = tl.where(rows < N, y, float("-inf"))
                m = tl.max(y, axis=0)
                j = r0 + r * BN + tl.argmax(y, axis=0, tie_break_left=True)
                if r == 0:
                    bv = m
                    bi = j
                else:
                    better = m > bv  # strict: the earlier tile wins ties
                    bi = tl.where(better, j, bi)
                    bv = tl.where(better, m, bv)
            elif OUT == 0:
                tl.store(y_ptr + t * N + rows, y.to(tl.bfloat16), mask=rows < N)
            else:
                tl.store(y_ptr + t * N + rows, y, mask=rows < N)
        if OUT == 2:
            tl.store(pmax_ptr + t * NP + pid, bv)
            tl.store(pidx_ptr + t * NP + pid, bi)


@triton.jit
def argmax_reduce_kernel(pmax_ptr, pidx_ptr, out_ptr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """One program per token: the first program holding the max wins (its index is the first max)."""
    t = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_j = tl.zeros([BLOCK], tl.int32)
    for j0 in tl.static_range(0, NP, BLOCK):
        v = tl.load(pmax_ptr + t * NP + j0 + j, mask=j0 + j < NP, other=float("-inf"))
        better = v > best_v  # strict: earlier chunk wins ties
        best_v = tl.where(better, v, best_v)
        best_j = tl.where(better, j0 + j, best_j)
    m = tl.max(best_v, axis=0)
    win = tl.min(tl.where(best_v == m, best_j, NP), axis=0)
    tl.store(out_ptr + t, tl.load(pidx_ptr + t * NP + win).to(tl.int64))


@dataclass(frozen=True)
class GemvConfig:
    bn: int = 32  # rows per tile
    rs: int = 2  # row tiles per program, sharing each activation load (bn * rs divides 128)
    bk: int = 64  # k step (divides 128; below 32 * warps so activations load straight into registers)
    unroll: int = 2
    warps: int = 4
    prefetch: bool = False  # one-step software pipelining of the k loop (not yet measured on a GPU)


# Best measured on the H200 at the Ling-3.0-flash shapes; see docs/benchmarks.md.
_TUNED: dict[tuple[str, int], GemvConfig] = {
    ("block", 1): GemvConfig(bn=64, rs=1, bk=64, unroll=2, warps=8),
}


def gemv_config(kind: str, T: int) -> GemvConfig:
    """Tuned config for ("block" | "head", T), else a default (one row tile per program beyond two
    tokens, to keep the accumulators in registers)."""
    return _TUNED.get((kind, T)) or (GemvConfig() if T <= 2 else GemvConfig(rs=1))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_x_w(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int]:
    T, K = x.shape
    N, Kw = w.shape
    assert Kw == K, f"x has K={K}, w has K={Kw}"
    assert x.dtype == torch.bfloat16 and x.is_contiguous(), "x must be contiguous bf16 [T, K]"
    assert w.dtype == torch.float8_e4m3fn and w.is_contiguous(), "w must be contiguous float8_e4m3fn [N, K]"
    assert 1 <= T <= 8, f"T={T}: GEMV serves decode windows of 1..8 tokens"
    assert K % 16 == 0, "K must be a multiple of 16"
    if not _interpreting():
        assert x.is_cuda and w.is_cuda, "fp8 GEMV runs on CUDA (use the *_reference twins on CPU)"
    return T, N, K


def _launch(x, w, s, y, pmax, pidx, row_scale: bool, out_kind: int, cfg: GemvConfig) -> None:
    T, K = x.shape
    N = w.shape[0]
    bk = min(cfg.bk, _pow2(K))
    assert 128 % (cfg.bn * cfg.rs) == 0 and 128 % bk == 0, "bn * rs and bk must divide the 128 scale block"
    grid = (triton.cdiv(N, cfg.bn * cfg.rs),)
    fp8_gemv_kernel[grid](
        x, w, s, y, pmax, pidx, T=T, N=N, K=K, BN=cfg.bn, RS=cfg.rs, BK=bk, UNROLL=cfg.unroll,
        ROW_SCALE=row_scale, OUT=out_kind, PREFETCH=cfg.prefetch, num_warps=cfg.warps,
    )


def fp8_block_gemv(
    x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, *,
    out: torch.Tensor | None = None, config: GemvConfig | None = None,
) -> torch.Tensor:
    """x [T, K] bf16 @ (w fp8 [N, K] * 128x128 block scale_inv).T -> bf16 [T, N]; w streamed once."""
    T, N, K = _check_x_w(x, w)
    assert scale_inv.dtype == torch.float32 and scale_inv.is_contiguous()
    assert scale_inv.shape == (triton.cdiv(N, 128), triton.cdiv(K, 128)), f"scale_inv {tuple(scale_inv.shape)}"
    if out is None:
        out = torch.empty(T, N, dtype=torch.bfloat16, device=x.device)
    assert out.shape == (T, N) and out.dtype == torch.bfloat16 and out.is_contiguous()
    _launch(x, w, scale_inv, out, out, out, False, 0, config or gemv_config("block", T))
    return out


def fp8_head_gemv(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *,
    out: torch.Tensor | None = None, config: GemvConfig | None = None,
) -> torch.Tensor:
    """LM head: x [T, H] bf16 @ (w fp8 [V, H] * scale [V]).T -> fp32 logits [T, V]."""
    T, V, H = _check_x_w(x, w)
    assert scale.dtype == torch.float32 and scale.shape == (V,) and scale.is_contiguous()
    if out is None:
        out = torch.empty(T, V, dtype=torch.float32, device=x.device)
    assert out.shape == (T, V) and out.dtype == torch.float32 and out.is_contiguous()
    _launch(x, w, scale, out, out, out, True, 1, config or gemv_config("head", T))
    return out


def fp8_head_argmax_workspace(T: int, V: int, device, config: GemvConfig | None = None):
    cfg = config or gemv_config("head", T)
    np_ = triton.cdiv(V, cfg.bn * cfg.rs)
    return (torch.empty(T, np_, dtype=torch.float32, device=device),
            torch.empty(T, np_, dtype=torch.int32, device=device))


def fp8_head_argmax(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *,
    out: torch.Tensor | None = None, workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """Greedy token of each row of x through the FP8 head, without writing the logits -> int64 [T]."""
    T, V, H = _check_x_w(x, w)
    assert scale.dtype == torch.float32 and scale.shape == (V,) and scale.is_contiguous()
    cfg = config or gemv_config("head", T)
    np_ = triton.cdiv(V, cfg.bn * cfg.rs)
    if workspace is None:
        workspace = fp8_head_argmax_workspace(T, V, x.device, cfg)
    pmax, pidx = workspace
    assert pmax.shape == (T, np_) and pidx.shape == (T, np_) and pidx.dtype == torch.int32
    if out is None:
        out = torch.empty(T, dtype=torch.int64, device=x.device)
    assert out.shape == (T,) and out.dtype == torch.int64
    _launch(x, w, scale, out, pmax, pidx, True, 2, cfg)
    argmax_reduce_kernel[(T,)](pmax, pidx, out, NP=np_, BLOCK=min(4096, _pow2(np_)), num_warps=8)
    return out

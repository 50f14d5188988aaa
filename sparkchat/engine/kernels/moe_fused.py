"""The one-token MXFP4 MoE in one launch: split-K over the down projection instead of a second stage.

mxfp4_moe.py runs a token's routed experts in two launches: stage 1 computes every expert's SwiGLU
activations, stage 2 multiplies them into the down projections, and stage 2 may not multiply until
all of stage 1 has finished. At one token each stage streams a few MB and is held by latency, so
the boundary costs as much as the arithmetic. Here program (slot k, block j) computes BN activations
of expert ids[k] (its gate and up rows j*BN.., as stage 1 does) and at once multiplies them into the
matching BN columns of that expert's down projection: a partial sum for every one of the H outputs,
added into an fp32 buffer with atomics. The last program to finish rounds the buffer to bf16 (adding
the shared expert's output as torch adds two bf16 tensors), writes y and zeroes the buffer and its
counter for the next launch. The sums' order follows the atomics', so the bf16 output may differ in
its last bit from run to run (the two-stage kernel is deterministic).

Down reads: a program needs CB = BN/8 words of each of the H rows of its expert's down weight (and
each row's scale byte of that 32-column group). In the checkpoint's layout [E, H, I/2] these are
CB*4 bytes every I/2 bytes, so neighbouring programs share each 32-byte sector (HBM is read once,
L2 several times). `column_blocks` lays w2 out as [E, I/BN, H, CB] words and the scales as
[E, I/32, H], which makes a program's reads contiguous; the strides are constexprs, so one kernel
reads either layout (`DownLayout`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.counters import arrival_counters
from sparkchat.engine.kernels.mxfp4_moe import (_e8m0_scale, _pack_x, _pow2, _store_act_packed, _stream, _word_dot,
                                                _zeros)
from sparkchat.engine.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def _down_tiles(d_e, ds_e, rows, kb, g, CB: tl.constexpr, D_SN: tl.constexpr, D_SB: tl.constexpr,
                S_SN: tl.constexpr, S_SG: tl.constexpr):
    """Words [CH, CB] of column block kb and the scale bytes [CH] of group g, rows `rows`."""
    c = tl.arange(0, CB)
    w = tl.load(d_e + rows[:, None] * D_SN + kb * D_SB + c[None, :])
    s = tl.load(ds_e + rows * S_SN + g * S_SG)
    return w, s


@triton.jit
def mxfp4_moe_one_token_kernel(
    x_ptr, ids_ptr, rw_ptr, w13_ptr, s13_ptr, w2_ptr, s2_ptr, act_ptr, act_words_ptr, acc_ptr, cnt_ptr,
    y_ptr, add_ptr, limit,
    K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, HAS_ADD: tl.constexpr,
    BN: tl.constexpr, BKW: tl.constexpr, UNROLL: tl.constexpr, CH: tl.constexpr, H_PAD: tl.constexpr,
    D_SN: tl.constexpr, D_SB: tl.constexpr, S_SN: tl.constexpr, S_SG: tl.constexpr,
    PREFETCH: tl.constexpr, INTERPRET: tl.constexpr, PAIRED: tl.constexpr, X_PACKED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid (K, I / BN). x_ptr: bf16 [H], or int32 [H/2] already as bf16x2 words (X_PACKED).
    act_ptr / act_words_ptr: one scratch [K, I] seen as bf16 and as int32 (this program's BN
    activations pass through it, from the lanes that sum them to the lanes that multiply them)."""
    s = tl.program_id(0)
    j = tl.program_id(1)
    CB: tl.constexpr = BN // 8
    NCH: tl.constexpr = H // CH
    HW: tl.constexpr = H // 8
    HG: tl.constexpr = H // 32
    pdl_wait(PDL)  # the expert ids come from the kernel just before
    e = tl.load(ids_ptr + s).to(tl.int64)
    rw = tl.load(rw_ptr + s).to(tl.float32)
    d_e = w2_ptr + e * (H * (I // 8))
    ds_e = s2_ptr + e * (H * (I // 32))
    g = (j * BN) // 32
    rows = tl.arange(0, CH)
    first = j % NCH  # programs start at different row chunks: their atomics spread over the buffer
    # The first chunk of down weights depends only on the expert: in flight during the gate/up stream.
    wd, sd = _down_tiles(d_e, ds_e, first * CH + rows, j, g, CB, D_SN, D_SB, S_SN, S_SG)
    row0s = (j * BN, I + j * BN)  # gate rows, up rows
    accs = _stream(_zeros(2, BN, BKW), w13_ptr + e * (2 * I * HW), s13_ptr + e * (2 * I * HG), row0s, HW, HG, HW,
                   x_ptr, (0,), (e >= 0,), BN, BKW, 2, 1, False, UNROLL, PREFETCH, False, True, INTERPRET, PAIRED,
                   X_PACKED)
    gs = tl.sum(accs[0], axis=1)
    us = tl.sum(accs[1], axis=1)
    lim = tl.where(limit > 0, limit, float("inf"))
    a = tl.minimum(gs / (1.0 + tl.exp(-gs)), lim)  # silu, clamped above
    u = tl.minimum(tl.maximum(us, -lim), lim)
    sub = tl.arange(0, BN)
    _store_act_packed(act_ptr + s * I, j * BN + sub, a * u * rw, sub >= 0, INTERPRET)
    tl.debug_barrier()  # the stores above are visible to this program's other threads
    xp = _pack_x(act_words_ptr + s * (I // 2), (j * CB + tl.arange(0, CB)) * 8, INTERPRET, True)
    for c in tl.range(0, NCH):
        n0 = ((first + c) % NCH) * CH
        nn = ((first + c + 1) % NCH) * CH  # the last step reloads the first chunk (cache hits)
        wd_n, sd_n = _down_tiles(d_e, ds_e, nn + rows, j, g, CB, D_SN, D_SB, S_SN, S_SG)
        part = tl.sum(_word_dot(wd, xp, INTERPRET, PAIRED), axis=1) * _e8m0_scale(sd)
        tl.atomic_add(acc_ptr + n0 + rows, part, sem="relaxed", scope="gpu")
        wd = wd_n
        sd = sd_n
    # The last program to finish rounds the sums (atomics above -> barrier -> release).
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if done == K * (I // BN) - 1:
        tl.debug_barrier()
        n = tl.arange(0, H_PAD)
        m = n < H
        y = tl.load(acc_ptr + n, mask=m, other=0.0, cache_modifier=".cg").to(tl.bfloat16)
        if HAS_ADD:  # the shared expert's output, added as torch adds two bf16 tensors
            y = (y.to(tl.float32) + tl.load(add_ptr + n, mask=m, other=0.0).to(tl.float32)).to(tl.bfloat16)
        tl.store(y_ptr + n, y, mask=m)
        tl.store(acc_ptr + n, tl.zeros([H_PAD], dtype=tl.float32), mask=m)
        tl.store(cnt_ptr, 0)


@dataclass(frozen=True)
class FusedConfig:
    bn: int = 16  # activations (gate rows, and as many up rows) per program; the down columns it multiplies
    bkw: int = 64  # int32 words per k step of the gate/up stream
    unroll: int = 2
    ch: int = 256  # down rows per step
    warps: int = 4
    prefetch: bool = True


@dataclass(frozen=True)
class DownLayout:
    """Word and scale strides of w2: checkpoint order [E, H, I/8] words and [E, H, I/32] scales, or
    column blocks (`column_blocks`)."""
    blocks: bool = False

    def strides(self, H: int, I: int, bn: int) -> dict:
        cb = bn // 8
        if self.blocks:
            return dict(D_SN=cb, D_SB=H * cb, S_SN=1, S_SG=H)
        return dict(D_SN=I // 8, D_SB=cb, S_SN=I // 32, S_SG=1)


def column_blocks(w2: torch.Tensor, w2_scale: torch.Tensor, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w2 uint8 [E, H, I/2] and w2_scale uint8 [E, H, I/32] -> the same bytes as [E, I/bn, H, bn/2]
    and [E, I/32, H] (new tensors; same shapes as the inputs' views, for the kernel's strides)."""
    E, H, half = w2.shape
    words = w2.contiguous().view(torch.int32).view(E, H, (2 * half) // bn, bn // 8)
    blocks = words.permute(0, 2, 1, 3).contiguous().view(torch.uint8).view(E, H, half)
    scales = w2_scale.permute(0, 2, 1).contiguous().view(E, H, -1)
    return blocks, scales


def fused_one_token(
    x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
    w2: torch.Tensor, s2: torch.Tensor, limit: float, out: torch.Tensor, act: torch.Tensor,
    *, add: torch.Tensor | None = None, join: Callable[[], None] | None = None, config: FusedConfig | None = None,
    paired: bool = False, x_packed: torch.Tensor | None = None, layout: DownLayout = DownLayout(),
    interpret: bool = False,
) -> torch.Tensor:
    """One token's routed experts (plus `add`) -> out bf16 [1, H]. Shapes and checks as mxfp4_moe;
    act: fp32 scratch of at least K*I/2 elements (MoeWorkspace.act)."""
    cfg = config or FusedConfig()
    _, H = x.shape
    K = ids.shape[1]
    inter = w13.shape[1] // 2
    bn = cfg.bn
    while bn > 8 and inter % bn:
        bn //= 2
    assert bn % 8 == 0 and inter % bn == 0 and bn <= 32, f"I={inter}: no block of 8, 16 or 32 columns fits"
    ch = min(cfg.ch, _pow2(H))
    while H % ch:
        ch //= 2
    acc = accumulator(x.device, H)
    if join is not None:
        join()
    meta = dict(K=K, H=H, I=inter, HAS_ADD=add is not None, BN=bn, BKW=max(4, min(cfg.bkw, H // 8)),
                UNROLL=cfg.unroll, CH=ch, H_PAD=_pow2(H), PREFETCH=cfg.prefetch, INTERPRET=interpret, PAIRED=paired,
                X_PACKED=x_packed is not None, num_warps=cfg.warps, **layout.strides(H, inter, bn))
    xin = x_packed.view(torch.int32) if x_packed is not None else x
    mxfp4_moe_one_token_kernel[(K, inter // bn)](
        xin, ids, rw, w13.view(torch.int32), s13, w2.view(torch.int32), s2, act.view(torch.bfloat16),
        act.view(torch.int32), acc, arrival_counters("mxfp4_moe_one_token", x.device, 1), out,
        out if add is None else add.contiguous(), float(limit), **meta, **pdl_args(x.device))
    return out


_ACCUMULATORS: dict[torch.device, torch.Tensor] = {}


def accumulator(device: torch.device, n: int) -> torch.Tensor:
    """The zeroed fp32 sums the kernel adds into; each launch leaves them zero (allocated outside any
    CUDA graph capture, by the step the engine runs before capturing)."""
    device = torch.device(device)
    buf = _ACCUMULATORS.get(device)
    if buf is None or buf.numel() < n:
        buf = _ACCUMULATORS[device] = torch.zeros(max(n, 4096), dtype=torch.float32, device=device)
    return buf

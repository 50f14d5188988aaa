"""A speculative step's KDA commit in one launch (the twin is ConversationState.commit_kda's loop).

A verify leaves every KDA layer's recurrent state as it found it and keeps each position's delta-rule
inputs (KDASteps). Once the host knows the last accepted position, this kernel runs the recurrence from
the untouched state over positions 0 … last for every layer at once, and sets each layer's conv state
to the conv rows that end there. Per layer that reads and writes the 2 MiB state once, where keeping a
state per position had the verify write 6 MiB more and a rejection copy one back.

Programs (layer, b): b < heads × blocks advances one [DH, DH/blocks] block of one head's state, in the
very layout and with the very code the verify used (kda_decode's LAUNCH and delta_rule_step), so the
committed state is bit for bit the one a step of last + 1 tokens leaves; the others copy a block of the
layer's conv rows as int32 words. A table holds each layer's four addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.kda_decode import LAUNCH, delta_rule_step

BLOCK = 4096  # int32 words of conv rows a program copies
_PLANS: dict[tuple[int, ...], "_Plan"] = {}  # checked launches, by their tensors' addresses and shapes
_MAX_PLANS = 64


@triton.jit(do_not_specialize=["last"])  # one compiled kernel for every `last`
def kda_commit_kernel(table_ptr, last, T: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, NB: tl.constexpr,
                      CONV: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr, LAST_ON_DEVICE: tl.constexpr):
    """table row: recurrent [H, DH, DH] fp32, inputs [T, H, 4, DH] fp32, conv state, conv window.
    CONV, ROW: int32 words of the conv state and of one conv window row. LAST_ON_DEVICE: `last` points
    to it (int64), as the GPU's own acceptance left it: the host queues the commit before it knows."""
    if LAST_ON_DEVICE:
        last = tl.load(last).to(tl.int32)
    layer = tl.program_id(0)
    b = tl.program_id(1)
    row = table_ptr + layer * 4
    if b < H * NB:
        h = b // NB
        # 16-byte aligned as the verify's arguments are: the same vectorized layout, the same sums
        rec = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.float32)), 16)
        inp = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.float32)), 16)
        BV: tl.constexpr = DH // NB
        i = tl.arange(0, DH)
        j = (b % NB) * BV + tl.arange(0, BV)
        sp = rec + h * DH * DH + i[:, None] * DH + j[None, :]
        S = tl.load(sp)
        for t in tl.static_range(T):  # the step's positions, the accepted ones applied
            if t <= last:
                r = inp + (t * H + h) * 4 * DH
                S = delta_rule_step(S, tl.load(r + i), tl.load(r + DH + j), tl.load(r + 2 * DH + i),
                                    tl.load(r + 3 * DH))
        tl.store(sp, S)
    else:
        dst = tl.load(row + 2).to(tl.pointer_type(tl.int32))
        src = tl.load(row + 3).to(tl.pointer_type(tl.int32)) + (last + 1).to(tl.int64) * ROW
        o = (b - H * NB) * BLOCK + tl.arange(0, BLOCK)
        m = o < CONV
        tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


def _words(t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    assert n % 4 == 0 and t.is_contiguous()
    return n // 4


@dataclass(frozen=True)
class _Plan:
    table: torch.Tensor  # int64 [layers, 4] on the device
    heads: int
    head_dim: int
    conv: int  # int32 words of one conv state
    row: int  # of one conv window row
    positions: int  # the step's T

    def launch(self, last: int | torch.Tensor) -> None:
        on_device = isinstance(last, torch.Tensor)
        assert (last.numel() == 1 and last.dtype == torch.int64) if on_device else -1 <= last < self.positions
        nb, warps = LAUNCH
        grid = (self.table.shape[0], self.heads * nb + triton.cdiv(self.conv, BLOCK))
        kda_commit_kernel[grid](self.table, last, T=self.positions, H=self.heads, DH=self.head_dim, NB=nb,
                                CONV=self.conv, ROW=self.row, BLOCK=BLOCK, LAST_ON_DEVICE=on_device,
                                num_warps=warps)


def _plan(layers: list[tuple[torch.Tensor, ...]]) -> _Plan:
    rec, inputs, conv, window = layers[0]
    heads, head_dim = rec.shape[0], rec.shape[1]
    cw, row = _words(conv), _words(window[0])
    for r, s, c, w in layers:
        assert r.shape == rec.shape and s.shape == inputs.shape and c.shape == conv.shape and w.shape == window.shape
        assert r.dtype == s.dtype == torch.float32 and c.dtype == w.dtype == conv.dtype
        assert r.is_contiguous() and s.is_contiguous() and w.is_contiguous()
        assert all(t.data_ptr() % 16 == 0 for t in (r, s))  # the kernel's alignment hint
    assert cw == conv.shape[0] * row and inputs.shape[1:] == (heads, 4, head_dim) and rec.shape[2] == head_dim
    table = torch.tensor([[t.data_ptr() for t in layer] for layer in layers], dtype=torch.int64).to(rec.device)
    return _Plan(table, heads, head_dim, cw, row, inputs.shape[0])


def kda_commit(layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
               last: int | torch.Tensor) -> None:
    """For each (recurrent [h, d, d] fp32, kept inputs [T, h, 4, d], conv [K-1, C], window [K-1+T, C]):
    recurrent advanced over positions 0 … last (nn.kda.commit_steps), conv = window[last + 1 : last + K].
    `last` may be a one-element int64 tensor on the device (read there: no host sync); it must then lie
    in -1 … T-1 (an acceptance gives 0 … T-1). last = -1 puts the conv states back to where
    the step found them (the recurrent ones it never moved).
    Same shapes and dtypes in every layer. The checks and the address table are made once per set of
    tensors (a verify graph's kept inputs are the same tensors at every replay): after that a call is a
    key and a launch."""
    if not layers:
        return
    rec, inputs, conv, window = layers[0]
    key = tuple(t.data_ptr() for layer in layers for t in layer) + (
        inputs.shape[0], rec.numel(), conv.numel(), conv.element_size(), window.shape[-1])
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _plan(layers)
    plan.launch(last)

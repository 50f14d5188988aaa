"""A speculative step's KDA rollback in one launch (the twin is ConversationState.rollback_kda's loop).

After a verify keeps its drafts up to position `last`, every KDA layer takes the recurrent state the
verify kept for that position and the conv rows that end there. As torch copies that is two launches a
layer, 70 for Ling-3.0-flash's 35 KDA layers: the host spent longer issuing them than the GPU copying.
Here one launch copies all of it: a table holds each layer's four addresses (state, kept states, conv
state, conv window), each program copies one BLOCK of one layer's state or conv rows. The bytes are
copied as they are (int32 words), whatever the dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK = 4096  # int32 words a program copies
WARPS = 4
_PLANS: dict[tuple[int, ...], "_Plan"] = {}  # checked launches, by their tensors' addresses and shapes
_MAX_PLANS = 64


@triton.jit(do_not_specialize=["last"])  # one compiled kernel for every `last`
def kda_rollback_kernel(table_ptr, last, STATE: tl.constexpr, CONV: tl.constexpr, ROW: tl.constexpr,
                        NS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (layer, b): block b of the layer's recurrent state (b < NS), else of its conv rows.
    STATE, CONV, ROW: int32 words of one recurrent state, of the conv state, of one conv window row."""
    layer = tl.program_id(0)
    b = tl.program_id(1)
    row = table_ptr + layer * 4
    offs = tl.arange(0, BLOCK)
    if b < NS:
        dst = tl.load(row).to(tl.pointer_type(tl.int32))
        src = tl.load(row + 1).to(tl.pointer_type(tl.int32)) + last.to(tl.int64) * STATE
        o = b * BLOCK + offs
        m = o < STATE
    else:
        dst = tl.load(row + 2).to(tl.pointer_type(tl.int32))
        src = tl.load(row + 3).to(tl.pointer_type(tl.int32)) + (last + 1).to(tl.int64) * ROW
        o = (b - NS) * BLOCK + offs
        m = o < CONV
    tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


def _words(t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    assert n % 4 == 0 and t.is_contiguous()
    return n // 4


@dataclass(frozen=True)
class _Plan:
    table: torch.Tensor  # int64 [layers, 4] on the device
    state: int  # int32 words of one recurrent state
    conv: int  # of one conv state
    row: int  # of one conv window row
    positions: int  # the kept states: the step's T - 1

    def launch(self, last: int) -> None:
        assert 0 <= last < self.positions
        ns = triton.cdiv(self.state, BLOCK)
        grid = (self.table.shape[0], ns + triton.cdiv(self.conv, BLOCK))
        kda_rollback_kernel[grid](self.table, last, STATE=self.state, CONV=self.conv, ROW=self.row, NS=ns,
                                  BLOCK=BLOCK, num_warps=WARPS)


def _plan(layers: list[tuple[torch.Tensor, ...]]) -> _Plan:
    rec, steps, conv, window = layers[0]
    state, cw, row = _words(rec), _words(conv), _words(window[0])
    for r, s, c, w in layers:
        assert r.shape == rec.shape and s.shape == steps.shape and c.shape == conv.shape and w.shape == window.shape
        assert r.dtype == s.dtype and c.dtype == w.dtype == conv.dtype and s.is_contiguous() and w.is_contiguous()
    assert cw == conv.shape[0] * row and steps.shape[1:] == rec.shape
    table = torch.tensor([[t.data_ptr() for t in layer] for layer in layers], dtype=torch.int64).to(rec.device)
    return _Plan(table, state, cw, row, steps.shape[0])


def kda_rollback(layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]], last: int) -> None:
    """For each (recurrent [h, dk, dv], kept states [T-1, h, dk, dv], conv [K-1, C], window [K-1+T, C]):
    recurrent = kept[last] and conv = window[last + 1 : last + K], for last < T-1 (at T-1 the step left
    the state in place). Same shapes and dtypes in every layer.
    The checks and the address table are made once per set of tensors (a verify graph's kept steps are
    the same tensors at every replay): after that a call is a key and a launch."""
    if not layers:
        return
    rec, steps, conv, window = layers[0]
    key = tuple(t.data_ptr() for layer in layers for t in layer) + (
        steps.shape[0], rec.numel(), rec.element_size(), conv.numel(), conv.element_size(), window.shape[-1])
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _plan(layers)
    plan.launch(last)

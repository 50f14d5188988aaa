"""A speculative step's KDA rollback in one launch (the twin is ConversationState.rollback_kda's loop).

After a verify keeps its drafts up to position `last`, every KDA layer takes the recurrent state the
verify kept for that position and the conv rows that end there. As torch copies that is two launches a
layer, 70 for Ling-3.0-flash's 35 KDA layers: the host spent longer issuing them than the GPU copying.
Here one launch copies all of it: a table holds each layer's four addresses (state, kept states, conv
state, conv window), each program copies one BLOCK of one layer's state or conv rows. The bytes are
copied as they are (int32 words), whatever the dtypes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # int32 words a program copies
WARPS = 4
_TABLES: dict[tuple[int, ...], torch.Tensor] = {}  # address tables on the device, by their addresses
_MAX_TABLES = 64


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


def kda_rollback(layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]], last: int) -> None:
    """For each (recurrent [h, dk, dv], kept states [T, h, dk, dv], conv [K-1, C], window [K-1+T, C]):
    recurrent = kept[last] and conv = window[last + 1 : last + K]. Same shapes and dtypes in every layer."""
    if not layers:
        return
    rec, steps, conv, window = layers[0]
    state, cw, row = _words(rec), _words(conv), _words(window[0])
    for r, s, c, w in layers:
        assert r.shape == rec.shape and s.shape == steps.shape and c.shape == conv.shape and w.shape == window.shape
        assert r.dtype == s.dtype and c.dtype == w.dtype == conv.dtype and s.is_contiguous() and w.is_contiguous()
    assert 0 <= last < steps.shape[0] and cw == (conv.shape[0]) * row
    key = tuple(t.data_ptr() for layer in layers for t in layer)
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        table = _TABLES[key] = torch.tensor(key, dtype=torch.int64).to(rec.device)
    ns = triton.cdiv(state, BLOCK)
    kda_rollback_kernel[(len(layers), ns + triton.cdiv(cw, BLOCK))](table, last, STATE=state, CONV=cw, ROW=row,
                                                                     NS=ns, BLOCK=BLOCK, num_warps=WARPS)

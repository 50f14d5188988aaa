"""A step's first launch: the token embeddings gathered and normed in one PDL kernel.

Without it a decode step (and a verify, and each MTP draft) opened with torch's gather and Inductor's
norm: two launches outside the PDL chain, so the first layer's input projection (52 MB) could not start
streaming its weights until both had ended (the H200's step: 4.5 + 2.4 µs, docs/benchmarks.md session 32).
Here one program per token (and for the MTP input, one more per token for the hidden state's norm)
gathers its row and writes the residual and the norm's output in the forms the next GEMV reads.
The twins are the model's own path: `model.embed[ids]`, then `ops.rms_norm` / `ops.mtp_input`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.device import interpreting
from sparkchat.engine.kernels.fp8_gemv import _f16_outputs
from sparkchat.engine.kernels.norm_rows import _normed_row, _store_f16_acts
from sparkchat.engine.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def embed_norm_kernel(ids_ptr, table_ptr, nw_ptr, x_ptr, h_ptr, eps, h16_ptr=None, hd_ptr=None,
                      N: tl.constexpr = 0, BLOCK: tl.constexpr = 0, F16: tl.constexpr = False,
                      INTERPRET: tl.constexpr = False, PDL: tl.constexpr = False):
    """Token t = program_id(0): x[t] = table[ids[t]], h[t] = RMSNorm(x[t]) (F16: also its tensor-core form)."""
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    m = i < N
    w = tl.load(nw_ptr + i, mask=m, other=0.0)  # a weight: before the wait
    pdl_wait(PDL)  # the ids may come from the kernel before (a pipelined step's pick)
    row = tl.load(ids_ptr + t).to(tl.int64)
    x = tl.load(table_ptr + row * N + i, mask=m, other=0.0)
    tl.store(x_ptr + t * N + i, x, mask=m)
    h = _normed_row(x, w, eps, N, INTERPRET)
    tl.store(h_ptr + t * N + i, h, mask=m)
    if F16:
        _store_f16_acts(h16_ptr, hd_ptr, t, 0, h, m, N, BLOCK)


@triton.jit
def mtp_input_kernel(ids_ptr, table_ptr, hidden_ptr, enorm_ptr, hnorm_ptr, out_ptr, eps, N: tl.constexpr,
                     BLOCK: tl.constexpr, INTERPRET: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[t] = [enorm(table[ids[t]]) | hnorm(hidden[t])]: program (t, 0) the first half, (t, 1) the second."""
    t, half = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, BLOCK)
    m = i < N
    if half == 0:
        w = tl.load(enorm_ptr + i, mask=m, other=0.0)
        pdl_wait(PDL)
        x = tl.load(table_ptr + tl.load(ids_ptr + t).to(tl.int64) * N + i, mask=m, other=0.0)
    else:
        w = tl.load(hnorm_ptr + i, mask=m, other=0.0)
        pdl_wait(PDL)  # the hidden state: the kernel before wrote it
        x = tl.load(hidden_ptr + t * N + i, mask=m, other=0.0)
    tl.store(out_ptr + t * 2 * N + half * N + i, _normed_row(x, w, eps, N, INTERPRET), mask=m)


def _check(ids: torch.Tensor, table: torch.Tensor, *norm_ws: torch.Tensor) -> None:
    assert ids.dim() == 1 and table.dim() == 2 and table.dtype == torch.bfloat16
    assert table.is_contiguous(), "rows gathered at id * N"
    for w in norm_ws:
        assert w.shape == (table.shape[1],) and w.dtype == torch.bfloat16


def embed_norm(ids: torch.Tensor, table: torch.Tensor, norm_w: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(table[ids], ops.rms_norm(table[ids], norm_w, eps)) for a decode window: bf16 [T, N] each, in one
    PDL launch; the norm's output carries `f16_acts` where tensor-core GEMVs read it (as add_rms_norm's)."""
    _check(ids, table, norm_w)
    T, N, ids = ids.shape[0], table.shape[1], ids.contiguous()
    x = torch.empty(T, N, dtype=table.dtype, device=table.device)
    h = torch.empty_like(x)
    embed_norm_kernel[(T,)](ids, table, norm_w.contiguous(), x, h, float(eps), N=N,
                            BLOCK=triton.next_power_of_2(N), num_warps=8, INTERPRET=interpreting(), **_f16_outputs(h),
                            **pdl_args(table.device))
    return x, h


def mtp_input(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, enorm_w: torch.Tensor,
              hnorm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """ops.mtp_input(table[ids], hidden, enorm_w, hnorm_w, eps) in one PDL launch: bf16 [T, 2N]."""
    _check(ids, table, enorm_w, hnorm_w)
    T, N, ids = ids.shape[0], table.shape[1], ids.contiguous()
    assert hidden.shape == (T, N) and hidden.dtype == torch.bfloat16
    out = torch.empty(T, 2 * N, dtype=table.dtype, device=table.device)
    mtp_input_kernel[(T, 2)](ids, table, hidden.contiguous(), enorm_w.contiguous(), hnorm_w.contiguous(), out,
                             float(eps), N=N, BLOCK=triton.next_power_of_2(N), num_warps=8, INTERPRET=interpreting(),
                             **pdl_args(table.device))
    return out


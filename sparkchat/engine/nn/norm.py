"""RMSNorm variants, computed in fp32 as the reference does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from sparkchat.engine.nn.linear import GEMV_MAX_TOKENS
from sparkchat.engine.nn.ops import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        # GPU path for the residual add fused with this norm (fastpath installs kernels' add_rms_norm
        # on CUDA models only)
        self.fast_add: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        # set by fastpath.install (SPARKCHAT_MOE_ADD_NORM=2, SPARKCHAT_SPLIT_MOE_INPUT_NORM=1): this norm's
        # output is read first by kernels that can finish a split norm as they load its input (SplitNorm)
        self.split_ok = False
        # the longest window whose norm is split where split_ok (fastpath.install; SPARKCHAT_SPLIT_NORM_WINDOW)
        self.split_window = 1

    def splits(self, x: torch.Tensor) -> bool:
        """True when this norm of x (a window of x.shape[0] tokens) is left for its readers to finish."""
        return self.split_ok and x.shape[0] <= self.split_window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor,
                 pending: torch.Tensor | NormedInput | SplitNormInput | PendingSum,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + pending, self(x + pending)): the residual add fused with the norm (on the GPU path, for the
        same decode/verify windows as the output projection's add+norm). A NormedInput made for this norm
        is both already: x is the sum; a SplitNormInput half of it (SplitNormInput.output). A PendingSum's
        two outputs are added first (in the same launch on the GPU path)."""
        if isinstance(pending, NormedInput):
            assert pending.norm is self, "a NormedInput made for another norm"
            return x, pending.h
        if isinstance(pending, SplitNormInput):  # x is the sum already; the norm's second half is left
            assert pending.norm is self, "a SplitNormInput made for another norm"
            return x, pending.output(x)
        if isinstance(pending, PendingSum):
            if pending.join is not None:
                pending.join()
            routed, shared = pending.routed, pending.shared
            if (self.fast_add is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_TOKENS
                    and x.dtype == routed.dtype == shared.dtype == self.weight.dtype == torch.bfloat16):
                return self.fast_add(x, routed, self.weight, self.eps, add=shared)
            pending = routed + shared
        if (self.fast_add is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_TOKENS
                and x.dtype == pending.dtype == self.weight.dtype == torch.bfloat16):
            return self.fast_add(x, pending, self.weight, self.eps)
        return ops.add_rms_norm(x, pending, self.weight, self.eps)


@dataclass
class NormedInput:
    """A layer's MLP output already added to the residual stream and normed by the norm after it (a MoE
    layer's last launch did both: MoE.forward's add_norm): what `norm.add_norm` then returns as is."""
    h: torch.Tensor
    norm: RMSNorm


@dataclass
class SplitNormInput:
    """A MoE layer's output added to the residual stream, with the sums of squares of that sum in parts:
    the first half of `norm` (the routed experts' last launch did it: mxfp4_moe_add_sumsq). `output`
    gives the norm's output: where the norm allows it (split_ok), a tensor the next projection's GEMV
    writes as it applies the norm (h.split_norm, fp8_gemv.SplitNorm), else written at once."""
    ssq: torch.Tensor
    norm: RMSNorm

    def output(self, s: torch.Tensor) -> torch.Tensor:
        from sparkchat.engine.kernels.fp8_gemv import SplitNorm

        split = SplitNorm(s, self.ssq, self.norm.weight, self.norm.eps)
        h = torch.empty_like(s)
        if not self.norm.split_ok:
            return split.finish(h)
        h.split_norm = split
        return h


@dataclass
class PendingSum:
    """A MoE layer's output as its two parts, not yet added: the routed experts' and the shared expert's
    (made on a side stream; `join` makes the current stream wait for it). The next norm's add+norm adds
    them, so the routed experts' last launch need not wait for the side stream (MoE.late_shared_add)."""
    routed: torch.Tensor
    shared: torch.Tensor
    join: Callable[[], None] | None = None


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, times weight, times sigmoid(gate); all in fp32 (KDA's output norm)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x32 * torch.sigmoid(gate.float())).to(x.dtype)

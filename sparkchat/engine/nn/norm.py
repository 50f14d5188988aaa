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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, pending: torch.Tensor | NormedInput) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + pending, self(x + pending)): the residual add fused with the norm (on the GPU path, for the
        same decode/verify windows as the output projection's add+norm). A NormedInput made for this norm
        is both already: x is the sum."""
        if isinstance(pending, NormedInput):
            assert pending.norm is self, "a NormedInput made for another norm"
            return x, pending.h
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


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, times weight, times sigmoid(gate); all in fp32 (KDA's output norm)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x32 * torch.sigmoid(gate.float())).to(x.dtype)

"""RMSNorm variants, computed in fp32 as the reference does."""

from __future__ import annotations

from collections.abc import Callable

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

    def add_norm(self, x: torch.Tensor, pending: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + pending, self(x + pending)): the residual add fused with the norm (on the GPU path, for the
        same decode/verify windows as the output projection's add+norm)."""
        if (self.fast_add is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_TOKENS
                and x.dtype == pending.dtype == self.weight.dtype == torch.bfloat16):
            return self.fast_add(x, pending, self.weight, self.eps)
        return ops.add_rms_norm(x, pending, self.weight, self.eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, times weight, times sigmoid(gate); all in fp32 (KDA's output norm)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x32 * torch.sigmoid(gate.float())).to(x.dtype)

"""A linear layer whose weight may be plain or FP8 block-scaled (the fp4 release's non-expert form).

Both forms keep the checkpoint's [out, in] layout. The FP8 form runs through pure-torch
dequantization here (the reference path); the GPU fast path swaps in a Triton GEMV.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight: torch.Tensor | None = None  # [out, in], plain or float8_e4m3fn
        self.weight_scale_inv: torch.Tensor | None = None  # [ceil(out/B0), ceil(in/B1)] fp32, FP8 only
        self.block: tuple[int, int] = (128, 128)

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale_inv is not None

    def set_weight(self, weight: torch.Tensor, scale_inv: torch.Tensor | None = None,
                   block: tuple[int, int] = (128, 128)) -> None:
        self.weight = weight
        self.weight_scale_inv = scale_inv
        self.block = block

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a plain [out, in] tensor of `dtype` (dequantized when FP8)."""
        if self.weight_scale_inv is None:
            return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
        from sparkchat.engine.quant import dequant_fp8_block

        return dequant_fp8_block(self.weight, self.weight_scale_inv, block=self.block, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight(x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8={self.is_fp8}"

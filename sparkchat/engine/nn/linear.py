"""A linear layer whose weight may be plain or FP8 block-scaled (the fp4 release's non-expert form).

Both forms keep the checkpoint's [out, in] layout. FP8 runs through pure-torch dequantization here (the
reference path); on CUDA a Triton GEMV streams the FP8 bytes instead for decode and verify windows
(`fast`), and a Triton GEMM reads them as FP8 for prompts (`fast_prompt`: no dequantized copy). Projections
that read the same input are fused at load time into one weight, so one launch streams them all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sparkchat.engine.nn.ops import ops

# Decode and verify steps (≤ this many tokens) use the GEMV kernel; prefill uses dequantize + matmul.
GEMV_MAX_TOKENS = 8


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight: torch.Tensor | None = None  # [out, in], plain or float8_e4m3fn
        self.weight_scale_inv: torch.Tensor | None = None  # [ceil(out/B0), ceil(in/B1)] fp32, FP8 only
        self.block: tuple[int, int] = (128, 128)
        self.cache_dense = False  # keep a dequantized copy (CPU: small models run much faster)
        self._dense: torch.Tensor | None = None
        self.fast: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.fast_prompt: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # GPU path for an output projection followed by the residual add and RMSNorm (see project_add_norm)
        self.fast_add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale_inv is not None

    def set_weight(self, weight: torch.Tensor, scale_inv: torch.Tensor | None = None,
                   block: tuple[int, int] = (128, 128)) -> None:
        self.weight = weight
        self.weight_scale_inv = scale_inv
        self.block = block
        self._dense = None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a plain [out, in] tensor of `dtype` (dequantized when FP8)."""
        if self._dense is not None and self._dense.dtype == dtype:
            return self._dense
        if self.weight_scale_inv is None:
            w = self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
        else:
            from sparkchat.engine.quant import dequant_fp8_block

            w = dequant_fp8_block(self.weight, self.weight_scale_inv, block=self.block, dtype=dtype)
        if self.cache_dense:
            self._dense = w
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_fp8:
            if x.shape[0] <= GEMV_MAX_TOKENS:
                fast = self.fast
            else:
                fast = self.fast_prompt if x.dtype == torch.bfloat16 else None  # the prompt kernels take bf16
            if fast is not None:
                return fast(x, self.weight, self.weight_scale_inv)
        if getattr(x, "split_norm", None) is not None:  # a norm's output the fast GEMV would have written
            from sparkchat.engine.kernels.fp8_gemv import take_split_norm

            x = take_split_norm(x).finish(x)
        return F.linear(x, self.dense_weight(x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8={self.is_fp8}"


class FusedLinear(Linear):
    """Several projections of the same input in one weight; `split(y)` gives each one's output.

    FP8 parts are padded to whole scale blocks of rows so every block keeps its own scale. The parts'
    own Linear modules are re-pointed at views of the fused weight: nothing is stored twice.
    """

    def __init__(self, parts: list[Linear]) -> None:
        fp8 = parts[0].is_fp8
        b0 = parts[0].block[0] if fp8 else 1
        padded = [-(-p.out_features // b0) * b0 for p in parts]
        super().__init__(parts[0].in_features, sum(padded))
        self.offsets = [sum(padded[:i]) for i in range(len(parts))]
        self.sizes = [p.out_features for p in parts]
        w = parts[0].weight.new_zeros(self.out_features, self.in_features)
        for p, off in zip(parts, self.offsets):
            w[off:off + p.out_features] = p.weight
        scale = None
        if fp8:
            scale = torch.cat([p.weight_scale_inv for p in parts])
        self.set_weight(w, scale, parts[0].block)
        for p, off in zip(parts, self.offsets):
            p.weight = w[off:off + p.out_features]
            if fp8:
                p.weight_scale_inv = scale[off // b0: (off + p.out_features + b0 - 1) // b0]

    @staticmethod
    def can_fuse(parts: list[Linear]) -> bool:
        first = parts[0]
        return all(p.is_fp8 == first.is_fp8 and p.in_features == first.in_features and p.block == first.block
                   and p.weight.dtype == first.weight.dtype and p.weight.device == first.weight.device
                   for p in parts)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return [y[..., off:off + n] for off, n in zip(self.offsets, self.sizes)]


def project(fused: FusedLinear | None, parts: list[Linear], x: torch.Tensor) -> list[torch.Tensor]:
    """Each part's output, through the fused weight when there is one."""
    if fused is None:
        return [p(x) for p in parts]
    return fused.split(fused(x))


def project_norm(lin: Linear, x: torch.Tensor, norm_w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(lin(x), RMSNorm of it): a projection and the norm right after it (the MTP layer's eh_proj and its
    input norm), in the output projection's add+norm launches with no residual on the GPU path
    (`fast_add_norm`), else lin and ops.rms_norm."""
    if (lin.fast_add_norm is not None and lin.is_fp8 and x.shape[0] <= GEMV_MAX_TOKENS
            and norm_w.dtype == x.dtype == torch.bfloat16):
        return lin.fast_add_norm(x.contiguous(), lin.weight, lin.weight_scale_inv, None, norm_w, eps)
    y = lin(x)
    return y, ops.rms_norm(y, norm_w, eps)


def project_add_norm(lin: Linear, o: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
                     eps: float, split: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + lin(o), RMSNorm of that sum): a layer's output projection and the add and norm after
    it, in one GEMV plus its split-K reduce on the GPU path (`fast_add_norm`), else ops.add_rms_norm.
    split (the norm's readers can finish it: RMSNorm.splits): the GEMV writes the sum and its sums of
    squares only, and the norm's output comes unwritten (its `.split_norm`)."""
    if (lin.fast_add_norm is not None and lin.is_fp8 and o.shape[0] <= GEMV_MAX_TOKENS
            and residual.dtype == norm_w.dtype == o.dtype == torch.bfloat16):
        extra = {"split_norm": True} if split else {}
        return lin.fast_add_norm(o.contiguous(), lin.weight, lin.weight_scale_inv, residual.contiguous(), norm_w, eps,
                                 **extra)
    return ops.add_rms_norm(residual, lin(o), norm_w, eps)

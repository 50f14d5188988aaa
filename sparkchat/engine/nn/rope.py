"""Rotary embeddings for the MLA rope dims: interleaved pairs, optional YaRN scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding:
    """cos/sin tables for positions [0, max_positions), built once on the target device."""

    def __init__(self, dim: int, theta: float, max_positions: int, scaling: dict[str, Any] | None,
                 device: torch.device | str = "cpu") -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.attention_factor = 1.0
        self.softmax_mscale = 1.0  # multiplies the softmax scale (YaRN with mscale_all_dim)
        if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
            inv_freq = self._yarn_inv_freq(inv_freq, dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, dim/2]
        self.cos = (freqs.cos() * self.attention_factor).to(device)
        self.sin = (freqs.sin() * self.attention_factor).to(device)

    @staticmethod
    def table_bytes(dim: int, max_positions: int) -> int:
        """What the cos and sin tables take: fp32 [max_positions, dim / 2] each."""
        return 2 * max_positions * (dim // 2) * 4

    def _yarn_inv_freq(self, inv_freq: torch.Tensor, dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
        factor = float(s["factor"])
        original = float(s["original_max_position_embeddings"])
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if s.get("attention_factor") is not None:
            self.attention_factor = float(s["attention_factor"])
        elif mscale and mscale_all_dim:
            self.attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            self.attention_factor = _yarn_mscale(factor)
        if mscale_all_dim:
            self.softmax_mscale = _yarn_mscale(factor, mscale_all_dim) ** 2
        beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp
        return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x0,x1),(x2,x3)… of the last dim. x: [T, ..., d]; cos/sin: [T, d/2].

    The result is laid out [rotated evens | rotated odds]; q and k get the same layout, so their
    dot products equal those of the interleaved form (and the reference's).
    """
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

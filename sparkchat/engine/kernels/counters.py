"""Arrival counters for kernels whose last-finishing program does a final step (the KDA output norm,
the MoE slot sum): int32 buffers kept zero between launches by the kernels themselves, so no launch
needs a fill kernel first. One buffer per (user, device), allocated by the first call — outside any
CUDA graph capture, as the engine runs a step before capturing it."""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(user: str, device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters for `user` on `device`."""
    key = (user, torch.device(device))
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < n:
        buf = _BUFFERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf

"""Programmatic dependent launch (PDL, sm_90 and newer: the H200 and the DGX Spark's GB10 alike).

A decode step is ~500 short kernels, most of them latency-bound weight streams. Launched with PDL, a
kernel's programs may start while the previous kernel's last programs are still running: each one
first issues the loads that depend on nothing the previous kernels write (its weights), then waits
(`griddepcontrol.wait`: the previous kernel has finished and its writes are visible), then signals
that the next kernel may start. Inside a CUDA graph the dependency becomes a programmatic edge.

The rules every PDL kernel here keeps:
- before `pdl_wait`, read only constant data (weights, scales) or data written at least two kernels
  back (see below), and write nothing the kernel before may still read or write (the MoE's stage 1
  makes the shared expert's act from the MoE input before its wait: only stage 2 reads it, after its own);
- call `pdl_wait` on every path through the kernel, before touching activations or outputs;
- signal the next kernel only after waiting (`pdl_wait` does both). So when a kernel starts, its
  predecessor has passed its own wait, i.e. everything before the predecessor has finished: reading
  what the kernel two back wrote (the router's expert ids in the MoE's second stage) is safe pre-wait.

Off on CPUs, under Triton's interpreter, on GPUs older than sm_90, and with SPARKCHAT_PDL=0.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_ENABLED: dict[int, bool] = {}


def pdl_enabled(device: torch.device | str | int | None = None) -> bool:
    """True when kernels on `device` should launch with PDL."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or os.environ.get("SPARKCHAT_PDL", "1") == "0":
        return False
    if not torch.cuda.is_available():
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return False
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _ENABLED:
        _ENABLED[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _ENABLED[index]


def pdl_args(device: torch.device | str | int | None = None) -> dict:
    """Extra launch arguments: the kernel's PDL constexpr and Triton's launch option, or nothing."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel (finished, writes visible), then let the next one start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

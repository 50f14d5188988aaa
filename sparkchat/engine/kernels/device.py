"""What the kernels' launch shapes need to know about the GPU they run on."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def is_sm90(device: torch.device) -> bool:
    """True on sm_90 GPUs (the H100 and H200), where the L2 hints measured on them are on by default."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def interpreting() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1), where the kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)  # asked per launch on eager paths; the answer never changes
def max_shared_memory(device) -> int:
    """Shared memory one program may use on `device`, in bytes (the opt-in maximum): 227 KiB on the
    H200, 99 KiB on sm_12x parts such as the DGX Spark's GB10. Unlimited off CUDA (the interpreter)."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return 1 << 30
    try:
        from triton.runtime import driver

        index = torch.device(device).index
        return int(driver.active.utils.get_device_properties(
            torch.cuda.current_device() if index is None else index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - a driver without the query: assume the small (sm_12x) figure
        return 101376

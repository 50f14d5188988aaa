"""One shared-memory carveout for every Triton kernel this process loads.

An SM's L1 cache and shared memory are one array; the driver splits it per launch. Left to choose
(the default), it gives kernels that need little shared memory a small carveout and those that need a
lot (the MLA split kernel: 132 KiB; the verify's tensor-core GEMVs: cp.async stages) a large one, and
an SM can only change its split once the blocks on it have finished — a drain between neighbouring
kernels of different needs, where programmatic dependent launch would have overlapped them.
SPARKCHAT_SMEM_CARVEOUT=P sets the preferred carveout of every loaded kernel to P percent of the
maximum (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT); unset or 0 leaves the driver's choice.
`sync()` applies the current setting to the kernels loaded so far; kernels loaded later get it from a
Triton load hook.
"""

from __future__ import annotations

import ctypes
import os

_PREFERRED_CARVEOUT = 9  # CUfunction_attribute CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
_DRIVER_CHOICE = -1  # CU_SHAREDMEM_CARVEOUT_DEFAULT
_loaded: list[int] = []  # CUfunction handles seen by the load hook
_libcuda: ctypes.CDLL | None = None
_hooked = False


def carveout_percent() -> int:
    """The requested carveout in percent, or -1 for the driver's choice."""
    value = int(os.environ.get("SPARKCHAT_SMEM_CARVEOUT", "0") or "0")
    if not 0 <= value <= 100:
        raise ValueError(f"SPARKCHAT_SMEM_CARVEOUT={value}: a percentage 0-100 (0: the driver's choice)")
    return value if value > 0 else _DRIVER_CHOICE


def _set(function: int, percent: int) -> None:
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    rc = _libcuda.cuFuncSetAttribute(ctypes.c_void_p(function), ctypes.c_int(_PREFERRED_CARVEOUT),
                                     ctypes.c_int(percent))
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute(preferred carveout {percent}) failed: CUresult {rc}")


def _on_load(module, function, name, metadata_group, hash) -> None:  # triton's InitHandleHook signature
    _loaded.append(function)
    percent = carveout_percent()
    if percent != _DRIVER_CHOICE:
        _set(function, percent)


def sync() -> int:
    """Hook future kernel loads and apply the current setting to every kernel loaded since; returns the
    number of kernels set. A no-op without a CUDA driver."""
    global _hooked
    try:
        from triton import knobs
    except ImportError:
        return 0
    if not _hooked:
        knobs.runtime.kernel_load_end_hook.add(_on_load)
        _hooked = True
    percent = carveout_percent()
    for function in _loaded:
        _set(function, percent)
    return len(_loaded)

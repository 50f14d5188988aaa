"""Whether Triton can build kernels for this GPU at all, asked once before the fast path is offered.

The usual failure is on the DGX Spark: Triton before 3.6 bundles only a CUDA 12.8 ptxas, which does not
know sm_121a, and every kernel then fails on its first launch, in the middle of an answer. One tiny
kernel compiled for the device's architecture turns that into a one-line reason the switches show,
while the engine answers through its torch path."""

from __future__ import annotations

import functools

import triton
import triton.language as tl


@triton.jit
def _probe_kernel(out):
    tl.store(out, 1.0)


@functools.lru_cache(maxsize=None)
def compile_failure(arch: int) -> str | None:
    """None when Triton compiles a kernel for sm_<arch> (e.g. 90, 121), else why not, in one line."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        triton.compile(ASTSource(fn=_probe_kernel, signature={"out": "*fp32"}, constexprs={}),
                       target=GPUTarget("cuda", arch, 32))
    except Exception as e:  # noqa: BLE001 - any failure to build means no kernels here; say which
        return f"Triton cannot compile for sm_{arch} ({_first_line(e)}); {_advice(arch)}"
    return None


def _first_line(e: BaseException) -> str:
    """The line of a compiler error that names the cause (ptxas writes it after Triton's preamble)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines:
        if "fatal" in line or "error :" in line or line.lower().startswith("error"):
            return line
    return lines[0] if lines else type(e).__name__


def _advice(arch: int) -> str:
    from triton import knobs

    if arch >= 100 and hasattr(knobs.nvidia, "ptxas_blackwell"):  # Triton >= 3.6 keeps a ptxas for these
        return "point TRITON_PTXAS_BLACKWELL_PATH at CUDA 13's ptxas (e.g. /usr/local/cuda/bin/ptxas)"
    return "install Triton 3.6 or newer, or point TRITON_PTXAS_PATH at CUDA 13's ptxas (e.g. /usr/local/cuda/bin/ptxas)"

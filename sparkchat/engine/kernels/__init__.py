"""Triton decode kernels (weight-streaming GEMVs) and their pure-torch twins.

    from sparkchat.engine.kernels.mxfp4_moe import mxfp4_moe, mxfp4_moe_workspace
    from sparkchat.engine.kernels import fp8_block_gemv, fp8_head_gemv, fp8_head_argmax

Kernel modules import triton, so they load on first use; `reference` (torch only) works everywhere.
(`mxfp4_moe` is also the name of its module, so import that one from the module.)
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "mxfp4_moe_workspace": "mxfp4_moe",
    "MoeConfig": "mxfp4_moe",
    "MoeWorkspace": "mxfp4_moe",
    "fp8_block_gemv": "fp8_gemv",
    "fp8_head_gemv": "fp8_gemv",
    "fp8_head_argmax": "fp8_gemv",
    "fp8_head_argmax_workspace": "fp8_gemv",
    "GemvConfig": "fp8_gemv",
    "mxfp4_moe_reference": "reference",
    "fp8_block_gemv_reference": "reference",
    "fp8_head_gemv_reference": "reference",
    "fp8_head_argmax_reference": "reference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(name)

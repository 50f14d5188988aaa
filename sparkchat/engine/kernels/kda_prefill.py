"""A prompt's KDA layers on the GPU through fla-core's chunked kernels (the twin: nn.kda.kda_chunked).

Prefill runs each KDA layer's delta rule over the whole prompt. Our torch chunked form, even with 16
chunks at once, takes 8–10 µs a token a layer on the H200; fla-core's `chunk_kda` (the kernels the
transformers reference itself calls on a GPU) 0.7–1.4. It gets what the reference gives it:
q, k, v after the conv in the model dtype (q and k L2-normed by the caller, as its kernel would), the
gate and beta in the model dtype, the fp32 state.

On by default where fla-core is installed (`pip install 'sparkchat[cuda]'`; SPARKCHAT_FLA_PREFILL=0 keeps
the torch form): on the H200, 0.11 against 0.41 ms a prompt token for the whole model at 8192 tokens
(docs/benchmarks.md, session 16). Its kernels compile and autotune on first use — ~98 s once on a
machine, ~8 s in each later process (Triton keeps both on disk) — so Engine.load pays it (warm_up)
rather than the first prompt. Without fla-core, or when it fails to import or to run, prompts keep
the torch form.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

FLA_HEAD_DIMS = (64, 128, 256)  # head sizes its kernels' tiles are built for (Ling-3.0-flash: 128)
_LOADED: dict[str, Callable | None] = {}


def fla_chunk_kda() -> Callable | None:
    """fla-core's chunk_kda, or None (turned off, not installed, or not importable here)."""
    if os.environ.get("SPARKCHAT_FLA_PREFILL", "1") == "0":
        return None
    if "chunk_kda" not in _LOADED:
        try:
            from fla.ops.kda import chunk_kda
        except Exception:  # noqa: BLE001 — any import failure means the torch form
            chunk_kda = None
        _LOADED["chunk_kda"] = chunk_kda
    return _LOADED["chunk_kda"]


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk_kda: Callable) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q, k, v, g: [T, h, d] (after the conv; q and k L2-normed, not scaled; the gate in log space),
    beta: [T, h], all in the model dtype; state: [h, d, d] fp32 (not written). Returns (o [T, h, d] in the
    model dtype, the final state fp32), as kda_chunked computes them from the scaled fp32 q and k — or None when
    fla-core's kernels fail here (a GPU its Triton kernels do not support): then, and from then on, the
    caller keeps the torch form."""
    try:
        return _chunk(q, k, v, g, beta, state, chunk_kda)
    except Exception as e:  # noqa: BLE001 — nothing was written yet: the torch form can take over
        _LOADED["chunk_kda"] = None
        warnings.warn(f"fla-core's chunked KDA failed on this GPU, prompts use the torch form: {e}", stacklevel=2)
        return None


def _chunk(q, k, v, g, beta, state, chunk_kda):
    # q and k come L2-normed: fla's in-kernel norm is specialized and autotuned per 2048 prompt tokens (a
    # constexpr of ceil(rows / 65536)), ~9.5 s on the H200 for each new band of lengths, past any warm-up;
    # normed here, no length pays again (H200: 0.00-0.01 s at 1000-12000 tokens, docs/benchmarks.md)
    o, final = chunk_kda(q.unsqueeze(0).contiguous(), k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous(),
                         g.unsqueeze(0).contiguous(), beta.unsqueeze(0).contiguous(), scale=q.shape[-1] ** -0.5,
                         initial_state=state.unsqueeze(0).contiguous(), output_final_state=True,
                         use_qk_l2norm_in_kernel=False)
    return o[0], final[0].float()


WARM_UP_STAGE = "compiling the GPU's prompt kernels (a minute or two the first time on this machine)"


def warm_up(heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
            stage: Callable[[str], None] | None = None) -> bool:
    """Compile (and on a new machine autotune) fla-core's kernels for the model's KDA shape now, on a
    64-token dummy prompt, so the first real prompt does not wait for it; `stage` hears WARM_UP_STAGE
    when that starts. True when they are ready; False when prompts will use the torch form (off, not
    installed, another head size, a failure)."""
    if device.type != "cuda" or head_dim not in FLA_HEAD_DIMS:
        return False
    chunk_kda = fla_chunk_kda()  # imports fla-core: only where it could run
    if chunk_kda is None:
        return False
    if stage is not None:
        stage(WARM_UP_STAGE)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(64, heads, head_dim, device=device, dtype=dtype, generator=gen) for _ in range(3))
    g = -torch.rand(64, heads, head_dim, device=device, generator=gen).to(dtype)
    beta = torch.rand(64, heads, device=device, generator=gen).to(dtype)
    state = torch.zeros(heads, head_dim, head_dim, device=device)
    return kda_prefill(q, k, v, g, beta, state, chunk_kda) is not None

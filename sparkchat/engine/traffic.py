"""What a decode step moves through memory, and how fast this machine reads it.

Batch-1 decoding is memory-bound: a step's time is about the bytes of weights and state it reads over
the read bandwidth. The byte counts come from the loaded modules (so they follow the checkpoint's
formats and the switches in use); the bandwidth is measured, as a large reduction reads it."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from sparkchat.engine.model import LingModel
from sparkchat.engine.nn.kda import KimiDeltaAttention
from sparkchat.engine.nn.linear import Linear
from sparkchat.engine.nn.moe import MoE


def tensor_bytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _expert_bytes(experts: Any) -> int:
    """One routed expert's weights (and MXFP4 scales) as a MoE kernel reads them."""
    mx = experts.is_mxfp4
    return tensor_bytes(experts.w13[0], experts.w2[0], experts.w13_scale[0] if mx else None,
                        experts.w2_scale[0] if mx else None)


def _modules_bytes(model: LingModel, modules: Iterable[Any]) -> int:
    """Bytes one token's pass through `modules` reads (KDA states also written): each linear once (a
    fused projection's parts as the fused weight), a MoE's router and `num_experts_per_tok` experts."""
    cfg = model.cfg
    fused_parts = {id(p) for m in model.modules() if getattr(m, "fused", None) is not None
                   for p in m.input_projections()}
    total = 0
    for m in modules:
        if isinstance(m, Linear) and id(m) not in fused_parts:
            if m.cache_dense:  # read as a dequantized copy in the compute dtype
                total += m.weight.numel() * model.embed.element_size()
            else:
                total += tensor_bytes(m.weight, m.weight_scale_inv)
        elif isinstance(m, MoE):
            total += cfg.num_experts_per_tok * _expert_bytes(m.experts) + tensor_bytes(m.gate.weight)
        elif isinstance(m, KimiDeltaAttention):
            total += 2 * cfg.num_attention_heads * cfg.head_dim ** 2 * 4  # fp32 state read + write
    return total


def _latent_cache_bytes(model: LingModel, context: int) -> int:
    """One MLA layer's latent cache at `context` tokens, as a decode step reads it."""
    cfg = model.cfg
    return context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * model.embed.element_size()


def decode_bytes(model: LingModel, context: int, fp8_head: bool) -> int:
    """Bytes one decode step reads (and KDA states also write), counted from the loaded modules."""
    total = _modules_bytes(model, (m for layer in model.layers for m in layer.modules()))
    total += len(model.cfg.mla_layers) * _latent_cache_bytes(model, context)
    head = model.lm_head
    total += tensor_bytes(head.fp8_weight, head.fp8_scale) if fp8_head else tensor_bytes(head.weight)
    return total


def draft_step_bytes(model: LingModel, context: int, head_bytes: int) -> int:
    """Bytes one MTP draft step reads: the NextN layer (its latent cache at `context`) and `head_bytes`
    of head (LMHead.draft_bytes: the truncated copy when draft rows are set)."""
    return _modules_bytes(model, model.mtp.modules()) + _latent_cache_bytes(model, context) + head_bytes


def verify_bytes(model: LingModel, context: int, tokens: int, distinct_experts: float) -> int:
    """Bytes a verify of `tokens` reads and writes: a decode step's, plus the experts beyond one
    token's 8 per MoE layer, plus for each KDA layer its kept inputs and the state read a second time
    (the verify reads it and leaves it; the commit after it reads and writes it: kda_commit)."""
    cfg = model.cfg
    moe = [m for m in model.modules() if isinstance(m, MoE) and m is not getattr(model.mtp, "mlp", None)]
    per_expert = _expert_bytes(moe[0].experts) if moe else 0
    kda_layers = sum(isinstance(m, KimiDeltaAttention) for m in model.modules())
    kept = kda_layers * cfg.num_attention_heads * (cfg.head_dim ** 2 + tokens * 4 * cfg.head_dim) * 4
    extra = max(0.0, distinct_experts - cfg.num_experts_per_tok) * per_expert * len(moe)
    return int(decode_bytes(model, context, model.lm_head.use_fp8) + extra + kept)


def measure_read_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Bytes/s a large reduction reads (the figure % of bandwidth is quoted against): `nbytes` of fp32
    ones (default 4 GiB on a GPU, far beyond any L2; 256 MiB on the CPU), the median of `iters` sums."""
    nbytes = nbytes or ((4 << 30) if device.type == "cuda" else (256 << 20))
    buf = torch.ones(nbytes // 4, device=device)
    return buf.numel() * 4 / median_time(lambda: buf.sum(), device, iters=iters)


@functools.lru_cache(maxsize=None)
def read_bandwidth(device: torch.device) -> float:
    """This process's figure for `device`, measured once (on a GPU over 1 GiB, a quarter of the bench's
    buffer and still many times any L2, or 256 MiB where a loaded model leaves less; on the CPU as the
    bench does, in fewer sums): what the chat's live stats quote against. 0.0 where no buffer fits —
    the stats then leave the figure out rather than the load failing for it."""
    if device.type != "cuda":
        return measure_read_bandwidth(device, None, iters=3)
    for nbytes in (1 << 30, 256 << 20):
        try:
            return measure_read_bandwidth(device, nbytes, iters=10)
        except torch.cuda.OutOfMemoryError:
            continue
        finally:  # give the buffer's block back: on the Spark the GPU's memory is everyone's memory
            torch.cuda.empty_cache()
    return 0.0


def median_time(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Seconds `fn` takes, the median of `iters` calls after two warm-up calls (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def capture_graph(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph, after one call to compile and warm up outside the capture and one
    on a side stream (as capture requires). fn runs twice here; the capture itself runs nothing."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def median_graph_time(fn: Callable[[], Any], iters: int) -> float:
    """Seconds one call of `fn` takes on the GPU, captured in a CUDA graph: the median of `iters`
    replays, each queued behind an untimed one so that it starts the moment the GPU is free — the
    kernels' own time, as the engine's graphed steps run them, without the gaps eager launches leave
    while the host catches up (median_time's timing of eager calls)."""
    graph = capture_graph(fn)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()  # the GPU busy while the timed replay is queued
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del graph
    times.sort()
    return times[len(times) // 2]

"""`sparkchat bench`: NVIDIA's published table, measured side by side in one run —
baseline → +MXFP4 kernels → +FP8 head → +MTP — with TPOT, tok/s, bytes per token, achieved GB/s,
% of the measured read bandwidth, the verify-to-decode cost ratio and a projected DGX Spark tok/s."""

from __future__ import annotations

from contextlib import contextmanager

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from sparkchat.engine.generate import Decoder
from sparkchat.engine.model import LingModel
from sparkchat.engine.state import ConversationState
from sparkchat.engine.traffic import (decode_bytes, draft_step_bytes, measure_read_bandwidth, median_graph_time,
                                      median_time, tensor_bytes, verify_bytes)

SPARK_READ_BW = 234e9  # bytes/s, the DGX Spark's measured read bandwidth (public report)
PUBLISHED_ACCEPT_LENGTH = 2.68  # NVIDIA's MTP accept length on GSM8K, 3 draft steps


@dataclass
class BenchRow:
    name: str
    tpot_ms: float
    tok_s: float
    bytes_per_token: int | None  # None for MTP: a draft+verify cycle's bytes depend on the routing
    gb_s: float | None
    pct_read_bw: float | None
    projected_spark_tok_s: float
    note: str = ""


@dataclass
class BenchResult:
    device: str
    context: int
    read_bw_gb_s: float
    graphs: bool
    rows: list[BenchRow] = field(default_factory=list)
    verify_decode_ratio: float | None = None
    draft_steps: int = 0
    draft_step_ms: float | None = None  # the draft step the MTP row uses (the truncated head's when on)
    # the truncated draft head (None when off): its rows, and the draft step with the full head beside it
    draft_vocab: int | None = None
    draft_head_bytes: int | None = None  # one draft step's head read, as the MTP row runs it
    draft_step_full_head_ms: float | None = None
    draft_head_full_bytes: int | None = None
    accept_length_full_head: float | None = None
    mtp_full_head_tpot_ms: float | None = None  # the MTP row's per-token time, had the draft used the full head
    verify_ms: float | None = None
    verify_pct_read_bw: float | None = None  # bytes a verify reads and writes ÷ its time, vs read BW
    # the same verify with routing that repeats half the experts between neighbouring tokens, as real
    # models' routing does (synthetic weights route every token to fresh experts)
    verify_correlated_ms: float | None = None
    verify_correlated_decode_ratio: float | None = None
    verify_correlated_pct_read_bw: float | None = None
    verify_routing_wrapper_ms: float | None = None  # the correlated-routing wrapper's own cost, left out above
    # the speculative loop as a user runs it (generate_tokens: draft, verify, accept, commit, stream),
    # timed per cycle; synthetic weights accept no draft, so every cycle rolls back (the worst case)
    loop_cycle_ms: float | None = None
    loop_tokens_per_cycle: float | None = None
    loop_tpot_ms: float | None = None  # loop_cycle_ms at the MTP row's accept length
    # of each cycle, the GPU time between a verify's end and the next draft chain's start (CUDA only):
    # what the host's work between the cycle's sync and the next launches leaves the GPU
    loop_gap_ms: float | None = None
    # plain decoding (no MTP) as a user runs it (generate_tokens: step, pick, stream), a token at a time:
    # the "+ FP8 LM head" row replays its graph back to back, which hides the host's work between steps
    decode_loop_ms: float | None = None
    accept_length: float | None = None
    accept_length_source: str = ""
    first_step_s: float | None = None  # the first fast decode step: kernel compilation + graph capture
    # the Spark projection's parts (project_spark): the FP8 head's GEMV alone as % of the read bandwidth,
    # the fastest decode row's time beyond streaming its bytes at that efficiency, and that row's
    # projection in the older form, every part of its time scaled with the bandwidth (launches and
    # dependency chains included, which do not slow down with it)
    stream_efficiency_pct: float | None = None
    spark_latency_ms: float | None = None
    spark_scaled_tok_s: float | None = None
    prefill_tokens: int = 0
    prefill_ms_per_token: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def project_spark(seconds: float, nbytes: float, bw: float, efficiency: float) -> float:
    """Seconds the work timed here (`seconds`, reading `nbytes` on a machine of read bandwidth `bw`)
    would take on the DGX Spark — a projection: its bytes at the Spark's read bandwidth at the
    streaming `efficiency` measured here, plus the time it spent here beyond streaming its bytes at
    that efficiency (launches, dependency chains, kernel tails), which does not shrink with bandwidth
    and is taken to cost the same there. At 18x less bandwidth a kernel streams 18x longer, so its
    launch and tail costs stop mattering: they are counted once, not scaled with the bytes."""
    streaming = nbytes / (bw * efficiency)
    return nbytes / (SPARK_READ_BW * efficiency) + max(0.0, seconds - streaming)


def measure_stream_efficiency(model: LingModel, device: torch.device, bw: float, iters: int) -> float:
    """The FP8 head's GEMV alone (the decode step's, with its argmax), as a share of `bw`: the largest
    weight stream of a step (157,184 rows, ~0.4 GB at full shape), long enough that its launch and tail
    hardly count — what the step's kernels reach where every launch streams long, as on the Spark.
    On a GPU timed in a CUDA graph, as the step runs it: timed as eager calls, the host's launch gaps
    moved the figure from run to run (71-91% on H100s where the same kernel graphed reads ~97%).
    Capped at 1: the Spark's figure is itself a measured read. Needs the FP8 head configured."""
    head = model.lm_head
    h = torch.randn(1, model.cfg.hidden_size, device=device, dtype=model.embed.dtype)
    calls = 8  # back to back: one launch's tail overlaps the next one's start, as in the step

    def stream():
        for _ in range(calls):
            head.argmax(h)

    if device.type == "cuda":
        seconds = median_graph_time(stream, iters) / calls
    else:
        seconds = median_time(stream, device, iters) / calls
    return min(1.0, tensor_bytes(head.fp8_weight, head.fp8_scale) / seconds / bw)


@contextmanager
def correlated_routing(apply: bool = True):
    """Route each token after the first to half of its predecessor's experts (its top half) plus
    its own best experts not among them: the overlap real models' routing shows between
    neighbouring tokens. Wraps whatever router is installed; graph-safe (no host sync). With
    apply=False the wrapper does the same work but keeps the router's choice: timing that against no
    wrapper gives the wrapper's own cost, which the correlated figure then leaves out."""
    from sparkchat.engine.nn.ops import ops

    inner = ops.route

    def route(x, *args):
        ids, weights = inner(x, *args)
        T, K = ids.shape
        if T == 1:
            return ids, weights
        # chained, "half of the previous token's" is the first token's top half for every token;
        # vectorized, so the wrapper adds a handful of small kernels per layer, not dozens
        keep = ids[:1, : K // 2]
        dup = (ids[:, :, None] == keep[:, None, :]).any(-1)
        order = torch.sort(dup.to(torch.int8), dim=1, stable=True).indices  # own experts not kept first
        own = ids.gather(1, order)[:, : K - K // 2]
        correlated = torch.cat([keep.expand(T, -1), own], dim=1)
        return (correlated if apply else ids), weights

    ops.route = route
    try:
        yield
    finally:
        ops.route = inner


def _configure(model: LingModel, experts: bool, fp8_head: bool) -> None:
    head = model.lm_head
    if fp8_head and head.fp8_weight is None:
        head.build_fp8()
    head.use_fp8 = fp8_head
    if model.embed.is_cuda:
        from sparkchat.engine import fastpath

        fastpath.install(model, linears=True, experts=experts, head=fp8_head)


def run_bench(model: LingModel, *, context: int = 1024, iters: int = 20, draft_steps: int = 3,
              graphs: bool = True, accept_length: float | None = None, prefill: int = 0,
              progress: Callable[[str], None] | None = None, draft_vocab: int | None = None,
              draft_rows: list[int] | None = None, accept_length_full_head: float | None = None) -> BenchResult:
    """Measure the four configurations on `model` at a context of `context` tokens.

    `accept_length`: measured on real weights by the caller; None means synthetic weights, and the
    MTP row then uses NVIDIA's published accept length (and says so).
    `draft_vocab`: the MTP row drafts through a head truncated to that many rows (`draft_rows`, else the
    lowest ids: the time does not depend on which rows), and the draft step is also timed with the full
    head; `accept_length` is then the truncated head's and `accept_length_full_head` the full one's.
    """
    device = model.embed.device
    cuda = device.type == "cuda"
    use_graphs = graphs and cuda
    state = ConversationState.allocate(model.cfg, max(context, prefill) + 64, device, model.embed.dtype)
    state.token_ids = [0] * context  # decode cost does not depend on what the cache holds
    state.mtp_length = context
    bw = measure_read_bandwidth(device)
    result = BenchResult(str(torch.cuda.get_device_name(device) if cuda else "cpu"), context, bw / 1e9, use_graphs)
    say = progress or (lambda _: None)

    # start-up: the first step of the fastest configuration compiles kernels and captures its graph
    _configure(model, True, True)
    t = time.perf_counter()
    Decoder(model, state, _graphs(model, state) if use_graphs else None).forward([1])[1].argmax(-1).tolist()
    result.first_step_s = time.perf_counter() - t

    def decode_time(experts: bool, fp8_head: bool, with_graphs: bool) -> float:
        _configure(model, experts, fp8_head)
        dec = Decoder(model, state, _graphs(model, state) if with_graphs else None)
        return median_time(lambda: dec.forward([1])[1].argmax(-1), device, iters)

    rows = [("baseline (dequantize-then-matmul experts, BF16 head)", False, False),
            ("+ MXFP4 expert kernels", True, False),
            ("+ FP8 LM head", True, True)]
    last = 0.0
    say("the FP8 head alone (streaming efficiency)")
    _configure(model, True, True)
    efficiency = measure_stream_efficiency(model, device, bw, iters)
    result.stream_efficiency_pct = 100 * efficiency
    for name, experts, fp8_head in rows:
        say(name)
        # the baseline expert path synchronizes with the host, so it cannot be captured
        g = use_graphs and experts
        t = decode_time(experts, fp8_head, g)
        nbytes = decode_bytes(model, context, fp8_head)
        result.rows.append(_row(name + (" [CUDA graph]" if g else " [eager]"), t, nbytes, bw, efficiency))
        last = t
    result.spark_latency_ms = 1000 * max(0.0, last - nbytes / (bw * efficiency))
    result.spark_scaled_tok_s = SPARK_READ_BW / (last * bw)

    if prefill:
        say(f"prefill of {prefill} tokens")
        result.prefill_tokens = prefill
        result.prefill_ms_per_token = 1000 * _prefill_time(model, prefill, device) / prefill

    if model.mtp is not None:
        say("+ MTP")
        _configure(model, True, True)
        head = model.lm_head
        head.set_draft_rows(None)
        dec = Decoder(model, state, _graphs(model, state) if use_graphs else None)
        k = result.draft_steps = draft_steps

        def draft():
            state.mtp_length = state.length - 1  # one catch-up slot, as after a verify
            dec.draft(1, k, _greedy(), None)

        def verify():
            dec.forward([1] * (k + 1), keep_steps=True)[1].argmax(-1)

        t_draft = t_draft_full = median_time(draft, device, iters)
        result.draft_step_full_head_ms = 1000 * t_draft_full / k
        result.draft_head_bytes = result.draft_head_full_bytes = head.draft_bytes()
        if draft_vocab and draft_vocab < model.cfg.vocab_size:
            head.set_draft_rows(draft_rows if draft_rows is not None else list(range(draft_vocab)))
            result.draft_vocab = int(head.draft_ids.numel())
            result.draft_head_bytes = head.draft_bytes()
            dec = Decoder(model, state, _graphs(model, state) if use_graphs else None)  # graphs of this head
            t_draft = median_time(draft, device, iters)
            head.set_draft_rows(None)
        t_verify = median_time(verify, device, iters)
        result.draft_step_ms, result.verify_ms = 1000 * t_draft / k, 1000 * t_verify
        result.verify_decode_ratio = t_verify / last
        cfg = model.cfg
        fresh = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** (k + 1))
        result.verify_pct_read_bw = 100 * verify_bytes(model, context, k + 1, fresh) / t_verify / bw
        # the routing wrapper adds small kernels of its own (~8 a MoE layer); time them and leave them out
        with correlated_routing(apply=False):
            dec = Decoder(model, state, _graphs(model, state) if use_graphs else None)
            t_wrapped = median_time(verify, device, iters)
        with correlated_routing():
            dec = Decoder(model, state, _graphs(model, state) if use_graphs else None)
            t_corr = median_time(verify, device, iters)
        result.verify_routing_wrapper_ms = 1000 * max(0.0, t_wrapped - t_verify)
        t_corr = max(t_corr - max(0.0, t_wrapped - t_verify), 1e-9)
        shared = cfg.num_experts_per_tok // 2
        distinct = cfg.num_experts_per_tok + k * (cfg.num_experts_per_tok - shared)
        result.verify_correlated_ms = 1000 * t_corr
        result.verify_correlated_decode_ratio = t_corr / last
        result.verify_correlated_pct_read_bw = 100 * verify_bytes(model, context, k + 1, distinct) / t_corr / bw
        al = accept_length if accept_length is not None else PUBLISHED_ACCEPT_LENGTH
        result.accept_length = al
        result.accept_length_source = "measured" if accept_length is not None else "assumed (NVIDIA's published 2.68)"
        t_token = (t_draft + t_verify) / al
        # the Spark projection of a cycle with a real model's routing (the accept length is a real model's):
        # k draft steps and the verify with half the experts repeated, bytes and time
        cycle_bytes = (k * draft_step_bytes(model, context, result.draft_head_bytes)
                       + verify_bytes(model, context, k + 1, distinct))
        spark = al / project_spark(t_draft + t_corr, cycle_bytes, bw, efficiency)
        name, note = f"+ MTP ({k} draft steps)", f"per token at accept length {al:.2f} ({result.accept_length_source})"
        if result.draft_vocab is not None:
            al_full = accept_length_full_head if accept_length_full_head is not None else al
            result.accept_length_full_head = al_full
            result.mtp_full_head_tpot_ms = 1000 * (t_draft_full + t_verify) / al_full
            n = result.draft_vocab
            name = f"+ MTP ({k} draft steps, draft head top {f'{n // 1024}K' if n % 1024 == 0 else f'{n:,}'})"
            note += (f"; the full draft head: {result.mtp_full_head_tpot_ms:.2f} ms at accept length "
                     f"{al_full:.2f}")
        result.rows.append(BenchRow(name, 1000 * t_token, 1 / t_token, None, None, None, spark, note))

        say("the MTP loop as it runs")
        if result.draft_vocab is not None:
            head.set_draft_rows(draft_rows if draft_rows is not None else list(range(draft_vocab)))
        cycle, per_cycle, gap = _loop_cycle(model, state, context, k, use_graphs)
        head.set_draft_rows(None)
        result.loop_cycle_ms, result.loop_tokens_per_cycle = 1000 * cycle, per_cycle
        result.loop_gap_ms = 1000 * gap if model.embed.is_cuda and use_graphs else None
        result.loop_tpot_ms = 1000 * cycle / al

    say("the decode loop as it runs")
    _configure(model, True, True)
    result.decode_loop_ms = 1000 * _loop_cycle(model, state, context, 0, use_graphs)[0]
    return result


def _loop_cycle(model: LingModel, state: ConversationState, context: int, k: int,
                use_graphs: bool, tokens: int = 40, temperature: float = 0.0) -> tuple[float, float, float]:
    """(seconds a speculative cycle, tokens a cycle, seconds of each cycle between a verify's end and the
    next draft chain's start on the GPU) of generate_tokens, greedy (or sampled at `temperature`), after
    a prompt that fills the context. Run twice: the first run captures the graphs the second one
    replays."""
    from sparkchat.engine.events import SamplingParams
    from sparkchat.engine.generate import generate_tokens

    prompt = [(i * 7919) % model.cfg.vocab_size for i in range(max(1, min(context, state.max_context - tokens - 8)))]
    graphs = _graphs(model, state) if use_graphs else None
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=0)
    for _ in range(2):
        state.reset()
        stamps, counts, gaps = [], [], []
        for out in generate_tokens(model, state, prompt, params, set(), mtp=True, draft_steps=k, graphs=graphs):
            stamps.append(time.perf_counter())
            counts.append(len(out.tokens))
            gaps.append(out.stats.host_gap_s)
        if model.embed.is_cuda:
            torch.cuda.synchronize()
    skip = 3  # the prompt's token and the first two cycles
    cycles = max(1, len(stamps) - 1 - skip)
    return (stamps[-1] - stamps[skip]) / cycles, sum(counts[skip + 1:]) / cycles, (gaps[-1] - gaps[skip]) / cycles


def _prefill_time(model: LingModel, n: int, device: torch.device) -> float:
    ids = torch.randint(0, model.cfg.vocab_size, (n,), device=device)

    def once():  # what a prompt costs before its first token: every layer, then the head at its last position
        state = ConversationState.allocate(model.cfg, n + 8, device, model.embed.dtype)
        hidden, _ = model(ids, 0, state)
        model.lm_head(hidden[-1:])

    return median_time(once, device, iters=2)


def _greedy():
    from sparkchat.engine.events import SamplingParams

    return SamplingParams(temperature=0.0)


def _graphs(model: LingModel, state: ConversationState):
    from sparkchat.engine.graphs import StepGraphs

    return StepGraphs(model, state)


def _row(name: str, seconds: float, nbytes: int, bw: float, stream_efficiency: float) -> BenchRow:
    achieved = nbytes / seconds
    return BenchRow(name=name, tpot_ms=1000 * seconds, tok_s=1 / seconds, bytes_per_token=nbytes,
                    gb_s=achieved / 1e9, pct_read_bw=100 * achieved / bw,
                    projected_spark_tok_s=1 / project_spark(seconds, nbytes, bw, stream_efficiency))

"""CUDA graphs for the fixed-shape steps: decode (1 token), verify (k+1 tokens), the MTP draft step,
and a draft's whole chain (its catch-up and k-1 more steps, each fed the token the previous one chose
on the device — its argmax, or a draw from its distribution: one replay and one host sync for k drafts,
where step by step took k of each).

Each graph is captured once per (step kind, token count, context bucket) against the conversation
state's own tensors, so replaying it updates that state in place. Positions live in a device buffer
and attention reads a fixed bucket of cache rows (masked past the position), so one graph serves every
position inside its bucket. Capture runs the step for real, so the KDA states are saved before and
put back after; it runs at the step's own positions, so the MLA cache rows it writes are rewritten by
the real step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparkchat.engine.events import SamplingParams
from sparkchat.engine.model import LingModel
from sparkchat.engine.nn.mla import Span
from sparkchat.engine.sampling import probabilities, race_draw
from sparkchat.engine.state import ConversationState

BUCKET_MIN = 1024


def bucket_for(length: int, max_context: int) -> int:
    """The smallest power-of-two bucket (≥ BUCKET_MIN) holding `length` cache rows."""
    b = BUCKET_MIN
    while b < length:
        b *= 2
    return min(b, max_context)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    pos: torch.Tensor
    hidden_in: torch.Tensor | None
    out: tuple[Any, ...]
    noise: torch.Tensor | None = None  # a sampled chain's uniform draws [k, draft rows], refilled per replay
    pick: torch.Tensor | None = None  # int64 [1]: the catch-up slot a chain drafts from (None: its last)
    how: tuple[Any, ...] = ()  # EagerSteps: (kind, bucket, keep_steps, chain, sampling) for run_step


def run_step(m: LingModel, state: ConversationState, kind: str, c: _Captured, bucket: int | tuple[int, ...],
             keep_steps: bool, chain: int = 0, sampling: SamplingParams | None = None) -> tuple[Any, ...]:
    """One step over c's input buffers (what a graph captures; run as is, the eager twin of its replay);
    a draft chain takes a bucket per draft (its catch-up's first), as replays step by step would:
    attention's splits follow the bucket, so the sums' order does too. A sampled chain (`sampling`)
    draws each draft from its distribution and returns those too."""
    if kind == "target":
        hidden, kept = m(c.ids, 0, state, keep_steps=keep_steps, span=Span(c.pos, bucket))
        return hidden, m.lm_head(hidden), kept
    T = c.ids.shape[0]
    buckets = bucket if isinstance(bucket, tuple) else (bucket,)
    with torch.inference_mode():
        h = m.mtp(c.ids, m.embed, c.hidden_in, Span(c.pos[:T], buckets[0]), state.mtp, m.rotary)
        if kind == "draft":
            return h, m.draft_logits(h[-1:])  # a catch-up over several slots drafts from its last only
        # a catch-up over every slot a verify may have accepted drafts from the one `pick` names
        h = h[-1:] if c.pick is None else h.index_select(0, c.pick)
        rows = m.lm_head.draft_ids  # the truncated draft head's vocabulary ids, or None
        tokens, qs = [], []
        for j in range(chain):
            if j:
                h = m.mtp(tokens[-1], m.embed, h, Span(c.pos[T + j - 1:T + j], buckets[j]),
                          state.mtp, m.rotary)
            if sampling is None:
                best = m.lm_head.argmax(h, draft=True)  # as Decoder.draft picks a greedy token
            else:
                qs.append(probabilities(m.draft_logits(h)[0], sampling))
                best = race_draw(qs[-1], c.noise[j]).view(1)
            # a gather, not rows[best]: indexing by a 0-d tensor reads it on the host (no capture)
            tokens.append(best if rows is None else rows.index_select(0, best))
        return (torch.cat(tokens),) if sampling is None else (torch.cat(tokens), torch.stack(qs))


def _step_inputs(model: LingModel, kind: str, T: int, start: int, chain: int = 0,
                 sampling: SamplingParams | None = None, graph: Any = None, pick: bool = False) -> _Captured:
    """A step's input buffers (ids, positions, hidden in, a sampled chain's noise, the slot a chain
    drafts from), outputs to come."""
    H, device = model.cfg.hidden_size, model.embed.device
    # Capture runs at the step's own positions: the cache rows it writes there are rewritten by the
    # real step right after (at position 0 it would clobber the conversation's first row).
    slots = T + max(chain - 1, 0)  # a chain's later steps sit one position after another
    c = _Captured(graph, torch.zeros(T, dtype=torch.long, device=device),
                  torch.arange(start, start + slots, dtype=torch.long, device=device),
                  torch.zeros(T, H, dtype=model.embed.dtype, device=device) if kind != "target" else None,
                  ())
    if sampling is not None:
        rows = model.lm_head.draft_ids
        n = model.cfg.vocab_size if rows is None else rows.numel()
        c.noise = torch.full((chain, n), 0.5, device=device)
    if pick:
        c.pick = torch.zeros(1, dtype=torch.long, device=device)
    return c


def _key(kind: str, T: int, bucket: int | tuple[int, ...], keep_steps: bool, chain: int, pick: bool,
         sampling: SamplingParams | None) -> tuple:
    # a target step's key is replay()'s own: the same graph, its buffers filled on the device instead
    how = None if sampling is None else (sampling.temperature, sampling.top_k, sampling.top_p)
    return (kind, T, bucket, keep_steps) if kind == "target" else ("at", kind, T, bucket, chain, pick, how)


class StepGraphs:
    """Captured steps for one model + one conversation state."""

    def __init__(self, model: LingModel, state: ConversationState) -> None:
        self.model, self.state = model, state
        self.device = model.embed.device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Captured] = {}

    def clear(self) -> None:
        """Forget every graph (the kernels they call changed: a switch was flipped)."""
        self.graphs.clear()

    def _run(self, kind: str, c: _Captured, bucket: int | tuple[int, ...], keep_steps: bool,
             chain: int = 0, sampling: SamplingParams | None = None) -> tuple[Any, ...]:
        return run_step(self.model, self.state, kind, c, bucket, keep_steps, chain, sampling)

    def _capture(self, kind: str, T: int, bucket: int | tuple[int, ...], keep_steps: bool, start: int,
                 chain: int = 0, sampling: SamplingParams | None = None, pick: bool = False) -> _Captured:
        c = _step_inputs(self.model, kind, T, start, chain, sampling, torch.cuda.CUDAGraph(), pick)
        saved = [(s.conv.clone(), s.recurrent.clone()) for s in self.state.kda.values()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation and kernel compilation happen outside capture
                self._run(kind, c, bucket, keep_steps, chain, sampling)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(c.graph, pool=self.pool):
            c.out = self._run(kind, c, bucket, keep_steps, chain, sampling)
        for s, (conv, rec) in zip(self.state.kda.values(), saved):
            s.conv.copy_(conv)
            s.recurrent.copy_(rec)
        return c

    def replay(self, kind: str, ids: list[int], start: int, keep_steps: bool = False,
               hidden_in: torch.Tensor | None = None, tail: torch.Tensor | None = None) -> tuple[Any, ...]:
        """Run a step through its graph (capturing it the first time). Returns the graph's outputs:
        target → (hidden, logits, kept KDA steps); draft → (mtp hidden, last slot's logits). They are the graph's
        own buffers: copy what must outlive the next replay. `tail`: more ids after `ids`, already on the
        device (a draft chain's output), copied there without a trip through the host."""
        T = len(ids) + (0 if tail is None else tail.shape[0])
        bucket = bucket_for(start + T, self.state.max_context)
        key = (kind, T, bucket, keep_steps)
        c = self.graphs.get(key)
        if c is None:
            c = self.graphs[key] = self._capture(kind, T, bucket, keep_steps, start)
        c.ids[:len(ids)].copy_(torch.tensor(ids), non_blocking=True)
        if tail is not None:
            c.ids[len(ids):].copy_(tail)
        c.pos.copy_(torch.arange(start, start + T), non_blocking=True)
        if hidden_in is not None:
            c.hidden_in.copy_(hidden_in)
        c.graph.replay()
        return c.out

    def replay_draft_chain(self, ids: list[int], start: int, hidden_in: torch.Tensor, k: int,
                           sampling: SamplingParams | None = None,
                           generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
        """A draft in one replay: the catch-up over `ids` (positions start..) from the target's hidden
        states `hidden_in`, then k-1 single-token draft steps at the positions after, each embedding
        the token the step before chose: its argmax, or with `sampling` a draw from its distribution
        (uniforms from `generator`). Returns (the k drafted vocabulary ids int64 [k],) and, sampled,
        their distributions [k, draft rows] — the graph's own buffers. Greedy: same kernels, same
        order, so the same tokens as k draft replays."""
        T = len(ids)
        # draft j attends up to position start + T + j - 1, as its own replay would (catch-up: j = 0)
        buckets = tuple(bucket_for(start + T + j, self.state.max_context) for j in range(k))
        how = None if sampling is None else (sampling.temperature, sampling.top_k, sampling.top_p)
        key = ("draft_chain", T, buckets, k, how)
        c = self.graphs.get(key)
        if c is None:
            c = self.graphs[key] = self._capture("draft_chain", T, buckets, False, start, chain=k, sampling=sampling)
        c.ids.copy_(torch.tensor(ids), non_blocking=True)
        c.pos.copy_(torch.arange(start, start + T + k - 1), non_blocking=True)
        c.hidden_in.copy_(hidden_in)
        if c.noise is not None:
            c.noise.uniform_(generator=generator)
        c.graph.replay()
        return c.out

    def buffers(self, kind: str, T: int, bucket: int | tuple[int, ...], keep_steps: bool, start: int,
                chain: int = 0, pick: bool = False, sampling: SamplingParams | None = None) -> _Captured:
        """A step's graph (captured the first time, at positions from `start`) for a caller that fills
        its input buffers on the device (ids, pos, hidden_in, pick, a sampled chain's noise), with no
        host copy, then launch()es it: the pipelined MTP loop queues a cycle before the host knows what
        the last one accepted."""
        key = _key(kind, T, bucket, keep_steps, chain, pick, sampling)
        c = self.graphs.get(key)
        if c is None:
            c = self.graphs[key] = self._capture(kind, T, bucket, keep_steps, start, chain, sampling, pick)
        return c

    def launch(self, c: _Captured) -> tuple[Any, ...]:
        """Replay a step whose buffers the caller filled; its outputs (the graph's own buffers)."""
        c.graph.replay()
        return c.out


class EagerSteps:
    """StepGraphs' buffers() and launch() without graphs: each launch runs the step eagerly over the
    same buffers (run_step). Off a GPU the pipelined MTP loop runs on it, and it is the twin the GPU's
    graphs are held to."""

    def __init__(self, model: LingModel, state: ConversationState) -> None:
        self.model, self.state = model, state
        self._buffers: dict[tuple, _Captured] = {}

    def buffers(self, kind: str, T: int, bucket: int | tuple[int, ...], keep_steps: bool, start: int,
                chain: int = 0, pick: bool = False, sampling: SamplingParams | None = None) -> _Captured:
        key = _key(kind, T, bucket, keep_steps, chain, pick, sampling)
        c = self._buffers.get(key)
        if c is None:
            c = self._buffers[key] = _step_inputs(self.model, kind, T, start, chain, sampling, pick=pick)
            c.how = (kind, bucket, keep_steps, chain, sampling)
        return c

    def launch(self, c: _Captured) -> tuple[Any, ...]:
        kind, bucket, keep_steps, chain, sampling = c.how
        return run_step(self.model, self.state, kind, c, bucket, keep_steps, chain, sampling)

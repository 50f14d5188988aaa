"""The MTP loop, pipelined: each speculative cycle is queued on the GPU before the host has read what
the cycle before it accepted.

In the synced loop the GPU idles at every cycle while the host wakes from its wait, reads the verify's
picks, accepts, commits, and launches the next draft chain and the next verify (the verify graph's
launch alone outlasts the chain it queues behind): 0.6 ms of a 5.5 ms cycle on an H100
(docs/benchmarks.md, session 29). Here the acceptance runs on the GPU too (greedy: the drafts' leading
run that matches the target's picks; sampled: sampling.speculative_accept_on_device, the drafts drawn
inside the chain graph, in the synced loop's order of draws, so a seed gives its tokens), so everything
a cycle needs from the one before — how many drafts it accepted, the token after them, the verify's
hidden states — stays on the device:

    cycle i:  draft chain → verify → accept (a_i, next_i; a copy to the host, an event)
    cycle i+1, queued before the host reads cycle i:
              commit KDA at a_i → the MTP catch-up over the k+1 slots the verify may have accepted
              (drafting from slot a_i) → k-1 more drafts → verify at positions n_i + a_i + 1 … → accept

The catch-up always runs over k+1 slots; the slots past a_i hold the rejected drafts' states and are
rewritten before anything attends to them (attention is causal and the next catch-up starts at the
first of them). Positions past a_i are filled on the device, so attention reads the context bucket of
the furthest position a cycle may reach. When the host finds a stop token in cycle i, cycle i+1 is
dropped: its verify's conv states are put back, and what stays, the commit of cycle i, is the one the
synced loop makes too.

The steps are StepGraphs' CUDA graphs, their input buffers filled on the device; off a GPU the same
buffers run eagerly (graphs.EagerSteps), which is how the tests hold both loops to the same tokens.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch

from sparkchat.engine.events import SamplingParams
from sparkchat.engine.graphs import EagerSteps, StepGraphs, bucket_for
from sparkchat.engine.sampling import probabilities, speculative_accept_on_device
from sparkchat.engine.state import ConversationState

SLOTS = 3  # buffers in turn: a cycle's results are read while the next is queued, its events one later


@functools.cache
def _slots(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)  # made once: a kernel less a cycle


def accept_greedy_ops(drafts: torch.Tensor, target: torch.Tensor, accepted: torch.Tensor, nxt: torch.Tensor,
                      result: torch.Tensor) -> None:
    """The greedy acceptance on the device: accepted [1] = the drafts' [k] leading run equal to the
    target's picks [k+1], nxt [1] = the target's pick after it, result [k+2] = drafts, accepted, nxt.
    The twin of kernels/pipeline_handoff.accept_greedy."""
    k = drafts.shape[0]
    matched = (drafts == target[:k]).long().cumprod(0)
    torch.sum(matched, 0, keepdim=True, out=accepted)
    torch.gather(target, 0, accepted, out=nxt)
    torch.cat([drafts, accepted, nxt], out=result)


def next_inputs_ops(drafts: torch.Tensor, accepted: torch.Tensor, nxt: torch.Tensor, hidden: torch.Tensor, n: int,
                    ids: torch.Tensor, pos: torch.Tensor, pick: torch.Tensor, hidden_in: torch.Tensor,
                    verify_ids: torch.Tensor, verify_pos: torch.Tensor, fill: bool) -> None:
    """A pipelined cycle's inputs from the one before's results (drafts [k], accepted, nxt, the verify's
    hidden states [k+1, H] at positions n …): catch-up slot j (position n + j) takes the hidden state
    there and the token after it — draft j+1 where j < accepted, nxt at j = accepted, and past it
    whatever (`fill`: the accepted slot's token and hidden state, so that those slots' MoE mostly routes
    to its experts; attention is causal and the rest works row by row, so nothing else changes). The
    chain drafts from slot `pick` = accepted, its drafts 2..k at the positions after; the verify takes
    nxt first, at n + accepted + 1 …. The twin of kernels/pipeline_handoff.next_inputs."""
    k = drafts.shape[0]
    slots = _slots(k + 1, drafts.device)
    ids[:k].copy_(drafts)
    ids[k:].copy_(nxt)
    ids.scatter_(0, accepted, nxt)
    torch.add(slots, n, out=pos[:k + 1])
    torch.add(slots[1:k], accepted, out=pos[k + 1:]).add_(n + 1)
    if fill:
        past = slots > accepted
        ids.copy_(torch.where(past, nxt, ids))
        torch.index_select(hidden, 0, torch.minimum(slots, accepted), out=hidden_in)
    else:
        hidden_in.copy_(hidden)
    pick.copy_(accepted)
    verify_ids.copy_(nxt)
    torch.add(slots, accepted, out=verify_pos).add_(n + 1)


@dataclass
class Cycle:
    """One queued cycle: where it started and where its results will be."""

    slot: int
    base: int  # its MTP catch-up's first slot: where the MTP cache goes back to if it is dropped
    kept: dict  # the verify's kept KDA steps (graph buffers: committed by the next cycle, on the device)
    t_host: float = 0.0  # off a GPU: the seconds its draft chain and verify took (they ran as queued)
    t_draft: float = 0.0


class SpeculativePipeline:
    """Queues speculative cycles of k drafts over one conversation state (see the module doc): greedy, or
    sampled with `params` (temperature > 0), drawing from `gen`."""

    def __init__(self, model, state: ConversationState, graphs: StepGraphs | None, k: int,
                 params: SamplingParams | None = None, gen: torch.Generator | None = None) -> None:
        self.model, self.state, self.k = model, state, k
        self.sampling = params if params is not None and params.temperature > 0 else None
        self.gen = gen
        # SPARKCHAT_PIPELINE_FILL=1: the catch-up's slots past the accepted one copy it (next_inputs_ops)
        self.fill = os.environ.get("SPARKCHAT_PIPELINE_FILL", "0") == "1"
        self._q: torch.Tensor | None = None  # sampled: each slot's draft distributions [k, vocab]
        self.steps = graphs if graphs is not None else EagerSteps(model, state)
        dev = model.embed.device
        self.cuda = dev.type == "cuda"
        # the steps between cycles in two launches (kernels/pipeline_handoff.py) instead of ~15 torch ops:
        # H100, greedy 5.179 -> 5.137 ms a cycle, sampled 5.391 -> 5.368 (docs/benchmarks.md session 30);
        # SPARKCHAT_PIPELINE_KERNELS=0 keeps the ops
        self._kernels = None
        if self.cuda and os.environ.get("SPARKCHAT_PIPELINE_KERNELS", "1") != "0":
            from sparkchat.engine.kernels import pipeline_handoff  # Triton: only where a GPU runs it

            self._kernels = pipeline_handoff
        H = model.cfg.hidden_size
        self._drafts = torch.zeros(SLOTS, k, dtype=torch.long, device=dev)
        self._accepted = torch.zeros(SLOTS, 1, dtype=torch.long, device=dev)
        self._next = torch.zeros(SLOTS, 1, dtype=torch.long, device=dev)
        self._hidden = torch.zeros(SLOTS, k + 1, H, dtype=model.embed.dtype, device=dev)
        self._result_dev = torch.zeros(SLOTS, k + 2, dtype=torch.long, device=dev)
        self._result = torch.zeros(SLOTS, k + 2, dtype=torch.long, pin_memory=self.cuda)
        # per slot: draft chain start, chain end, verify + acceptance end, results on the host
        self._events = [[torch.cuda.Event(enable_timing=i < 3) for i in range(4)] for _ in range(SLOTS)] \
            if self.cuda else None
        self._count = 0

    def fits(self) -> bool:
        """Whether the cycle queued behind the one verifying from the state's length stays inside the
        context: it reaches that length + 2k + 1 at most."""
        return self.state.length + 2 * self.k + 2 <= self.state.max_context

    # -- queueing ---------------------------------------------------------------------------
    def first(self, pending: int) -> Cycle:
        """A cycle from the host's state: the catch-up over the slots the MTP cache lacks (their count
        known), drafting from the last, then the verify of pending + the drafts."""
        st, k = self.state, self.k
        n, m = st.length, st.mtp_length
        st.mtp_length = n
        T = n - m
        c = self.steps.buffers("draft_chain", T, self._chain_buckets(m + T - 1), False, m, chain=k,
                               sampling=self.sampling)
        c.ids.copy_(torch.tensor(st.token_ids[m + 1:n] + [pending]), non_blocking=True)
        c.pos.copy_(torch.arange(m, m + T + k - 1), non_blocking=True)
        c.hidden_in.copy_(st.hidden[m:n])
        cycle = self._begin(m)
        drafts = self._draft(cycle, c)
        v = self.steps.buffers("target", k + 1, bucket_for(n + k + 1, st.max_context), True, n)
        v.ids[:1].fill_(pending)
        v.ids[1:].copy_(drafts)
        v.pos.copy_(torch.arange(n, n + k + 1), non_blocking=True)
        return self._verify(cycle, v)

    def next(self, prev: Cycle) -> Cycle:
        """The cycle after `prev`, queued before the host reads `prev` (fits() must hold). `prev` verifies
        from the state's length n: the host has committed every cycle before it."""
        st, k, n = self.state, self.k, self.state.length
        assert st.mtp_length == n and self.fits()
        accepted, nxt = self._accepted[prev.slot], self._next[prev.slot]
        st.commit_kda(prev.kept, accepted)  # the kernel reads `accepted` on the device
        # catch-up slot j (position n + j) takes the verify's hidden there and the token after it:
        # draft j+1 where j < accepted, the target's next token at j = accepted (and past it: ignored)
        c = self.steps.buffers("draft_chain", k + 1, self._chain_buckets(n + k), False, n, chain=k, pick=True,
                               sampling=self.sampling)
        # the verify's positions start right after the accepted ones; its capture (once per bucket)
        # runs past every position this cycle may commit
        v = self.steps.buffers("target", k + 1, bucket_for(n + 2 * k + 2, st.max_context), True, n + k + 1)
        fill = self._kernels.next_inputs if self._kernels else next_inputs_ops
        fill(self._drafts[prev.slot], accepted, nxt, self._hidden[prev.slot], n, c.ids, c.pos, c.pick, c.hidden_in,
             v.ids[:1], v.pos, self.fill)
        cycle = self._begin(n)
        v.ids[1:].copy_(self._draft(cycle, c))
        return self._verify(cycle, v)

    def _chain_buckets(self, last_slot: int) -> tuple[int, ...]:
        """A chain's attention buckets when its catch-up's last slot is at `last_slot`: draft j attends
        up to position last_slot + j at most."""
        return tuple(bucket_for(last_slot + 1 + j, self.state.max_context) for j in range(self.k))

    def _begin(self, base: int) -> Cycle:
        slot = self._count % SLOTS
        self._count += 1
        return Cycle(slot, base, {})

    def _draft(self, cycle: Cycle, c) -> torch.Tensor:
        t0 = time.perf_counter()
        if self._events:
            self._events[cycle.slot][0].record()
        if c.noise is not None:
            c.noise.uniform_(generator=self.gen)  # the chain's draws, before the acceptance's (synced order)
        out = self.steps.launch(c)
        # copied out of the chain's buffers at once: the verify's graph may keep scratch there (one pool)
        drafts = self._drafts[cycle.slot].copy_(out[0])
        if self.sampling is not None:
            self._keep_draft_probs(cycle.slot, out[1])
        if self._events:
            self._events[cycle.slot][1].record()
        cycle.t_draft = time.perf_counter() - t0
        return drafts

    def _verify(self, cycle: Cycle, v) -> Cycle:
        """Launch the verify whose buffers are filled, then the greedy acceptance on the device: the
        drafts' leading run that matches the target's picks, and the target's pick after it."""
        t0 = time.perf_counter()
        s = cycle.slot
        hidden, logits, cycle.kept = self.steps.launch(v)
        if self.sampling is not None:
            p = probabilities(logits, self.sampling)
            decided = speculative_accept_on_device(p, self._q[s], self._drafts[s], self.gen)
            self._accepted[s].copy_(decided[:1])
            self._next[s].copy_(decided[1:])
            torch.cat([self._drafts[s], self._accepted[s], self._next[s]], out=self._result_dev[s])
        else:
            accept = self._kernels.accept_greedy if self._kernels else accept_greedy_ops
            accept(self._drafts[s], logits.argmax(-1), self._accepted[s], self._next[s], self._result_dev[s])
        self._hidden[s].copy_(hidden)
        if self._events:
            self._events[s][2].record()
        self._result[s].copy_(self._result_dev[s], non_blocking=True)
        if self._events:
            self._events[s][3].record()
        cycle.t_host = cycle.t_draft + time.perf_counter() - t0
        return cycle

    def _keep_draft_probs(self, slot: int, q: torch.Tensor) -> None:
        """A sampled chain's draft distributions [k, draft rows] over the whole vocabulary, in this slot:
        0 outside a truncated draft head's rows (the rule stays exact: such tokens are never drafted)."""
        rows = self.model.lm_head.draft_ids
        if self._q is None:
            self._q = torch.zeros(SLOTS, self.k, self.model.cfg.vocab_size, dtype=q.dtype, device=q.device)
        if rows is None:
            self._q[slot].copy_(q)
        else:
            self._q[slot].index_copy_(1, rows, q)

    # -- reading a cycle back ---------------------------------------------------------------
    def collect(self, cycle: Cycle, next_queued: bool) -> tuple[list[int], int, int]:
        """Wait for `cycle` alone (not for a cycle queued behind it) and settle the host's side: its
        (drafts, accepted count, the target's next token). The caller commits the tokens. Unless the
        next cycle is queued (it commits on the device), the KDA commit is queued here."""
        s, st = cycle.slot, self.state
        if self._events:
            self._events[s][3].synchronize()
        *drafts, accepted, nxt = self._result[s].tolist()
        start = st.length  # where the cycle verified from: every cycle before it is committed
        rows = min(self.k + 1, st.max_context - start)  # the hidden states a later catch-up reads
        st.hidden[start:start + rows] = self._hidden[s][:rows]
        if not next_queued:
            st.commit_kda(cycle.kept, accepted)
        # the queued cycle's catch-up reached the last accepted slot; else this cycle's own catch-up
        st.mtp_length = start + accepted + 1 if next_queued else start
        return drafts, accepted, nxt

    def drop(self, cycle: Cycle) -> None:
        """Forget a queued cycle the answer will not use (it has ended): its verify's conv states go back
        to where it found them (it left the recurrent ones alone), and the MTP cache's catch-up to where
        the collected cycle left it. Its commit of the cycle before stays: the synced loop makes it too."""
        self.state.commit_kda(cycle.kept, -1)
        self.state.mtp_length = cycle.base

    def timings(self, cycle: Cycle, before: Cycle | None) -> tuple[float, float, float]:
        """After collect: (draft chain, verify + acceptance, the GPU's wait between the cycle before's end
        and this chain's start) in seconds, from the GPU's events (the host's clock off a GPU)."""
        if not self._events:
            return cycle.t_draft, cycle.t_host - cycle.t_draft, 0.0
        e = self._events[cycle.slot]
        gap = self._events[before.slot][2].elapsed_time(e[0]) / 1000 if before is not None else 0.0
        return e[0].elapsed_time(e[1]) / 1000, e[1].elapsed_time(e[2]) / 1000, gap

"""Token generation over one conversation state: prefill, then plain or speculative (MTP) steps.

Speculative decoding follows NVIDIA's recipe: the model's own NextN layer drafts k tokens, one target
pass verifies k+1 positions, then accept and commit the accepted positions' KDA states. Explicit steps:
draft → verify → accept → commit, with an acceptance histogram in the stats.

Which hidden state feeds the MTP layer, and how drafts chain (sources: SGLang
`models/bailing_moe_nextn.py` and its EAGLE worker; vLLM `bailing_moe_v3_mtp.py`): the main model's
hidden AFTER `model.norm` at position p, with the embedding of token p+1, at position p; each further
draft step feeds the MTP layer's own output (after its `final_layernorm`) and the token it drafted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from threading import Event

import torch

from sparkchat.engine.decode_pipeline import DecodePipeline
from sparkchat.engine.events import GenerationStats, SamplingParams
from sparkchat.engine.model import LingModel
from sparkchat.engine.nn.mla import Span
from sparkchat.engine.pipeline import SpeculativePipeline
from sparkchat.engine.sampling import (make_generator, probabilities, sample, speculative_accept,
                                       speculative_accept_on_device)
from sparkchat.engine.state import ConversationState


@dataclass
class StepOutput:
    tokens: list[int]
    finish_reason: str | None
    stats: GenerationStats


@dataclass
class _SpecCounters:
    steps: int = 0
    accepted: int = 0  # tokens emitted by verify steps (accepted drafts + the target's own)
    last: int = 0
    per_position: list[int] = field(default_factory=list)  # drafts accepted at each position

    def count(self, accepted: int) -> None:
        """One verify that accepted `accepted` drafts (and emitted one token more)."""
        self.steps += 1
        self.last = accepted + 1
        self.accepted += accepted + 1
        for i in range(accepted):
            self.per_position[i] += 1


def _pipelined(graphs, switch: str = "SPARKCHAT_PIPELINE") -> bool:
    """Whether a loop runs pipelined — the MTP loop (SPARKCHAT_PIPELINE) or plain decoding
    (SPARKCHAT_DECODE_PIPELINE): with CUDA graphs, unless the switch is 0; =1 runs it without graphs too
    (eagerly: the tests' twin of the graphed loop)."""
    forced = os.environ.get(switch)
    return forced != "0" if graphs is not None else forced == "1"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Decoder:
    """Runs the model over a ConversationState. Keeps nothing between answers but the state itself."""

    GRAPH_MAX_TOKENS = 5  # decode (1) and verify (k+1 ≤ 5) replay CUDA graphs; prefill runs eagerly

    def __init__(self, model: LingModel, state: ConversationState, graphs=None) -> None:
        self.model, self.state = model, state
        self.device = model.embed.device
        self.graphs = graphs  # a StepGraphs, or None for eager execution
        self._marks: list[torch.cuda.Event] | None = None  # draft_and_verify's events and draft buffer
        self._drafts: torch.Tensor | None = None
        # each queued verify's end (two events, taken in turn) and the one the current cycle started after
        self._ends: list[torch.cuda.Event] = []
        self._last_end: torch.cuda.Event | None = None
        self._gap_from: torch.cuda.Event | None = None

    # -- the target model ---------------------------------------------------------------------
    def forward(self, ids: list[int], keep_steps: bool = False, tail: torch.Tensor | None = None,
                last_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Run `ids` (then `tail`, ids still on the device) at the next positions; returns (hidden [T, H],
        logits [T, V] fp32, kept KDA steps). The state's token list is NOT extended here: callers commit
        what they keep. `last_logits`: a prompt needs only its last position's logits — the head over
        every prompt token would be 2.6 GB of fp32 logits per 4K tokens (and the head's compute)."""
        start = self.state.length
        n = len(ids) + (0 if tail is None else tail.shape[0])
        self._last_end = None  # only a queued verify (_verify_queued) leaves one
        if self.graphs is not None and n <= self.GRAPH_MAX_TOKENS:
            hidden, logits, kept = self.graphs.replay("target", ids, start, keep_steps, tail=tail)
            if self.state.hidden.numel():
                self.state.hidden[start:start + n] = hidden
            return hidden, logits, kept
        if tail is not None:
            ids = ids + tail.tolist()
        x = torch.tensor(ids, device=self.device)
        hidden, kept = self.model(x, start, self.state, keep_steps=keep_steps, span=self._span(start, len(ids)))
        if self.state.hidden.numel():
            self.state.hidden[start:start + len(ids)] = hidden
        return hidden, self.model.lm_head(hidden[-1:] if last_logits else hidden), kept

    def _span(self, start: int, count: int) -> Span | None:
        """On CUDA, short steps attend over a fixed bucket of cache rows, as the graphs do: compiled code
        then sees a handful of shapes instead of one per position."""
        if self.device.type != "cuda" or count > self.GRAPH_MAX_TOKENS:
            return None
        from sparkchat.engine.graphs import bucket_for

        pos = torch.arange(start, start + count, device=self.device)
        return Span(pos, bucket_for(start + count, self.state.max_context))

    def commit(self, ids: list[int]) -> None:
        self.state.token_ids.extend(ids)

    # -- the MTP draft ------------------------------------------------------------------------
    def mtp_catch_up(self, pending: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring the MTP cache up to the last processed position using true hidden states; returns the
        MTP hidden of that last slot (its input token is `pending`, the token not yet processed) and
        that slot's draft logits: the first draft. With graphs, the catch-up (1..k+1 slots) replays a
        draft graph too: run eagerly it cost a hundred launches, most of a speculative step's drafting."""
        start, next_ids, hidden = self._catch_up_slots(pending)
        if self.graphs is not None and len(next_ids) <= self.GRAPH_MAX_TOKENS:
            m, logits = self.graphs.replay("draft", next_ids, start, hidden_in=hidden)
            return m[-1:], logits
        ids = torch.tensor(next_ids, device=self.device)
        m = self.model.draft(ids, hidden, start, self.state.mtp, span=self._span(start, len(next_ids)))[-1:]
        return m, self.model.draft_logits(m)  # the very same head module as the target

    def _catch_up_slots(self, pending: int) -> tuple[int, list[int], torch.Tensor]:
        """The slots the MTP cache still lacks, marked done: (first position, their input tokens, the
        target's hidden states there)."""
        st = self.state
        n, start = st.length, st.mtp_length
        st.mtp_length = n
        return start, st.token_ids[start + 1:n] + [pending], st.hidden[start:n]

    def chain_ok(self, k: int) -> bool:
        """Whether a draft runs as one graph (SPARKCHAT_DRAFT_CHAIN=0: a replay per step)."""
        st = self.state
        return (self.graphs is not None and k > 0 and st.length - st.mtp_length <= self.GRAPH_MAX_TOKENS
                and os.environ.get("SPARKCHAT_DRAFT_CHAIN", "1") != "0")

    def draft_on_device(self, pending: int, k: int, params: SamplingParams | None = None,
                        gen: torch.Generator | None = None) -> tuple[torch.Tensor, ...] | None:
        """mtp_catch_up and k draft steps as one graph replay, queued: (the k tokens,) — greedy, or with
        `params` (temperature > 0) drawn, with their draft distributions [k, V] over the whole vocabulary
        after them (a copy). The tokens are the graph's own buffer (graphs share a memory pool: only
        good until the next replay of any graph). None where there is no chain (chain_ok)."""
        if not self.chain_ok(k):
            return None
        start, next_ids, hidden = self._catch_up_slots(pending)
        sampling = params if params is not None and params.temperature > 0 else None
        out = self.graphs.replay_draft_chain(next_ids, start, hidden, k, sampling, gen)
        rows = self.model.lm_head.draft_ids
        if sampling is None:
            return out
        if rows is None:
            return out[0], out[1].clone()
        q = torch.zeros(k, self.model.cfg.vocab_size, dtype=out[1].dtype, device=out[1].device)
        return out[0], q.index_copy_(1, rows, out[1])  # 0 outside the draft head's rows

    def _queued_chain(self, pending: int, k: int, params: SamplingParams | None,
                      gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """The draft chain with the verify to be queued behind it, no host sync: (the drafts in this
        decoder's own buffer, their distributions copied out when sampled, the host time)."""
        if self._marks is None:
            cuda = self.device.type == "cuda"
            self._marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
            self._ends = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
            self._drafts = torch.empty(self.GRAPH_MAX_TOKENS, dtype=torch.long, device=self.device)
        t0 = time.perf_counter()
        self._chain_starts()
        chain = self.draft_on_device(pending, k, params, gen)
        # copied out of the chain's outputs first: a graph captured after the verify's may hold them
        # where the verify keeps its scratch (the pool is shared)
        drafts = self._drafts[:k].copy_(chain[0])
        q = chain[1] if len(chain) > 1 else None
        for mark in self._marks[1:]:
            mark.record()
        return drafts, q, time.perf_counter() - t0  # off a GPU the chain has run by now

    def chain_time(self, host: float) -> float:
        """The chain's GPU time, queueing included (no sync between draft and verify), after a sync."""
        return self._marks[0].elapsed_time(self._marks[1]) / 1000 if self._marks else host

    def _chain_starts(self) -> None:
        """Mark a queued draft chain's start (its gap counts from the last queued verify's end, if any)."""
        self._gap_from = self._last_end
        for mark in self._marks[:1]:
            mark.record()

    def _verify_queued(self) -> None:
        """Mark the end of the verify just queued: the next queued cycle measures its gap from here."""
        if self._ends:
            self._last_end = self._ends[0]
            self._ends.reverse()  # the next verify records the other event: this one stays for the gap
            self._last_end.record()

    def host_gap(self) -> float:
        """After a queued cycle's sync: seconds on the GPU between the previous queued verify's end and
        this cycle's draft chain's start — the acceptance, the KDA commit, the chain's inputs and its
        launch, all queued by the host after it had waited for that verify (0 off a GPU, or when the
        cycle before was not a queued one)."""
        if self._gap_from is None or not self._marks:
            return 0.0
        return self._gap_from.elapsed_time(self._marks[0]) / 1000

    def draft_and_verify(self, pending: int, k: int) -> tuple[list[int], list[int], dict, float]:
        """A greedy speculative step with one host sync (chain_ok(k) must hold): the draft chain, then the
        verify reading the drafts on the device, queued right behind it. Returns (the k drafts, the
        target's k+1 greedy picks, the verify's kept KDA steps, the chain's share of the time in s)."""
        drafts, _, host = self._queued_chain(pending, k, None, None)
        _, logits, kept = self.forward([pending], keep_steps=True, tail=drafts)
        self._verify_queued()
        both = torch.cat([drafts, logits.argmax(-1)]).tolist()
        return both[:k], both[k:], kept, self.chain_time(host)

    def sample_and_verify(self, pending: int, k: int, params: SamplingParams, gen: torch.Generator | None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, float]:
        """draft_and_verify for sampling (temperature > 0, chain_ok(k)): the drafts drawn in the chain
        graph, the verify queued behind it, nothing waited for. Returns (the k drafts on the device,
        their draft distributions [k, V], the verify's logits [k+1, V], its kept KDA steps, the host
        time chain_time() turns into the chain's share once the caller has synced)."""
        drafts, q, host = self._queued_chain(pending, k, params, gen)
        _, logits, kept = self.forward([pending], keep_steps=True, tail=drafts)
        self._verify_queued()
        return drafts, q, logits, kept, host

    def draft(self, pending: int, k: int, params: SamplingParams,
              gen: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        """k draft tokens after `pending`, and their draft distributions [k, V] when sampling.

        With a truncated draft head (`lm_head.draft_ids`, N rows) the draft's logits cover those N
        tokens only: a drafted index maps back to its vocabulary id, and the draft distribution is
        0 for every other token. The acceptance rule stays exact for any draft distribution: a token
        the draft cannot propose is simply never accepted as a draft, and the residual (p − q)+ a
        rejection resamples from keeps the target's whole mass on it."""
        if self.chain_ok(k):  # one replay and one host sync for all k tokens
            chain = self.draft_on_device(pending, k, params, gen)
            return chain[0].tolist(), (chain[1] if len(chain) > 1 else None)
        m, logits = self.mtp_catch_up(pending)
        rows = self.model.lm_head.draft_ids  # None: the draft's logits cover the whole vocabulary
        tokens: list[int] = []
        qs = []
        pos = self.state.length  # the next slot's position
        for j in range(k):
            if j and self.graphs is not None:
                m, logits = self.graphs.replay("draft", [tokens[-1]], pos + j - 1, hidden_in=m)
            elif j:
                ids = torch.tensor([tokens[-1]], device=self.device)
                m = self.model.draft(ids, m, pos + j - 1, self.state.mtp, span=self._span(pos + j - 1, 1))
                logits = self.model.draft_logits(m)  # the very same head module as the target
            if params.temperature > 0:
                q = probabilities(logits, params)
                qs.append(q[0])
                tok = torch.multinomial(q[0], 1, generator=gen)[0]
            else:
                tok = logits[0].argmax()
            tokens.append(int(tok if rows is None else rows[tok]))  # one host sync either way
        if not qs:
            return tokens, None
        q = torch.stack(qs)
        if rows is not None:  # the draft distribution over the whole vocabulary: 0 outside the rows
            q = torch.zeros(k, self.model.cfg.vocab_size, dtype=q.dtype, device=q.device).index_copy_(1, rows, q)
        return tokens, q


def _synced_cycle(dec: Decoder, pending: int, k: int, params: SamplingParams, gen: torch.Generator | None,
                  queued_verify: bool, st: GenerationStats) -> tuple[list[int], int, int]:
    """One speculative cycle the host waits on before the next: k drafts after `pending`, the verify,
    the acceptance, the KDA commit queued. Returns (the drafts, how many were accepted, the next token);
    adds the draft's, the verify's and the GPU gap's time to `st`."""
    t_d = time.perf_counter()
    queued = queued_verify and dec.chain_ok(k)
    greedy_chain = queued and params.temperature <= 0
    if greedy_chain:
        drafts, target, kept, drafting = dec.draft_and_verify(pending, k)
        st.draft_s += drafting
        st.host_gap_s += dec.host_gap()
        t_v = t_d + drafting  # verify_s (below) takes the rest of the cycle
    elif queued:
        on_device, q, logits, kept, host = dec.sample_and_verify(pending, k, params, gen)
        p = probabilities(logits, params)
        decided = speculative_accept_on_device(p, q, on_device, gen)
        *drafts, accepted, nxt = torch.cat([on_device, decided]).tolist()  # the cycle's one wait
        drafting = dec.chain_time(host)
        st.draft_s += drafting
        st.host_gap_s += dec.host_gap()
        t_v = t_d + drafting
    else:
        drafts, q = dec.draft(pending, k, params, gen)
        _sync(dec.device)
        t_v = time.perf_counter()
        st.draft_s += t_v - t_d
        hidden, logits, kept = dec.forward([pending] + drafts, keep_steps=True)
    if params.temperature > 0 and not queued:
        p = probabilities(logits, params)
        accepted, nxt = speculative_accept(p, q, torch.tensor(drafts, device=dec.device), gen)
    elif params.temperature <= 0:
        if not greedy_chain:
            target = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == target[accepted]:
            accepted += 1
        nxt = target[accepted]
    # no sync after it: the GPU advances the KDA states while the host gets the next draft ready
    # (stream order keeps them in turn)
    dec.state.commit_kda(kept, accepted)
    st.verify_s += time.perf_counter() - t_v
    return drafts, accepted, nxt


def generate_tokens(model: LingModel, state: ConversationState, new_ids: list[int], params: SamplingParams,
                    stop_ids: set[int], *, mtp: bool = False, draft_steps: int = 3,
                    cancel: Event | None = None, stats: GenerationStats | None = None,
                    graphs=None) -> Iterator[StepOutput]:
    """Prefill `new_ids` on top of `state`, then decode. Yields the tokens of each step (1 for a plain
    step, 1..k+1 for a speculative one) until a stop token, max_tokens, the context end or `cancel`."""
    st = stats or GenerationStats()
    dec = Decoder(model, state, graphs)
    device = dec.device
    gen = make_generator(params, device)
    use_mtp = mtp and model.mtp is not None and draft_steps > 0
    spec = _SpecCounters(per_position=[0] * draft_steps)
    t0 = time.perf_counter()

    _, logits, _ = dec.forward(new_ids, last_logits=True)
    dec.commit(new_ids)
    pending = int(sample(logits[-1:], params, gen)[0])
    _sync(device)
    st.prefilled_tokens = len(new_ids)
    st.prefill_s = st.ttft_s = time.perf_counter() - t0
    st.prefill_tok_s = len(new_ids) / st.prefill_s if st.prefill_s > 0 else 0.0
    t_decode = time.perf_counter()
    produced = 0

    def emit(tokens: list[int]) -> StepOutput:
        nonlocal produced
        finish = None
        out: list[int] = []
        for t in tokens:
            if t in stop_ids:
                finish = "stop"
                break
            out.append(t)
            if produced + len(out) >= params.max_tokens:
                finish = "length"
                break
        produced += len(out)
        st.generated_tokens = produced
        st.decode_s = time.perf_counter() - t_decode
        if produced > 1 and st.decode_s > 0:
            st.decode_tok_s = (produced - 1) / st.decode_s
            st.tpot_ms = 1000 * st.decode_s / (produced - 1)
        if spec.steps:
            st.accept_length_mean = spec.accepted / spec.steps
            st.accept_length_last = spec.last
            st.accept_rate_per_position = [a / spec.steps for a in spec.per_position]
        return StepOutput(out, finish, st)

    # drafts from one graph with the verify queued behind them (Decoder.draft_and_verify, greedy, and
    # sample_and_verify): one host wait a cycle, not two (H200, greedy: 1.4% shorter cycles,
    # docs/benchmarks.md session 14)
    queued_verify = os.environ.get("SPARKCHAT_QUEUED_VERIFY", "1") != "0"
    # each cycle queued before the host reads the one before it (engine/pipeline.py)
    pipe = SpeculativePipeline(model, state, graphs, draft_steps, params, gen) \
        if use_mtp and _pipelined(graphs) else None
    inflight = before = None  # the queued cycle the host has not read; the pipeline's cycle read last
    # without MTP, each step queued before the host reads the one before it (engine/decode_pipeline.py;
    # H100: 2.511 -> 2.473 ms a token, docs/benchmarks.md session 30)
    plain_steps = DecodePipeline(model, state, graphs, params, gen) \
        if not use_mtp and _pipelined(graphs, "SPARKCHAT_DECODE_PIPELINE") else None
    queued_step = None  # the slot of a queued step whose token the host has not read
    first = emit([pending])
    yield first
    if first.finish_reason:
        return
    try:
        while True:
            if cancel is not None and cancel.is_set():
                yield StepOutput([], "cancelled", st)
                return
            n = state.length
            k = draft_steps if use_mtp else 0
            if n + 1 >= state.max_context:
                yield StepOutput([], "length", st)
                return
            if use_mtp and n + k + 1 > state.max_context:
                k = 0
            if k == 0 and plain_steps is not None:
                slot = queued_step if queued_step is not None else plain_steps.queue(n, token=pending)
                queued_step = plain_steps.queue(n + 1, after=slot) if plain_steps.fits(n + 1) else None
                dec.commit([pending])
                pending = plain_steps.collect(slot)
                out = emit([pending])
            elif k == 0:
                _, logits, _ = dec.forward([pending])
                dec.commit([pending])
                pending = int(sample(logits, params, gen)[0])
                out = emit([pending])
            else:
                if pipe is not None and (inflight is not None or graphs is None or dec.chain_ok(k)):
                    cycle = inflight or pipe.first(pending)
                    inflight = pipe.next(cycle) if pipe.fits() else None  # queued before `cycle` is read
                    drafts, accepted, nxt = pipe.collect(cycle, next_queued=inflight is not None)
                    drafting, verifying, gap = pipe.timings(cycle, before)
                    before = cycle
                    st.draft_s += drafting
                    st.verify_s += verifying
                    st.host_gap_s += gap
                else:
                    before = None
                    drafts, accepted, nxt = _synced_cycle(dec, pending, k, params, gen, queued_verify, st)
                # commit positions pending, d_1..d_accepted; drop the rest
                dec.commit([pending] + drafts[:accepted])
                spec.count(accepted)
                pending = nxt
                out = emit(drafts[:accepted] + [nxt])
            yield out
            if out.finish_reason:
                return
    finally:
        if inflight is not None:  # the answer ended with a cycle still queued: nothing of it is kept
            pipe.drop(inflight)
        if queued_step is not None:  # a queued step ran the last token: the state keeps it (decode_pipeline.py)
            dec.commit([pending])

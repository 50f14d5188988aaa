"""Plain decoding (no MTP) pipelined: each one-token step is queued on the GPU before the host has read
the token of the step before it (on by default with CUDA graphs, SPARKCHAT_DECODE_PIPELINE=0 turns it off,
=1 runs it eagerly too; engine/pipeline.py does the same for the speculative loop).

A step's token is picked on the GPU (its argmax, or drawn there: sampling.sample) and fed to the next
step there, at the next position, which the host knows. The GPU then never waits for the host to wake,
read a token and launch the next graph; the host reads step j's token while step j+1 runs.

When an answer ends, the step queued after its last token has already run that token through the model.
Its KDA states moved in place, so it cannot be taken back cheaply; the state keeps it instead: its token
list gets that token too. The next turn's prompt then extends the state by one token more than after a
synced answer, or, where the template wrote the answer otherwise, the session restores the checkpoint it
took after the prompt (Engine._reuse_state_for), as it would anyway.
"""

from __future__ import annotations

import torch

from sparkchat.engine.events import SamplingParams
from sparkchat.engine.graphs import EagerSteps, StepGraphs, bucket_for
from sparkchat.engine.sampling import sample
from sparkchat.engine.state import ConversationState

SLOTS = 2  # a step's token is read while the next one is queued


class DecodePipeline:
    """Queues one-token steps over one conversation state (see the module doc)."""

    def __init__(self, model, state: ConversationState, graphs: StepGraphs | None, params: SamplingParams,
                 gen: torch.Generator | None) -> None:
        self.model, self.state, self.params, self.gen = model, state, params, gen
        self.steps = graphs if graphs is not None else EagerSteps(model, state)
        dev = model.embed.device
        cuda = dev.type == "cuda"
        self._tokens = torch.zeros(SLOTS, 1, dtype=torch.long, device=dev)
        self._read = torch.zeros(SLOTS, 1, dtype=torch.long, pin_memory=cuda)
        self._done = [torch.cuda.Event() for _ in range(SLOTS)] if cuda else None
        self._count = 0

    def fits(self, position: int) -> bool:
        """Whether a step at `position` stays inside the context (as the synced loop's guard)."""
        return position + 1 < self.state.max_context

    def queue(self, position: int, token: int | None = None, after: int | None = None) -> int:
        """Queue the step at `position` for `token` (from the host), or for the token the step queued as
        slot `after` picks; returns this step's slot."""
        st = self.state
        v = self.steps.buffers("target", 1, bucket_for(position + 1, st.max_context), False, position)
        if token is not None:
            v.ids.fill_(token)
        else:
            v.ids.copy_(self._tokens[after])
        v.pos.fill_(position)
        hidden, logits, _ = self.steps.launch(v)
        if st.hidden.numel():  # an MTP layer catches up from these later (MTP switched back on)
            st.hidden[position:position + 1] = hidden
        s = self._count % SLOTS
        self._count += 1
        self._tokens[s].copy_(sample(logits, self.params, self.gen))
        self._read[s].copy_(self._tokens[s], non_blocking=True)
        if self._done:
            self._done[s].record()
        return s

    def collect(self, slot: int) -> int:
        """The token the step queued as `slot` picked (waits for that step alone)."""
        if self._done:
            self._done[slot].synchronize()
        return int(self._read[slot])

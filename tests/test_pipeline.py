"""The pipelined greedy MTP loop (engine/pipeline.py), run eagerly on the CPU: the tokens of plain greedy
decoding, and the very state the synced loop leaves — also when the answer stops, is cancelled or is
closed with a cycle still queued, and near the context's end where the loop goes back to synced steps."""

from __future__ import annotations

import pytest
import torch

from sparkchat.engine.config import ModelConfig
from sparkchat.engine.events import SamplingParams
from sparkchat.engine.generate import generate_tokens
from sparkchat.engine.loader import load_model
from sparkchat.engine.model import LingModel
from sparkchat.engine.state import ConversationState

PROMPT = list(range(5, 40))


@pytest.fixture(scope="module")
def models(tiny_model_dir, agree_dir) -> dict[str, LingModel]:
    def load(path) -> LingModel:
        return load_model(path, ModelConfig.from_dir(path), "cpu", torch.float32, 512)

    return {"random-draft": load(tiny_model_dir), "agreeing-draft": load(agree_dir)}


def _answer(model: LingModel, monkeypatch, *, pipelined: bool | None, k: int = 3, n: int = 60,
            stop: set[int] = frozenset(), context: int = 512, state: ConversationState | None = None,
            prompt: list[int] = PROMPT, stop_after: int | None = None):
    """(tokens, last step's stats, finish reason, state) of one greedy answer; pipelined None: no MTP."""
    monkeypatch.setenv("SPARKCHAT_PIPELINE", "1" if pipelined else "0")
    state = state or ConversationState.allocate(model.cfg, context, "cpu", torch.float32)
    tokens, last = [], None
    steps = generate_tokens(model, state, prompt, SamplingParams(max_tokens=n), set(stop),
                            mtp=pipelined is not None, draft_steps=k)
    for out in steps:
        tokens += out.tokens
        last = out
        if stop_after is not None and len(tokens) >= stop_after:
            steps.close()  # the consumer walks away mid-answer (GeneratorExit at the yield)
            break
    return tokens, last.stats, last.finish_reason, state


def _same_state(a: ConversationState, b: ConversationState) -> None:
    assert a.token_ids == b.token_ids and a.mtp_length == b.mtp_length
    sa, sb = a.snapshot(), b.snapshot()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.allclose(sa[name], sb[name], atol=1e-5, rtol=1e-4), name
    n, m = a.length, a.mtp_length
    assert torch.allclose(a.hidden[:n], b.hidden[:n], atol=1e-5, rtol=1e-4)
    assert torch.allclose(a.mtp.latent[:m], b.mtp.latent[:m], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("which", ["random-draft", "agreeing-draft"])
@pytest.mark.parametrize("k", [1, 3])
def test_pipelined_greedy_equals_plain_greedy_and_the_synced_state(models, monkeypatch, which, k):
    model = models[which]
    plain, _, _, _ = _answer(model, monkeypatch, pipelined=None)
    synced, s_stats, _, s_state = _answer(model, monkeypatch, pipelined=False, k=k)
    piped, p_stats, reason, p_state = _answer(model, monkeypatch, pipelined=True, k=k)
    assert len(plain) == 60 and piped == plain == synced and reason == "length"
    assert p_stats.accept_length_mean == s_stats.accept_length_mean
    assert p_stats.accept_rate_per_position == s_stats.accept_rate_per_position
    if which == "agreeing-draft" and k == 3:
        assert p_stats.accept_length_mean >= 2.0  # cycles really accepted several drafts, so slots were picked
    _same_state(p_state, s_state)


def test_a_stop_token_drops_the_queued_cycle_and_the_next_turn_goes_on(models, monkeypatch):
    model = models["agreeing-draft"]
    plain, _, _, _ = _answer(model, monkeypatch, pipelined=None)
    stop = {plain[20]}
    first = plain.index(plain[20])
    runs = {}
    for pipelined in (False, True):
        tokens, _, reason, state = _answer(model, monkeypatch, pipelined=pipelined, stop=stop)
        assert reason == "stop" and tokens == plain[:first]
        # a second turn on the same state: the MTP cache went back to where the synced loop leaves it
        more, _, _, state = _answer(model, monkeypatch, pipelined=pipelined, state=state, prompt=[7, 8, 9], n=30)
        runs[pipelined] = (more, state)
    assert runs[True][0] == runs[False][0]
    _same_state(runs[True][1], runs[False][1])


def test_closing_the_answer_mid_cycle_leaves_the_synced_state(models, monkeypatch):
    model = models["agreeing-draft"]
    a, _, _, synced = _answer(model, monkeypatch, pipelined=False, stop_after=17)
    b, _, _, piped = _answer(model, monkeypatch, pipelined=True, stop_after=17)
    assert a == b
    _same_state(piped, synced)


def test_near_the_context_end_it_falls_back_to_synced_cycles(models, monkeypatch):
    model = models["random-draft"]
    context = len(PROMPT) + 30  # the answer runs into the end: the last cycles cannot be queued ahead
    plain, _, p_reason, _ = _answer(model, monkeypatch, pipelined=None, context=context)
    synced, _, _, s_state = _answer(model, monkeypatch, pipelined=False, context=context)
    piped, _, reason, state = _answer(model, monkeypatch, pipelined=True, context=context)
    assert piped == synced == plain and reason == p_reason == "length" and len(piped) < 60
    _same_state(state, s_state)


def test_filling_the_catch_ups_rejected_slots_changes_no_draft(models, monkeypatch):
    """SPARKCHAT_PIPELINE_FILL=1: the catch-up's slots past the accepted one repeat its token and hidden
    state (for their MoE's sake) — attention is causal and every other op works row by row, so the
    drafts, their acceptance and the tokens are those of the unfilled loop, and so is the target's state."""
    model = models["agreeing-draft"]
    plain, p_stats, _, p_state = _answer(model, monkeypatch, pipelined=True)
    monkeypatch.setenv("SPARKCHAT_PIPELINE_FILL", "1")
    filled, f_stats, _, f_state = _answer(model, monkeypatch, pipelined=True)
    assert filled == plain and p_stats.accept_length_mean >= 2.0
    assert f_stats.accept_rate_per_position == p_stats.accept_rate_per_position
    _same_state(f_state, p_state)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_answers_that_end_within_the_first_cycles(models, monkeypatch, n):
    """max_tokens 1 (before any cycle), 2 (inside the first, the second already queued) and 5: the synced
    loop's tokens and state."""
    model = models["agreeing-draft"]
    synced, _, s_reason, s_state = _answer(model, monkeypatch, pipelined=False, n=n)
    piped, _, reason, p_state = _answer(model, monkeypatch, pipelined=True, n=n)
    assert piped == synced and len(piped) == n and reason == s_reason == "length"
    _same_state(p_state, s_state)

"""Plain decoding pipelined (engine/decode_pipeline.py, SPARKCHAT_DECODE_PIPELINE=1), run eagerly on the
CPU: the synced loop's tokens, greedy and sampled from one seed; after the answer, the synced state with
the answer's last token run as well (the queued step ran it) — also when it stops, is closed mid-answer
or reaches the context's end — and a next turn that extends it answers as the synced one does."""

from __future__ import annotations

import pytest
import torch

from sparkchat.engine.config import ModelConfig
from sparkchat.engine.events import SamplingParams
from sparkchat.engine.generate import Decoder, generate_tokens
from sparkchat.engine.loader import load_model
from sparkchat.engine.model import LingModel
from sparkchat.engine.state import ConversationState

PROMPT = list(range(5, 40))


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> LingModel:
    return load_model(tiny_model_dir, ModelConfig.from_dir(tiny_model_dir), "cpu", torch.float32, 512)


def _answer(model: LingModel, monkeypatch, pipelined: bool, *, n: int = 40, stop: set[int] = frozenset(),
            temperature: float = 0.0, context: int = 512, state: ConversationState | None = None,
            prompt: list[int] = PROMPT, close_after: int | None = None):
    monkeypatch.setenv("SPARKCHAT_DECODE_PIPELINE", "1" if pipelined else "0")
    state = state or ConversationState.allocate(model.cfg, context, "cpu", torch.float32)
    params = SamplingParams(max_tokens=n, temperature=temperature, seed=5)
    tokens, last = [], None
    steps = generate_tokens(model, state, prompt, params, set(stop), mtp=False)
    for out in steps:
        tokens += out.tokens
        last = out
        if close_after is not None and len(tokens) >= close_after:
            steps.close()
            break
    return tokens, last.finish_reason, state


def _with_token_run(model: LingModel, state: ConversationState, token: int) -> ConversationState:
    """The synced state after running `token` at its end too, as the pipelined answer's queued step did."""
    Decoder(model, state).forward([token])
    state.token_ids.append(token)
    return state


def _same_state(a: ConversationState, b: ConversationState) -> None:
    assert a.token_ids == b.token_ids
    sa, sb = a.snapshot(), b.snapshot()
    for name in sa:
        assert torch.allclose(sa[name], sb[name], atol=1e-5, rtol=1e-4), name
    assert torch.allclose(a.hidden[:a.length], b.hidden[:b.length], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_pipelined_steps_give_the_synced_tokens_and_state(model, monkeypatch, temperature):
    synced, reason, s_state = _answer(model, monkeypatch, False, temperature=temperature)
    piped, p_reason, p_state = _answer(model, monkeypatch, True, temperature=temperature)
    assert len(synced) == 40 and piped == synced and reason == p_reason == "length"
    _same_state(p_state, _with_token_run(model, s_state, synced[-1]))


def test_a_stop_token_is_kept_in_the_state_and_the_next_turn_answers_alike(model, monkeypatch):
    plain, _, _ = _answer(model, monkeypatch, False)
    stop = {plain[15]}
    first = plain.index(plain[15])
    synced, reason, s_state = _answer(model, monkeypatch, False, stop=stop)
    piped, p_reason, p_state = _answer(model, monkeypatch, True, stop=stop)
    assert piped == synced == plain[:first] and reason == p_reason == "stop"
    assert p_state.token_ids[-1] == plain[15] and p_state.length == s_state.length + 1
    # the next turn: its prompt holds the stop token, as a chat template writes the answer back
    turn = [plain[15], 7, 8, 9]
    again, _, _ = _answer(model, monkeypatch, False, state=s_state, prompt=turn, n=20)
    more, _, _ = _answer(model, monkeypatch, True, state=p_state, prompt=turn[1:], n=20)
    assert more == again


def test_closing_mid_answer_keeps_the_state_whole(model, monkeypatch):
    synced, _, s_state = _answer(model, monkeypatch, False, close_after=12)
    piped, _, p_state = _answer(model, monkeypatch, True, close_after=12)
    assert piped == synced
    _same_state(p_state, _with_token_run(model, s_state, synced[-1]))


def test_at_the_context_end_the_last_steps_are_synced(model, monkeypatch):
    context = len(PROMPT) + 20
    synced, reason, s_state = _answer(model, monkeypatch, False, context=context)
    piped, p_reason, p_state = _answer(model, monkeypatch, True, context=context)
    assert piped == synced and reason == p_reason == "length" and len(piped) < 40
    _same_state(p_state, s_state)  # no step was queued past the last one the context holds


@pytest.mark.parametrize("n", [1, 2])
def test_answers_of_one_and_two_tokens(model, monkeypatch, n):
    """One token comes from the prompt alone: nothing is queued, the synced state; two: one step, and
    the queued step after it ran the second token."""
    synced, _, s_state = _answer(model, monkeypatch, False, n=n)
    piped, _, p_state = _answer(model, monkeypatch, True, n=n)
    assert piped == synced and len(piped) == n
    _same_state(p_state, s_state if n == 1 else _with_token_run(model, s_state, synced[-1]))

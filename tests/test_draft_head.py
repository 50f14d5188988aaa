"""The truncated draft head: the draft's logits over the N most frequent tokens only, through the very
same LMHead module (and numerics) as the target; the verify keeps the full head, so greedy output is
unchanged and sampling keeps the target distribution."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from sparkchat.engine.config import ModelConfig
from sparkchat.engine.draft_vocab import (chat_token_ids, complete_ranking, draft_rows, load_ranking_file,
                                          merge_ranking, token_ranking)
from sparkchat.engine.events import SamplingParams, Switches
from sparkchat.engine.generate import Decoder, generate_tokens
from sparkchat.engine.loader import load_model
from sparkchat.engine.model import LingModel, LMHead
from sparkchat.engine.sampling import speculative_accept
from sparkchat.engine.state import ConversationState
from tests.interpreter import run_interpreted

PROMPT = list(range(5, 40))
ROOT = Path(__file__).parent.parent


def _model(path) -> LingModel:
    return load_model(path, ModelConfig.from_dir(path), "cpu", torch.float32, 512)


def _head(V: int = 320, H: int = 64, dtype=torch.float32) -> LMHead:
    head = LMHead(H, V)
    head.weight = (torch.randn(V, H, generator=torch.Generator().manual_seed(0)) * 0.1).to(dtype)
    return head


def _run(model: LingModel, mtp: bool, rows=None, k: int = 3, n: int = 40, fp8: bool = False,
         temperature: float = 0.0, seed: int | None = None):
    head = model.lm_head
    if fp8 and head.fp8_weight is None:
        head.build_fp8()
    head.use_fp8 = fp8
    head.set_draft_rows(rows)
    state = ConversationState.allocate(model.cfg, 512, "cpu", torch.float32)
    tokens, last = [], None
    params = SamplingParams(max_tokens=n, temperature=temperature, seed=seed)
    try:
        for out in generate_tokens(model, state, PROMPT, params, set(), mtp=mtp, draft_steps=k):
            tokens += out.tokens
            last = out
    finally:
        head.set_draft_rows(None)
    return tokens, last.stats


# -- the head --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("cache_dense", [False, True])
def test_truncated_logits_equal_the_full_heads_rows(fp8, cache_dense):
    head = _head()
    head.cache_dense = cache_dense
    if fp8:
        head.build_fp8()
    head.use_fp8 = fp8
    ids = torch.randperm(320, generator=torch.Generator().manual_seed(1))[:100]
    head.set_draft_rows(ids)
    assert torch.equal(head.draft_ids, ids.sort().values)  # kept sorted: ties break as the full argmax does
    h = torch.randn(3, 64)
    full, draft = head(h), head(h, draft=True)
    assert draft.shape == (3, 100) and draft.dtype == torch.float32
    torch.testing.assert_close(draft, full[:, head.draft_ids], rtol=1e-6, atol=1e-6)
    assert torch.equal(head(h, draft=True), draft)  # a second call (cached copies) is the same
    assert head(h).shape == (3, 320)  # the target's call is untouched


def test_bf16_numerics_too():
    head = _head(dtype=torch.bfloat16)
    head.set_draft_rows(list(range(0, 320, 3)))
    h = torch.randn(2, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(head(h, draft=True), head(h)[:, head.draft_ids], rtol=0, atol=0)


def test_the_gpu_path_runs_fast_fp8_on_a_row_copy_of_the_fp8_head():
    """On CUDA, `fast_fp8(h, w, scale)` (the FP8 head GEMV) serves the draft too, on the N gathered rows
    of the quantized weight and their scales: the same bytes, not a requantization."""
    from sparkchat.engine.kernels.reference import fp8_head_gemv_reference

    head = _head()
    head.build_fp8()
    head.use_fp8 = True
    calls = []

    def fast(h, w, scale):
        calls.append((w, scale))
        return fp8_head_gemv_reference(h, w, scale)

    head.fast_fp8 = fast
    ids = torch.tensor([0, 1, 5, 17, 100, 319])
    head.set_draft_rows(ids)
    h = torch.randn(1, 64)
    torch.testing.assert_close(head(h, draft=True), head(h)[:, ids], rtol=1e-6, atol=1e-6)
    (w, s), (wf, sf) = calls
    assert w.shape == (6, 64) and w.dtype == torch.float8_e4m3fn and w.is_contiguous()
    assert torch.equal(w.view(torch.uint8), wf.view(torch.uint8)[ids]) and torch.equal(s, sf[ids])


def test_one_row_copy_is_held_for_the_numerics_in_use():
    head = _head()
    V, H, N = 320, 64, 64
    head.set_draft_rows(list(range(N)))
    assert set(head._draft) == {"weight"} and head.draft_bytes() == N * H * 4
    head.build_fp8()
    head.use_fp8 = True
    head.prepare_draft()
    assert set(head._draft) == {"fp8_weight", "fp8_scale"}  # the BF16 rows are dropped
    assert head.draft_bytes() == N * H + N * 4
    head.set_draft_rows(None)
    assert head._draft == {} and head.draft_bytes() == V * H + V * 4  # the full FP8 head
    with pytest.raises(ValueError):
        head.set_draft_rows([0, V])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its CPU interpreter)")
def test_truncated_head_through_the_triton_head_kernel():
    """The installed GPU head (`fastpath._fp8_head`, the `fp8_head_gemv` kernel) on the draft's row copy,
    under Triton's interpreter: equal to the full head's rows."""
    script = r"""
import torch
from sparkchat.engine import fastpath
from sparkchat.engine.model import LMHead
head = LMHead(256, 1000)
head.weight = (torch.randn(1000, 256, generator=torch.Generator().manual_seed(0)) * 0.1).to(torch.bfloat16)
head.build_fp8(); head.use_fp8 = True
head.fast_fp8 = fastpath._fp8_head()
ids = torch.randperm(1000, generator=torch.Generator().manual_seed(1))[:200]
head.set_draft_rows(ids)
h = torch.randn(1, 256).to(torch.bfloat16)
full, draft = head(h), head(h, draft=True)
assert draft.shape == (1, 200), draft.shape
torch.testing.assert_close(draft, full[:, head.draft_ids], rtol=1e-5, atol=1e-5)
print("ok")
"""
    r = run_interpreted(script, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


# -- decoding --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,fp8", [(64, False), (160, True)])
def test_greedy_output_is_plain_decoding(agree_dir, fp8, n):
    model = _model(agree_dir)
    plain, _ = _run(model, mtp=False, fp8=fp8)
    rows = sorted(torch.randperm(320, generator=torch.Generator().manual_seed(n))[:n].tolist())
    spec, stats = _run(model, mtp=True, rows=rows, fp8=fp8)
    assert len(plain) == 40 and spec == plain
    assert stats.accept_length_mean >= 1.0


def test_draft_tokens_map_back_to_the_vocabulary(agree_dir):
    """Drafts are vocabulary ids from the rows (not indices into them), and with the target's own
    greedy tokens among the rows the truncated draft is accepted as often as the full one would be."""
    model = _model(agree_dir)
    plain, _ = _run(model, mtp=False)
    _, full = _run(model, mtp=True)
    # the rows: the tokens greedy decoding emits plus a spread of others, none of them low ids only
    rows = sorted(set(plain) | set(range(250, 320)))
    tokens, stats = _run(model, mtp=True, rows=rows)
    assert tokens == plain
    assert stats.accept_length_mean >= 0.9 * full.accept_length_mean >= 1.8
    # and a draft over rows that hold none of them is never accepted
    _, none = _run(model, mtp=True, rows=sorted(set(range(320)) - set(plain)))
    assert none.accept_length_mean == 1.0


def test_subset_of_everything_equals_the_full_head(agree_dir):
    model = _model(agree_dir)
    for fp8 in (False, True):
        a_tok, a = _run(model, mtp=True, fp8=fp8)
        b_tok, b = _run(model, mtp=True, rows=list(range(320)), fp8=fp8)
        assert a_tok == b_tok
        assert a.accept_length_mean == b.accept_length_mean and a.accept_rate_per_position == b.accept_rate_per_position


def test_sampled_draft_distribution_is_zero_outside_the_rows(agree_dir):
    model = _model(agree_dir)
    state = ConversationState.allocate(model.cfg, 512, "cpu", torch.float32)
    dec = Decoder(model, state)
    _, logits, _ = dec.forward(PROMPT)
    dec.commit(PROMPT)
    rows = torch.arange(0, 320, 2)
    model.lm_head.set_draft_rows(rows)
    params = SamplingParams(temperature=1.0, top_k=50)
    tokens, q = dec.draft(int(logits[-1].argmax()), 3, params, torch.Generator().manual_seed(0))
    model.lm_head.set_draft_rows(None)
    assert q.shape == (3, 320) and all(t % 2 == 0 for t in tokens)
    assert torch.allclose(q.sum(-1), torch.ones(3)) and q[:, 1::2].abs().sum() == 0
    assert all(q[i, t] > 0 for i, t in enumerate(tokens))


def test_speculative_sampling_stays_unbiased_with_a_draft_that_misses_tokens():
    """A truncated draft puts probability 0 on tokens outside its rows; the acceptance rule must still
    emit the target distribution, the missing tokens included (they come from the residual)."""
    g = torch.Generator().manual_seed(0)
    V, k, trials = 6, 2, 30000
    p = torch.tensor([[0.30, 0.25, 0.15, 0.10, 0.15, 0.05], [0.1, 0.3, 0.2, 0.1, 0.2, 0.1], [1 / 6] * 6])
    q = torch.zeros(k, V)
    q[:, [0, 2, 3]] = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])  # rows {0, 2, 3} only
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(trials):
        drafts = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(k)])
        accepted, nxt = speculative_accept(p, q, drafts, g)
        emitted = drafts[:accepted].tolist() + [nxt]
        first[emitted[0]] += 1
        if accepted >= 1:
            second[emitted[1]] += 1
    assert (first / trials - p[0]).abs().max() < 0.012, first / trials  # ~4 standard errors
    assert (second / second.sum() - p[1]).abs().max() < 0.03


def test_sampled_generation_matches_plain_sampling(agree_dir):
    """End to end at temperature 1.5: the truncated draft's first sampled tokens follow plain sampling."""
    model = _model(agree_dir)
    rows = list(range(0, 320, 2))
    counts = {True: {}, False: {}}
    for mtp in (True, False):
        for seed in range(40):
            toks, _ = _run(model, mtp=mtp, rows=rows if mtp else None, n=2, temperature=1.5, seed=seed)
            counts[mtp][toks[1]] = counts[mtp].get(toks[1], 0) + 1
    top_plain = max(counts[False], key=counts[False].get)
    assert abs(counts[True].get(top_plain, 0) - counts[False][top_plain]) <= 15
    assert any(t % 2 for t in counts[True])  # tokens outside the rows still come out (from the verify)


# -- the ranking -------------------------------------------------------------------------------------

def test_merge_ranking_follows_the_bpe_merges():
    tj = {"model": {"type": "BPE", "vocab": {"a": 3, "b": 4, "c": 5, "ab": 7, "bc": 6, "abc": 8, "zz": 9},
                    "merges": ["b c", "a b", "ab c"]},
          "added_tokens": [{"id": 0, "content": "<|endoftext|>"}, {"id": 1, "content": "<|role_end|>"}]}
    assert merge_ranking(tj) == [3, 4, 5, 6, 7, 8, 9, 0, 1]  # alphabet, merges in order, the rest, added
    assert merge_ranking({"model": {"type": "WordPiece"}}) is None
    assert complete_ranking([8, 8, 99, 3], 10) == [8, 3, 0, 1, 2, 4, 5, 6, 7, 9]


def test_draft_rows_keep_the_chat_tokens_and_count_n():
    ranking = list(range(100, 1000)) + list(range(100))
    rows = draft_rows(ranking, 64, always={1, 2, 5}, vocab_size=1000)
    assert len(rows) == 64 and {1, 2, 5} <= set(rows) and rows == sorted(rows)
    assert set(rows) - {1, 2, 5} == set(range(100, 161))
    assert draft_rows(ranking, 1000, always={1}, vocab_size=1000) is None  # covers everything: full head


def test_ranking_sources(tiny_model_dir, tmp_path, monkeypatch):
    from sparkchat.engine.tokenizer import ChatTokenizer

    ranking, source = token_ranking(tiny_model_dir, 320)
    assert sorted(ranking) == list(range(320)) and source in ("BPE merge order", "token id")
    tok = ChatTokenizer.from_dir(tiny_model_dir)
    chat = chat_token_ids(tok)
    assert tok.stop_token_ids <= chat and tok.token_id("<think>") in chat and tok.token_id("</think>") in chat
    # a ranked-id file in the model directory, or one named by the environment, wins
    f = tmp_path / "ranked.txt"
    f.write_text("7 3 9\n")
    assert load_ranking_file(f) == [7, 3, 9]
    monkeypatch.setenv("SPARKCHAT_DRAFT_RANKING", str(f))
    ranking, source = token_ranking(tiny_model_dir, 320)
    assert ranking[:3] == [7, 3, 9] and "SPARKCHAT_DRAFT_RANKING" in source and len(ranking) == 320
    monkeypatch.delenv("SPARKCHAT_DRAFT_RANKING")
    g = tmp_path / "draft_vocab.json"
    g.write_text(json.dumps({"ranked_ids": [11, 12]}))
    assert load_ranking_file(g) == [11, 12]


def test_corpus_ranking_tool(tiny_model_dir, tmp_path):
    from sparkchat.engine.draft_vocab import main

    text = tmp_path / "corpus.txt"
    text.write_text("hello hello hello world")
    out = tmp_path / "draft_vocab.json"
    assert main(["--model", str(tiny_model_dir), "--out", str(out), str(text)]) == 0
    data = json.loads(out.read_text())
    assert data["tokens_counted"] > 0 and data["ranked_ids"] == load_ranking_file(out)


# -- the switch ----------------------------------------------------------------------------------------

def test_engine_switch(agree_dir):
    from sparkchat.engine.session import Engine

    engine = Engine.load(agree_dir, device="cpu", max_context=256)
    assert engine.switches.truncated_draft_head is False  # CPU default: off (it pays where head bytes dominate)
    prompt = list(range(5, 30))

    def run(**sw):
        engine.reset()
        engine.set_switches(Switches(**sw))
        events = list(engine.generate_ids(prompt, SamplingParams(max_tokens=30, ignore_eos=True)))
        return [t for e in events for t in e.token_ids], events[-1].stats

    plain, _ = run(mtp=False, fp8_head=False, truncated_draft_head=True, draft_vocab=96)
    state = engine.switch_states()["truncated_draft_head"]
    assert state.available and not state.on and "MTP is off" in state.reason
    toks, s = run(mtp=True, fp8_head=False, truncated_draft_head=True, draft_vocab=96)
    head = engine.model.lm_head
    assert toks == plain and head.draft_ids is not None and head.draft_ids.numel() == 96
    assert s.switches["truncated_draft_head"] is True and s.switches["draft_vocab"] == 96
    assert set(engine.tokenizer.stop_token_ids) <= set(head.draft_ids.tolist())
    toks, s = run(mtp=True, fp8_head=True, truncated_draft_head=True, draft_vocab=96)
    assert toks and {"fp8_weight", "fp8_scale"} <= set(head._draft) and "weight" not in head._draft
    toks, s = run(mtp=True, fp8_head=False, truncated_draft_head=False)
    assert head.draft_ids is None and s.switches["truncated_draft_head"] is False and s.switches["draft_vocab"] == 320
    engine.set_switches(Switches(draft_vocab=32768))  # larger than the vocabulary: nothing to truncate
    state = engine.switch_states()["truncated_draft_head"]
    assert not state.available and "fits in the draft vocabulary" in state.reason


def test_settings_and_flags(tmp_path, capsys):
    from sparkchat.cli import main
    from sparkchat.settings import Settings, SettingsError, parse_value, set_value

    s = set_value(Settings(), "draft_vocab", "16384")
    assert s.switches.draft_vocab == 16384 and s.to_dict()["switches"]["draft_vocab"] == 16384
    assert parse_value("switches.truncated_draft_head", "off") is False
    with pytest.raises(SettingsError, match="at least"):
        set_value(Settings(), "draft_vocab", "8")
    with pytest.raises(SystemExit):
        main(["ask", "--help"])
    text = capsys.readouterr().out
    readme = (ROOT / "README.md").read_text()
    for flag in ("--truncated-draft-head", "--draft-vocab"):
        assert flag in text and flag in readme


def test_ask_flags_reach_the_engine(tiny_model_dir, capsys, monkeypatch):
    import io

    from sparkchat.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # nothing piped

    assert main(["ask", "hello", "--model", str(tiny_model_dir), "--device", "cpu", "--json", "--max-tokens", "6",
                 "--truncated-draft-head", "--draft-vocab", "128"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["switches"]["truncated_draft_head"] is True and out["stats"]["switches"]["draft_vocab"] == 128
    assert out["switches"]["truncated_draft_head"]["on"] is True
    assert main(["ask", "hello", "--model", str(tiny_model_dir), "--draft-vocab", "3"]) == 2


def test_bench_times_both_draft_heads(tmp_path, capsys):
    from sparkchat.cli import main
    from tests.test_bench import SMALL

    cfg_path = tmp_path / "small.json"
    cfg_path.write_text(json.dumps(SMALL))  # vocabulary 1,000
    base = ["bench", "--config", str(cfg_path), "--device", "cpu", "--context", "16", "--iters", "1"]
    assert main(base + ["--draft-vocab", "256", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["draft_vocab"] == 256 and "draft head top 256" in out["rows"][3]["name"]
    assert out["draft_head_bytes"] * 3 < out["draft_head_full_bytes"]
    assert out["draft_step_ms"] > 0 and out["draft_step_full_head_ms"] > 0 and out["mtp_full_head_tpot_ms"] > 0
    from sparkchat.cli.bench import format_table

    assert "full head" in format_table(out) and "draft head top 256 tokens" in format_table(out)
    assert main(base + ["--no-truncated-draft-head", "--json"]) == 0  # the bench's output as it was
    out = json.loads(capsys.readouterr().out)
    assert out["draft_vocab"] is None and out["rows"][3]["name"] == "+ MTP (3 draft steps)"

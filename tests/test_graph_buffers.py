"""The speculative loop's use of graph outputs, on the CPU: a stand-in for StepGraphs that runs each step
eagerly into fixed output buffers, as a replay does, and — because the real graphs share one memory
pool — spoils every other graph's outputs whenever one replays. A loop that reads a graph's output
after another graph has replayed then goes wrong here, where on a GPU it would go wrong only when the
pool happens to alias those buffers (it did: the first queued verify read its drafts back that way)."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

import pytest
import torch

from sparkchat.engine import graphs as G
from sparkchat.engine.events import SamplingParams
from sparkchat.engine.generate import generate_tokens


def _copy_into(dst, src):
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for key in dst:
            _copy_into(dst[key], src[key])
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)
    elif is_dataclass(dst):
        for f in fields(dst):
            _copy_into(getattr(dst, f.name), getattr(src, f.name))


def _spoil(out) -> None:
    if isinstance(out, torch.Tensor):
        out.fill_(-1 if not out.is_floating_point() else float("nan"))
    elif isinstance(out, dict):
        for v in out.values():
            _spoil(v)
    elif isinstance(out, (tuple, list)):
        for v in out:
            _spoil(v)
    elif is_dataclass(out):
        for f in fields(out):
            _spoil(getattr(out, f.name))


class _Replay:
    def __init__(self, owner: "SpoilingGraphs", c: G._Captured, args: tuple) -> None:
        self.owner, self.c, self.args = owner, c, args

    def replay(self) -> None:
        with torch.inference_mode():  # the outputs were made in inference mode
            for other in self.owner.graphs.values():
                if other is not self.c and self.owner.spoil:
                    _spoil(other.out)
            _copy_into(self.c.out, self.owner._run(*self.args))


class SpoilingGraphs(G.StepGraphs):
    def __init__(self, model, state, spoil: bool = True) -> None:
        self.model, self.state = model, state
        self.device = model.embed.device
        self.graphs = {}
        self.spoil = spoil  # False: replays leave other graphs' outputs alone (a reference to compare with)

    def _capture(self, kind, T, bucket, keep_steps, start, chain=0, sampling=None, pick=False):
        c = G._step_inputs(self.model, kind, T, start, chain, sampling, pick=pick)
        saved = [(s.conv.clone(), s.recurrent.clone()) for s in self.state.kda.values()]
        c.out = self._run(kind, c, bucket, keep_steps, chain, sampling)  # the capture runs the step, as on a GPU
        for s, (conv, rec) in zip(self.state.kda.values(), saved):
            s.conv.copy_(conv)
            s.recurrent.copy_(rec)
        c.graph = _Replay(self, c, (kind, c, bucket, keep_steps, chain, sampling))
        return c


@pytest.mark.parametrize("queued,pipelined", [("0", "0"), ("1", "0"), ("1", "1")])
def test_speculative_loop_reads_graph_outputs_before_the_next_replay(agree_dir, monkeypatch, queued, pipelined):
    from sparkchat.engine.config import ModelConfig
    from sparkchat.engine.loader import load_model
    from sparkchat.engine.state import ConversationState

    cfg = ModelConfig.from_dir(agree_dir)
    model = load_model(agree_dir, cfg, "cpu", torch.float32, 256)
    monkeypatch.setenv("SPARKCHAT_QUEUED_VERIFY", queued)
    monkeypatch.setenv("SPARKCHAT_PIPELINE", pipelined)  # 1: each cycle queued before the last is read
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def run(graphs: bool, mtp: bool) -> tuple[list[int], float | None]:
        state = ConversationState.allocate(cfg, 256, "cpu", torch.float32)
        tokens, stats = [], None
        for out in generate_tokens(model, state, list(range(5, 30)), params, set(), mtp=mtp, draft_steps=3,
                                   graphs=SpoilingGraphs(model, state) if graphs else None):
            tokens += out.tokens
            stats = out.stats
        return tokens, stats.accept_length_mean

    plain, _ = run(False, False)
    eager, _ = run(False, True)
    graphed, accept = run(True, True)
    assert eager == plain and graphed == plain
    assert accept is not None and accept > 1.5  # drafts were accepted: the catch-up took several slots


def test_sampled_drafts_in_one_graph_read_their_outputs_before_the_next_replay(agree_dir, monkeypatch):
    """Sampled MTP with the drafts drawn inside the chain graph: with the verify queued behind the chain
    or not, each cycle queued before the last is read (the pipelined loop) or not, spoiling stand-in or
    not, the same seed gives the same tokens — the loop reads every graph output before another graph
    replays, and every loop draws from the generator in the same order."""
    from sparkchat.engine.config import ModelConfig
    from sparkchat.engine.loader import load_model
    from sparkchat.engine.state import ConversationState

    cfg = ModelConfig.from_dir(agree_dir)
    model = load_model(agree_dir, cfg, "cpu", torch.float32, 256)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=40, ignore_eos=True)

    def run(queued: str, spoil: bool, pipelined: str = "0") -> tuple[list[int], object]:
        monkeypatch.setenv("SPARKCHAT_QUEUED_VERIFY", queued)
        monkeypatch.setenv("SPARKCHAT_PIPELINE", pipelined)
        state = ConversationState.allocate(cfg, 256, "cpu", torch.float32)
        tokens, stats = [], None
        for out in generate_tokens(model, state, list(range(5, 30)), params, set(), mtp=True, draft_steps=3,
                                   graphs=SpoilingGraphs(model, state, spoil)):
            tokens += out.tokens
            stats = out.stats
        return tokens, stats

    reference, stats = run("0", False)
    assert len(reference) == 40 and all(0 <= t < cfg.vocab_size for t in reference)
    assert stats.accept_length_mean > 1.2 and stats.draft_s > 0  # the agree model's drafts get accepted
    for queued, spoil in (("0", True), ("1", False), ("1", True)):
        assert run(queued, spoil)[0] == reference, (queued, spoil)
    for spoil in (False, True):
        tokens, piped = run("1", spoil, pipelined="1")
        assert tokens == reference and piped.accept_length_mean == stats.accept_length_mean, spoil
    monkeypatch.setenv("SPARKCHAT_DRAFT_CHAIN", "0")  # a replay per draft step: another draw, same model
    other, _ = run("1", True)
    assert len(other) == 40 and other[:1] == reference[:1]  # the first token comes before any draft

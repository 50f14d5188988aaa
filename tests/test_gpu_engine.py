"""The whole GPU path (Triton kernels, CUDA graphs) against the reference path, on tiny models.

Skipped without CUDA. On the development GPU the tiny model directories can be passed prebuilt with
SPARKCHAT_GPU_MODELS=DIR (holding `random/` and `agree/`), since its transformers may be older."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    prebuilt = os.environ.get("SPARKCHAT_GPU_MODELS")
    if prebuilt:
        return {name: Path(prebuilt) / name for name in ("random", "agree")}
    from tests.conftest import make_model_dir
    from tests.tiny import make_draft_agree

    root = tmp_path_factory.mktemp("gpu")
    agree = make_model_dir(root / "agree", seed=3)
    make_draft_agree(agree)
    return {"random": make_model_dir(root / "random"), "agree": agree}


def _greedy(engine, prompt, n=48, sampling=None, **switches):
    from sparkchat.engine.events import SamplingParams, Switches

    engine.set_switches(Switches(**switches))
    engine.reset()
    tokens, stats = [], None
    for event in engine.generate_ids(prompt, sampling or SamplingParams(max_tokens=n, ignore_eos=True)):
        tokens += event.token_ids
        stats = event.stats
    return tokens, stats


def _teacher_forced_logits(engine, prompt, tokens, **switches):
    """Logits after the prompt and after each of `tokens`, fed one at a time through the engine's
    decoder with the given switches (CUDA graphs included when on)."""
    from sparkchat.engine.events import Switches
    from sparkchat.engine.generate import Decoder

    engine.set_switches(Switches(**switches))
    engine._apply_switches()
    engine.reset()
    dec = Decoder(engine.model, engine.state, engine._graphs)
    _, logits, _ = dec.forward(prompt)
    dec.commit(prompt)
    out = [logits[-1].clone()]
    for t in tokens:
        _, logits, _ = dec.forward([t])
        dec.commit([t])
        out.append(logits[-1].clone())
    return torch.stack(out)


@pytest.mark.parametrize("which", ["random", "agree"])
def test_fast_path_matches_the_reference_path(model_dirs, which):
    from sparkchat.engine.session import Engine

    engine = Engine.load(model_dirs[which], device="cuda", dtype="bfloat16", max_context=512,
                         quantize_experts=True)
    prompt = list(range(5, 60))
    ref_tokens, _ = _greedy(engine, prompt, mtp=False, fp8_head=False, mxfp4_kernels=False, cuda_graphs=False)
    ref = _teacher_forced_logits(engine, prompt, ref_tokens, mtp=False, fp8_head=False, mxfp4_kernels=False,
                                 cuda_graphs=False)
    for switches in (dict(mxfp4_kernels=True, cuda_graphs=False), dict(mxfp4_kernels=True, cuda_graphs=True)):
        fast = _teacher_forced_logits(engine, prompt, ref_tokens, mtp=False, fp8_head=False, **switches)
        scale = ref.abs().amax(-1)
        per_step = (fast - ref).abs().amax(-1) / scale
        # bf16 sums in another order can flip a near-tied router choice on a tiny random model, which
        # moves that step's logits far: most steps must agree closely, none wildly. How many flip depends
        # on which near-ties the kernels' rounding happens to cross (H200, session 11: the MLA step kernels
        # flip 5 of 49 steps of the random model with a lower median error than the compiled twin, 0.0097
        # against 0.011, which flips 2); the median is what a systematic error would move.
        agree = per_step < 0.05
        assert agree.float().mean().item() >= 0.85 and per_step.max().item() < 0.5, (switches, per_step.tolist())
        assert per_step.median().item() < 0.02, (switches, per_step.tolist())
        # where the paths agree, the same greedy token, unless the reference is within bf16 noise of a tie
        gap = ref.amax(-1) - ref.gather(-1, fast.argmax(-1)[:, None]).squeeze(-1)
        assert bool((gap <= 0.02 * scale)[agree].all()), (switches, gap, per_step)
    # speculative decoding on the fast path is lossless against plain decoding on the fast path
    plain, _ = _greedy(engine, prompt, mtp=False, fp8_head=False, mxfp4_kernels=True, cuda_graphs=True)
    spec, s = _greedy(engine, prompt, mtp=True, fp8_head=False, mxfp4_kernels=True, cuda_graphs=True)
    assert s.switches["cuda_graphs"] and s.accept_length_mean is not None
    same = next((i for i, (x, y) in enumerate(zip(plain, spec)) if x != y), len(plain))
    assert same >= 24, (plain, spec)  # bf16 verify windows may break a near-tie late
    if which == "agree":
        assert s.accept_length_mean >= 1.8


def test_fp8_head_and_mtp_keep_accept_length_on_gpu(model_dirs):
    from sparkchat.engine.session import Engine

    engine = Engine.load(model_dirs["agree"], device="cuda", dtype="bfloat16", max_context=512,
                         quantize_experts=True)
    prompt = list(range(5, 60))
    _, bf16 = _greedy(engine, prompt, mtp=True, fp8_head=False, mxfp4_kernels=True, cuda_graphs=True)
    _, fp8 = _greedy(engine, prompt, mtp=True, fp8_head=True, mxfp4_kernels=True, cuda_graphs=True)
    assert fp8.switches["fp8_head"] and fp8.accept_length_mean >= 0.75 * bf16.accept_length_mean


def _agree_engine_with_mtp(model_dirs, max_context: int = 512):
    """The `agree` model on the GPU with MTP and the kernels on, graphs off (a test builds its own), reset."""
    from sparkchat.engine.events import Switches
    from sparkchat.engine.session import Engine

    engine = Engine.load(model_dirs["agree"], device="cuda", dtype="bfloat16", max_context=max_context,
                         quantize_experts=True)
    engine.set_switches(Switches(mtp=True, fp8_head=False, mxfp4_kernels=True, cuda_graphs=False))
    engine._apply_switches()
    engine.reset()
    return engine


def test_graph_capture_leaves_written_cache_rows_alone(model_dirs):
    """Capturing a graph runs the step for real; it must not overwrite MLA cache rows that already
    hold the conversation (a capture at position 0 once clobbered the first row)."""
    from sparkchat.engine.events import SamplingParams
    from sparkchat.engine.generate import Decoder
    from sparkchat.engine.graphs import StepGraphs

    engine = _agree_engine_with_mtp(model_dirs)
    st = engine.state
    prompt = list(range(5, 40))
    eager = Decoder(engine.model, st)
    eager.forward(prompt)
    eager.commit(prompt)
    eager.mtp_catch_up(7)
    n = st.length
    main_rows = {i: c.latent[:n].clone() for i, c in st.mla.items()}
    mtp_rows = st.mtp.latent[:n].clone()
    graphed = Decoder(engine.model, st, StepGraphs(engine.model, st))
    graphed.forward([7])  # captures the decode graph, then replays it at position n
    for i, c in st.mla.items():
        assert torch.equal(c.latent[:n], main_rows[i]), i
    graphed.commit([7])
    graphed.draft(9, 2, SamplingParams(temperature=0.0), None)  # captures the draft graph (catch-up, step)
    assert torch.equal(st.mtp.latent[:n], mtp_rows)


@pytest.mark.parametrize("length,catch_up,k,max_context", [(35, 2, 3, 512), (35, 1, 1, 512), (1023, 1, 3, 2048)],
                         ids=["two-slot-catch-up", "one-draft", "across-a-bucket"])
def test_greedy_draft_chain_matches_step_by_step(model_dirs, monkeypatch, length, catch_up, k, max_context):
    """A greedy draft as one graph (catch-up plus k-1 steps fed their predecessor's argmax on the
    device) drafts the very tokens, and writes the very MTP cache rows, that the step-by-step replays
    do — with the full and a truncated head, and with drafts whose context bucket changes midway (each
    draft attends over its own bucket, as its own replay would)."""
    from sparkchat.engine.events import SamplingParams
    from sparkchat.engine.generate import Decoder
    from sparkchat.engine.graphs import StepGraphs

    engine = _agree_engine_with_mtp(model_dirs, max_context)
    st = engine.state
    prompt = [5 + i % 200 for i in range(length)]
    Decoder(engine.model, st).forward(prompt)
    st.token_ids.extend(prompt)
    n = st.length
    head = engine.model.lm_head
    for rows in (None, list(range(3, 300, 2))):
        head.set_draft_rows(rows)
        dec = Decoder(engine.model, st, StepGraphs(engine.model, st))
        drafted, written = {}, {}
        for chain in ("0", "1", "1"):  # the chain twice: captured, then replayed
            monkeypatch.setenv("SPARKCHAT_DRAFT_CHAIN", chain)
            st.mtp_length = n - catch_up  # as after a verify that accepted catch_up - 1 drafts
            tokens, q = dec.draft(9, k, SamplingParams(temperature=0.0), None)
            assert q is None and st.mtp_length == n and len(tokens) == k
            drafted.setdefault(chain, []).append(tokens)
            written.setdefault(chain, []).append(st.mtp.latent[n - catch_up:n + k - 1].clone())
        assert drafted["1"][0] == drafted["1"][1] == drafted["0"][0], (rows, drafted)
        assert torch.equal(written["1"][1], written["0"][0])
        assert rows is None or all(t in rows for t in drafted["1"][0])
    head.set_draft_rows(None)


def test_verify_windows_on_the_tensor_core_gemv(model_dirs, monkeypatch):
    """The tiny model's FP8 linears and head through fp8_mma_kernel wherever a window has several tokens
    (the full model's rule picks it only for ≥ 4096 rows): speculative decoding stays lossless against
    plain decoding on the fast path, and keeps its accept length."""
    from sparkchat.engine.kernels import fp8_gemv
    from sparkchat.engine.session import Engine

    picked = []
    rule = fp8_gemv.gemv_config

    def recording(*args, **kwargs):
        cfg = rule(*args, **kwargs)
        picked.append(cfg.mma)
        return cfg

    monkeypatch.setattr(fp8_gemv, "MMA_MIN_ROWS", 1)
    monkeypatch.setattr(fp8_gemv, "gemv_config", recording)
    engine = Engine.load(model_dirs["agree"], device="cuda", dtype="bfloat16", max_context=512,
                         quantize_experts=True)
    prompt = list(range(5, 60))
    plain, _ = _greedy(engine, prompt, mtp=False, fp8_head=True, mxfp4_kernels=True, cuda_graphs=True)
    spec, s = _greedy(engine, prompt, mtp=True, fp8_head=True, mxfp4_kernels=True, cuda_graphs=True)
    assert any(picked) and not all(picked)  # the verify windows on tensor cores, one-token steps not
    same = next((i for i, (x, y) in enumerate(zip(plain, spec)) if x != y), len(plain))
    assert same >= 24, (plain, spec)
    assert s.accept_length_mean >= 1.8


@pytest.mark.parametrize("truncated", [False, True])
def test_queued_verify_drafts_and_verifies_as_the_synced_loop(model_dirs, monkeypatch, truncated):
    """SPARKCHAT_QUEUED_VERIFY=1 (the verify reads the drafts on the device, one host sync a cycle): the
    very tokens and accept length of the loop that syncs between draft and verify, on the `agree` model
    (drafts accepted, so the catch-up takes several slots and new chain graphs are captured after the
    verify's), with the full draft head and one truncated to 64 rows."""
    from sparkchat.engine.session import Engine

    engine = Engine.load(model_dirs["agree"], device="cuda", dtype="bfloat16", max_context=512,
                         quantize_experts=True)
    prompt = list(range(5, 60))
    runs = {}
    monkeypatch.setenv("SPARKCHAT_PIPELINE", "0")  # the synced loop's two forms (the pipelined one: below)
    for queued in ("0", "1"):
        monkeypatch.setenv("SPARKCHAT_QUEUED_VERIFY", queued)
        runs[queued] = _greedy(engine, prompt, mtp=True, fp8_head=True, mxfp4_kernels=True, cuda_graphs=True,
                               truncated_draft_head=truncated, draft_vocab=64)
    (synced, s0), (queued, s1) = runs["0"], runs["1"]
    assert queued == synced and s1.accept_length_mean == s0.accept_length_mean
    assert s1.draft_s > 0 and s1.verify_s > 0
    if not truncated:
        assert s1.accept_length_mean >= 1.5  # drafts were accepted: catch-ups over several slots ran


@pytest.mark.parametrize("truncated,fill,kernels", [(False, "0", "0"), (True, "0", "0"), (False, "1", "0"),
                                                   (False, "0", "1"), (True, "1", "1")])
def test_pipelined_loop_matches_the_synced_loop(model_dirs, monkeypatch, truncated, fill, kernels):
    """The greedy MTP loop with each cycle queued before the host reads the one before (the default with
    graphs, engine/pipeline.py) against the synced loop: the same tokens; the same target states after
    the answer, whose last queued cycle was dropped (its verify's conv states put back); drafts accepted
    as often (its catch-ups run over k+1 slots, so the draft's sums differ in order, not in kind).
    fill: SPARKCHAT_PIPELINE_FILL, the catch-up's slots past the accepted one copying it; kernels:
    SPARKCHAT_PIPELINE_KERNELS, the steps between cycles in two Triton launches."""
    from sparkchat.engine.session import Engine

    monkeypatch.setenv("SPARKCHAT_PIPELINE_FILL", fill)
    monkeypatch.setenv("SPARKCHAT_PIPELINE_KERNELS", kernels)

    engine = Engine.load(model_dirs["agree"], device="cuda", dtype="bfloat16", max_context=512,
                         quantize_experts=True)
    prompt = list(range(5, 60))
    runs = {}
    for pipelined in ("0", "1"):
        monkeypatch.setenv("SPARKCHAT_PIPELINE", pipelined)
        tokens, stats = _greedy(engine, prompt, mtp=True, fp8_head=True, mxfp4_kernels=True, cuda_graphs=True,
                                truncated_draft_head=truncated, draft_vocab=64)
        torch.cuda.synchronize()
        runs[pipelined] = tokens, stats, engine.state.snapshot(), engine.state.length, engine.state.mtp_length
    (synced, s0, state0, n0, m0), (piped, s1, state1, n1, m1) = runs["0"], runs["1"]
    assert piped == synced and (n1, m1) == (n0, m0)
    assert abs(s1.accept_length_mean - s0.accept_length_mean) <= 0.25
    assert s1.draft_s > 0 and s1.verify_s > 0
    if not truncated:
        assert s1.accept_length_mean >= 1.5  # drafts were accepted: catch-ups picked slots past the first
    for name in state0:
        # the target's states (a draft that differs regroups the verify windows: bf16 sums in other order)
        assert torch.allclose(state1[name].float(), state0[name].float(), atol=1e-2, rtol=1e-2), name


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_pipelined_plain_decoding_matches_the_synced_steps(model_dirs, monkeypatch, temperature):
    """Without MTP, SPARKCHAT_DECODE_PIPELINE=1 (each graphed step queued before the host reads the one
    before, its token picked on the GPU): the synced loop's tokens from one seed, and the state holds one
    token more, the answer's last (the queued step ran it), its KDA and MLA states those of the synced
    state after one more step of that token."""
    from sparkchat.engine.events import SamplingParams
    from sparkchat.engine.generate import Decoder
    from sparkchat.engine.session import Engine

    engine = Engine.load(model_dirs["random"], device="cuda", dtype="bfloat16", max_context=512,
                         quantize_experts=True)
    sampling = SamplingParams(temperature=temperature, seed=3, max_tokens=40, ignore_eos=True)
    runs = {}
    for pipelined in ("0", "1"):
        monkeypatch.setenv("SPARKCHAT_DECODE_PIPELINE", pipelined)
        tokens, _ = _greedy(engine, list(range(5, 60)), sampling=sampling, mtp=False, fp8_head=True,
                            mxfp4_kernels=True, cuda_graphs=True)
        if pipelined == "0":  # the step the pipelined answer's queued step made
            Decoder(engine.model, engine.state, engine._graphs).forward([tokens[-1]])
            engine.state.token_ids.append(tokens[-1])
        torch.cuda.synchronize()
        runs[pipelined] = tokens, engine.state.snapshot(), list(engine.state.token_ids)
    (synced, state0, ids0), (piped, state1, ids1) = runs["0"], runs["1"]
    assert piped == synced and len(piped) == 40 and ids1 == ids0
    for name in state0:
        assert torch.equal(state1[name], state0[name]), name


@pytest.mark.parametrize("truncated", [False, True])
def test_sampled_drafts_in_one_graph(model_dirs, monkeypatch, truncated):
    """Sampled MTP (temperature 0.8, top-p 0.95) with the drafts drawn inside the chain graph: the verify
    queued behind it or not, the same seed gives the same tokens (the same draws, in the same order);
    the agree model's drafts are still accepted; a replay per draft step draws differently but validly."""
    from sparkchat.engine.events import SamplingParams
    from sparkchat.engine.session import Engine

    engine = Engine.load(model_dirs["agree"], device="cuda", dtype="bfloat16", max_context=512,
                         quantize_experts=True)
    prompt = list(range(5, 60))
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=48, ignore_eos=True)
    switches = dict(mtp=True, fp8_head=True, mxfp4_kernels=True, cuda_graphs=True, truncated_draft_head=truncated,
                    draft_vocab=64)
    runs = {}
    monkeypatch.setenv("SPARKCHAT_PIPELINE", "0")  # the synced loop's two forms (the pipelined one: below)
    for queued in ("0", "1"):
        monkeypatch.setenv("SPARKCHAT_QUEUED_VERIFY", queued)
        runs[queued] = _greedy(engine, prompt, sampling=sampling, **switches)
    (synced, _), (queued, s1) = runs["0"], runs["1"]
    assert queued == synced and len(queued) == 48, (queued, synced)
    assert s1.draft_s > 0 and s1.verify_s > 0
    if not truncated:
        assert s1.accept_length_mean > 1.2, s1.accept_length_mean
    # pipelined (each cycle queued before the last is read): the same draws in the same order, but its
    # catch-ups run over k+1 slots, so the draft's bf16 sums (and a near-tie draw) may differ: CPU tests
    # hold it to the very tokens (tests/test_graph_buffers.py); here it must sample validly and accept
    monkeypatch.setenv("SPARKCHAT_PIPELINE", "1")
    piped, s2 = _greedy(engine, prompt, sampling=sampling, **switches)
    assert len(piped) == 48 and piped[0] == synced[0] and all(0 <= t < engine.model.cfg.vocab_size for t in piped)
    assert s2.draft_s > 0 and s2.verify_s > 0
    if not truncated:
        assert s2.accept_length_mean > 1.2, s2.accept_length_mean
    monkeypatch.setenv("SPARKCHAT_PIPELINE", "0")
    monkeypatch.setenv("SPARKCHAT_DRAFT_CHAIN", "0")
    stepwise, _ = _greedy(engine, prompt, sampling=sampling, **switches)
    assert len(stepwise) == 48 and all(0 <= t < engine.model.cfg.vocab_size for t in stepwise)

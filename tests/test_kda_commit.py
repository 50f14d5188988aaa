"""A speculative step's KDA commit: the one-launch kernel (kernels.kda_commit) against its twin, the
per-layer loop in ConversationState.commit_kda — under Triton's CPU interpreter and on CUDA — and what
both must give: the very state a step over the accepted positions alone leaves."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.interpreter import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = torch.cuda.is_available() and HAS_TRITON


def _layers(n: int, T: int, heads: int, d: int, K: int, C: int, conv_dtype, device, gen):
    out = []
    for _ in range(n):
        rec = (torch.randn(heads, d, d, generator=gen) * 0.3).to(device)
        k = torch.nn.functional.normalize(torch.randn(T, heads, d, generator=gen), dim=-1)
        v = torch.randn(T, heads, d, generator=gen)
        g = -torch.rand(T, heads, d, generator=gen) * 0.5
        beta = torch.rand(T, heads, 1, generator=gen).expand(T, heads, d)
        inputs = torch.stack([k, v, g, beta], dim=2).contiguous().to(device)
        conv = torch.randn(K - 1, C, generator=gen).to(conv_dtype).to(device)
        window = torch.randn(K - 1 + T, C, generator=gen).to(conv_dtype).to(device)
        out.append((rec, inputs, conv, window))
    return out


def _twin(rec, inputs, conv, window, last):
    from sparkchat.engine.nn.kda import commit_steps

    rec = rec.clone()
    commit_steps(rec, inputs, last)
    return rec, window[last + 1:last + conv.shape[0] + 1].clone()


def kernel_against_twin(device: str) -> None:
    from sparkchat.engine.kernels.kda_commit import kda_commit

    gen = torch.Generator().manual_seed(0)
    # (layers, T, heads, head_dim, conv K, conv channels, conv dtype): conv rows under one block and
    # over several (the last one partial), bf16 and fp32 conv states
    for n, T, heads, d, K, C, dt in [(3, 4, 2, 16, 4, 96, torch.bfloat16), (2, 5, 3, 64, 4, 6144, torch.bfloat16),
                                     (2, 3, 2, 32, 3, 40, torch.float32)]:
        for last in range(-1, T):  # -1: the conv states put back (a dropped pipelined cycle)
            layers = _layers(n, T, heads, d, K, C, dt, device, gen)
            want = [_twin(*layer, last) for layer in layers]
            kept = [(s.clone(), w.clone()) for _, s, _, w in layers]
            # `last` from the host, or (odd ones) read on the device as the pipelined MTP loop passes it
            kda_commit(layers, torch.tensor([last], device=device) if last % 2 else last)
            for (rec, inputs, conv, window), (r_want, c_want), (s0, w0) in zip(layers, want, kept):
                err = ((rec - r_want).abs().max() / r_want.abs().max()).item()
                assert err < 1e-5 and torch.equal(conv, c_want), (n, T, last, err)
                assert torch.equal(inputs, s0) and torch.equal(window, w0)  # sources untouched
            # the same tensors again (a graph's kept inputs at its next replay): the cached launch
            again = T - 1 - max(last, 0)
            start = [rec.clone() for rec, *_ in layers]
            want = [_twin(r, s, c, w, again) for r, (_, s, c, w) in zip(start, layers)]
            kda_commit(layers, torch.tensor([again], device=device) if last % 2 == 0 else again)
            for (rec, _, conv, _), (r_want, c_want) in zip(layers, want):
                err = ((rec - r_want).abs().max() / r_want.abs().max()).item()
                assert err < 1e-5 and torch.equal(conv, c_want), (n, T, again, err)
    print("commit kernel ok")


def commit_equals_a_shorter_step(device: str, heads: int = 2, head_dim: int = 32) -> None:
    """kda_decode over T tokens keeping its inputs, then kda_commit(last): bit for bit the recurrent and
    conv states kda_decode leaves after the first last + 1 tokens alone (same block layout, same code)."""
    from sparkchat.engine.kernels.kda_commit import kda_commit
    from sparkchat.engine.kernels.kda_decode import kda_decode
    from tests.test_kda_kernel import make_inputs

    T = 4
    for safe in (True, False):
        x, (conv, rec), w = make_inputs(T, heads, head_dim, 4, torch.bfloat16, device, seed=5)
        for last in range(T):
            c1, r1 = conv.clone(), rec.clone()
            _, window, inputs = kda_decode(*x, c1, r1, *w, heads, head_dim, safe, -5.0, 1e-6, True, False)
            assert torch.equal(r1, rec)  # the verify left the state alone
            kda_commit([(r1, inputs, c1, window)], last)
            c2, r2 = conv.clone(), rec.clone()
            kda_decode(*(t[:last + 1] for t in x), c2, r2, *w, heads, head_dim, safe, -5.0, 1e-6, False, False)
            assert torch.equal(c1, c2), (safe, last)
            assert torch.equal(r1, r2), (safe, last, (r1 - r2).abs().max().item())
    print("commit exact ok")


def run_all(device: str) -> None:
    kernel_against_twin(device)
    commit_equals_a_shorter_step(device)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (its CPU interpreter runs these)")
def test_kda_commit_under_triton_interpreter():
    r = run_interpreted("from tests.test_kda_commit import run_all; run_all('cpu')")
    assert r.returncode == 0 and "commit kernel ok" in r.stdout and "commit exact ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(not GPU, reason="needs a CUDA device and triton")
def test_kda_commit_on_cuda():
    run_all("cuda")
    commit_equals_a_shorter_step("cuda", heads=32, head_dim=128)  # the real shape


def test_commit_gives_the_state_a_shorter_step_leaves(tmp_path):
    """A verify with kept inputs leaves every recurrent state alone; committing all its positions gives
    exactly the state the same step without kept inputs leaves, and committing an earlier position the
    state a shorter step leaves (to rounding: the projections then run over fewer rows)."""
    from sparkchat.engine.config import ModelConfig
    from sparkchat.engine.generate import Decoder
    from sparkchat.engine.loader import load_model
    from sparkchat.engine.state import ConversationState
    from tests.conftest import make_model_dir

    path = make_model_dir(tmp_path / "tiny", seed=3, mtp=False)
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, "cpu", torch.float32, 64)
    state = ConversationState.allocate(cfg, 64, "cpu", torch.float32)
    dec = Decoder(model, state)
    dec.forward(list(range(5, 20)))
    dec.commit(list(range(5, 20)))
    before = state.checkpoint()
    kda = lambda: {n: t for n, t in state.snapshot().items() if n.startswith("kda.")}
    start = kda()

    def step(ids, keep):
        state.restore(before)
        return dec.forward(ids, keep_steps=keep)[2]

    step([8, 9, 10, 11], False)
    after = kda()
    kept = step([8, 9, 10, 11], True)
    assert kept and all(s.inputs.shape == (4, cfg.num_attention_heads, 4, cfg.head_dim) for s in kept.values())
    assert all(torch.equal(t, start[n]) for n, t in kda().items() if n.endswith(".recurrent"))
    state.commit_kda(kept, 3)
    assert all(torch.equal(t, after[n]) for n, t in kda().items())

    kept = step([8, 9, 10, 11], True)
    state.commit_kda(kept, 1)
    got = kda()
    step([8, 9], False)
    for name, t in kda().items():
        assert torch.allclose(got[name], t, rtol=1e-5, atol=1e-6), name
        assert not torch.equal(t, after[name])

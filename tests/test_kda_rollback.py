"""A speculative step's KDA rollback: the one-launch kernel (kernels.kda_rollback) against its twin, the
per-layer copies in ConversationState.rollback_kda — under Triton's CPU interpreter and on CUDA — and the
skip at the step's last position, which must leave exactly what the copies would."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.interpreter import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = torch.cuda.is_available() and HAS_TRITON


def _layers(n: int, T: int, heads: int, d: int, K: int, C: int, conv_dtype, device, gen):
    out = []
    for _ in range(n):
        rec = torch.randn(heads, d, d, generator=gen).to(device)
        steps = torch.randn(T - 1, heads, d, d, generator=gen).to(device)
        conv = torch.randn(K - 1, C, generator=gen).to(conv_dtype).to(device)
        window = torch.randn(K - 1 + T, C, generator=gen).to(conv_dtype).to(device)
        out.append((rec, steps, conv, window))
    return out


def run_all(device: str) -> None:
    from sparkchat.engine.kernels.kda_rollback import kda_rollback

    gen = torch.Generator().manual_seed(0)
    # (layers, T, heads, head_dim, conv K, conv channels, conv dtype): states under one block and over
    # several (the last one partial), conv rows under and over one block, bf16 and fp32 conv states
    for n, T, heads, d, K, C, dt in [(3, 4, 2, 16, 4, 96, torch.bfloat16), (2, 5, 3, 64, 4, 6144, torch.bfloat16),
                                     (2, 3, 2, 32, 3, 40, torch.float32)]:
        for last in range(T - 1):
            layers = _layers(n, T, heads, d, K, C, dt, device, gen)
            want = [(s[last].clone(), w[last + 1:last + K].clone()) for _, s, _, w in layers]
            kept = [(s.clone(), w.clone()) for _, s, _, w in layers]
            kda_rollback(layers, last)
            for (rec, steps, conv, window), (r_want, c_want), (s0, w0) in zip(layers, want, kept):
                assert torch.equal(rec, r_want) and torch.equal(conv, c_want), (n, T, last)
                assert torch.equal(steps, s0) and torch.equal(window, w0)  # sources untouched
            # the same tensors again (a graph's kept steps at its next replay): the cached launch
            again = T - 2 - last
            kda_rollback(layers, again)
            for rec, steps, conv, window in layers:
                assert torch.equal(rec, steps[again]) and torch.equal(conv, window[again + 1:again + K]), (n, T, again)
    print("rollback kernel ok")


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (its CPU interpreter runs these)")
def test_kda_rollback_under_triton_interpreter():
    r = run_interpreted("from tests.test_kda_rollback import run_all; run_all('cpu')")
    assert r.returncode == 0 and "rollback kernel ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(not GPU, reason="needs a CUDA device and triton")
def test_kda_rollback_on_cuda():
    run_all("cuda")


def test_rollback_to_the_last_position_moves_nothing(tmp_path):
    """A verify keeps the states after all its positions but the last: after the last one the state is
    the layer's own, which the verify leaves in place, so rolling back to it moves nothing — and it is
    the state a step without kept states leaves. Rolling back to an earlier position copies that
    position's kept state, the state a shorter step leaves."""
    from sparkchat.engine.loader import load_model
    from sparkchat.engine.config import ModelConfig
    from sparkchat.engine.generate import Decoder
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

    def step(ids, keep):
        state.restore(before)
        return dec.forward(ids, keep_steps=keep)[2]

    kept = step([8, 9, 10, 11], True)
    assert kept and all(s.recurrent.shape[0] == 3 and s.window.shape[0] == 3 + 4 for s in kept.values())
    after = kda()
    state.rollback_kda(kept, 3)
    assert all(torch.equal(t, after[n]) for n, t in kda().items())
    step([8, 9, 10, 11], False)
    assert all(torch.equal(t, after[n]) for n, t in kda().items())

    kept = step([8, 9, 10, 11], True)
    want = {}
    for i, s in kept.items():
        want[f"kda.{i}.recurrent"] = s.recurrent[1].clone()
        want[f"kda.{i}.conv"] = s.window[2:2 + state.kda[i].conv.shape[0]].clone()
    state.rollback_kda(kept, 1)
    got = kda()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
        assert not torch.equal(t, after[name])
    step([8, 9], False)
    for name, t in kda().items():
        assert torch.allclose(got[name], t, rtol=1e-5, atol=1e-6), name

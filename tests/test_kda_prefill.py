"""A prompt's KDA layer through fla-core's chunked kernels (kernels/kda_prefill.py, SPARKCHAT_FLA_PREFILL=1)
against the torch chunked form it replaces on the GPU (nn.kda.kda_chunked). Skipped without CUDA or
without fla-core."""

from __future__ import annotations

import pytest
import torch

from sparkchat.engine.kernels.kda_prefill import fla_chunk_kda

def _fla_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("fla") is not None


pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not _fla_installed(),
                                reason="needs a CUDA device and fla-core")


def _prefill(T: int, safe: bool, fla: bool, monkeypatch, seed: int = 0):
    from sparkchat.engine.nn.kda import kda_core
    from tests.test_kda_kernel import make_inputs

    monkeypatch.setenv("SPARKCHAT_FLA_PREFILL", "1" if fla else "0")
    heads, d = 4, 128
    x, (conv, rec), w = make_inputs(T, heads, d, 4, torch.bfloat16, "cuda", seed=seed)
    o, window, _ = kda_core(*x, conv, rec, *w, heads, d, safe, -5.0 if safe else 5.0, 1e-6, False, True)
    return o.float(), rec, conv


@pytest.mark.parametrize("T", [37, 300, 2048])
@pytest.mark.parametrize("safe", [True, False])
def test_fla_prefill_matches_the_torch_form(T, safe, monkeypatch):
    o1, s1, c1 = _prefill(T, safe, False, monkeypatch)
    o2, s2, c2 = _prefill(T, safe, True, monkeypatch)
    assert fla_chunk_kda() is not None, "fla-core's kernels failed here and were turned off"
    assert not torch.equal(o1, o2)  # two implementations: roundings differ somewhere
    assert torch.equal(c1, c2)  # the conv state is ours either way
    state_err = ((s2 - s1).abs().max() / s1.abs().max()).item()
    out_err = ((o2 - o1).abs().max() / o1.abs().max()).item()
    assert state_err < 2e-2 and out_err < 3e-2, (state_err, out_err)
    # and it is the prompt that decides: another prompt's state is far off
    _, s3, _ = _prefill(T, safe, True, monkeypatch, seed=1)
    assert ((s3 - s1).abs().max() / s1.abs().max()).item() > 0.1


def test_warm_up_readies_the_kernels_at_lings_shape(monkeypatch):
    """Engine.load's warm-up: on by default with fla-core installed, at the model's KDA shape; off with
    SPARKCHAT_FLA_PREFILL=0 or a head size fla's tiles are not built for."""
    from sparkchat.engine.kernels.kda_prefill import WARM_UP_STAGE, warm_up

    dev = torch.device("cuda")
    monkeypatch.delenv("SPARKCHAT_FLA_PREFILL", raising=False)
    said: list[str] = []
    assert warm_up(32, 128, dev, torch.bfloat16, said.append)
    assert said == [WARM_UP_STAGE]
    assert not warm_up(32, 8, dev, torch.bfloat16)
    monkeypatch.setenv("SPARKCHAT_FLA_PREFILL", "0")
    assert not warm_up(32, 128, dev, torch.bfloat16)

"""engine/sampling.py: sampling values the engine cannot use are one clear SamplingError (a SparkchatError and
a ValueError), raised before any token is computed, never torch's Overflow or a NaN probability tensor."""

from __future__ import annotations

import math

import pytest
import torch

from sparkchat.engine.errors import SparkchatError
from sparkchat.engine.events import SamplingParams
from sparkchat.engine.events import MAX_SEED
from sparkchat.engine.sampling import SamplingError, check_sampling, make_generator, sample


@pytest.mark.parametrize("params, needle", [
    (SamplingParams(temperature=1.0, seed=99999999999999999999999), "seed must be from 0 to 2**64 - 1"),
    (SamplingParams(temperature=1.0, seed=MAX_SEED + 1), "seed must be"),
    (SamplingParams(temperature=1.0, seed=-1), "seed must be from 0 to"),
    (SamplingParams(temperature=math.nan), "temperature must be a finite number, got nan"),
    (SamplingParams(temperature=math.inf), "temperature"),
    (SamplingParams(temperature=1.0, top_p=math.nan), "top-p must be a finite number, got nan"),
    (SamplingParams(temperature=1.0, top_p=math.inf), "top-p"),
])
def test_bad_values_are_one_clear_error(params, needle):
    with pytest.raises(SamplingError) as e:
        make_generator(params, "cpu")  # where generation starts: before the prefill
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, SparkchatError) and isinstance(e.value, ValueError)


def test_the_whole_seed_range_works():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    for seed in (0, 2**63, MAX_SEED):
        p = check_sampling(SamplingParams(temperature=1.0, seed=seed))
        a, b = sample(logits, p, make_generator(p, "cpu")), sample(logits, p, make_generator(p, "cpu"))
        assert a.item() == b.item()  # same seed, same draw


def test_engine_refuses_before_answering(tiny_model_dir):
    from sparkchat.engine.session import Engine

    engine = Engine.load(tiny_model_dir, device="cpu", max_context=64)
    engine.switches.mtp = False
    for bad in (SamplingParams(temperature=math.nan, max_tokens=2), SamplingParams(temperature=1.0, seed=10**23)):
        with pytest.raises(SamplingError):
            list(engine.generate([{"role": "user", "content": "hi"}], bad))
    ok = list(engine.generate([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2)))
    assert ok[-1].finish_reason in ("stop", "length")

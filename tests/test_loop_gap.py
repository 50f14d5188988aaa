"""The MTP loop's GPU gap (Decoder.host_gap): from the previous queued verify's end to a draft chain's
start, measured with two end events taken in turn — checked here with events on a fake clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparkchat.engine.generate import Decoder


class ClockEvent:
    """A CUDA event's record/elapsed_time on a clock the test moves."""

    clock = 0.0

    def __init__(self) -> None:
        self.at: float | None = None

    def record(self) -> None:
        self.at = ClockEvent.clock

    def elapsed_time(self, later: "ClockEvent") -> float:  # milliseconds, as torch.cuda.Event's
        assert self.at is not None and later.at is not None
        return later.at - self.at


def test_the_gap_runs_from_the_last_queued_verify_to_the_next_chain():
    model = SimpleNamespace(embed=SimpleNamespace(device=torch.device("cpu")))
    dec = Decoder(model, SimpleNamespace(), graphs=None)
    dec._marks = [ClockEvent(), ClockEvent()]
    dec._ends = [ClockEvent(), ClockEvent()]

    def cycle(start: float, verify_end: float) -> float:
        ClockEvent.clock = start
        dec._chain_starts()
        dec._last_end = None  # what forward() does: only _verify_queued leaves an end
        ClockEvent.clock = verify_end
        dec._verify_queued()
        return dec.host_gap()

    assert cycle(0.0, 4.4) == 0.0  # the first cycle follows no queued verify
    assert cycle(4.8, 9.2) == pytest.approx(0.4 / 1000)
    assert cycle(9.5, 13.9) == pytest.approx(0.3 / 1000)  # the other end event: the first is not overwritten
    dec._last_end = None  # a plain decode step in between (forward)
    assert cycle(20.0, 24.0) == 0.0
    assert cycle(24.25, 28.0) == pytest.approx(0.25 / 1000)


def test_no_gap_is_measured_off_a_gpu():
    model = SimpleNamespace(embed=SimpleNamespace(device=torch.device("cpu")))
    dec = Decoder(model, SimpleNamespace(), graphs=None)
    dec._marks, dec._ends = [], []
    dec._chain_starts()
    dec._verify_queued()
    assert dec.host_gap() == 0.0

"""Running independent work of one step side by side on a second CUDA stream.

A MoE layer's shared expert depends only on the layer input, as do the router and the routed experts'
first stage: on a side stream its two short GEMVs overlap them instead of adding their launch and
latency to the chain. Works eagerly and under CUDA graph capture (the fork and join become edges).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

R = TypeVar("R")


def fork(side: torch.cuda.Stream, fn: Callable[..., R], *args) -> tuple[R, Callable[[], None]]:
    """Start fn(*args) on `side` after everything queued so far on the current stream; returns its
    result and `join`, which makes the current stream wait for it (call before reading the result).

    Memory stays safe without record_stream: the side stream's next use starts with a fork, i.e. after
    everything the current stream had queued by then, including the reads of this result; and `join`
    holds fn's arguments (and what they hold) until it is dropped, so that nothing the side stream may
    still read is freed for the current stream to reuse before it has waited."""
    main = torch.cuda.current_stream(side.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn(*args)

    def join(_inputs=args) -> None:
        main.wait_stream(side)

    return out, join

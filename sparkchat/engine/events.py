"""What generation yields: sampling parameters in, response events with stats out.

The CLI, the terminal app and the server consume these and nothing below them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    max_tokens: int = 512
    ignore_eos: bool = False  # keep going past stop tokens (benchmarks, tests on random models)


@dataclass
class Switches:
    """The engine's optimizations, switchable between two answers without reloading weights."""

    mtp: bool = True
    draft_steps: int = 3
    fp8_head: bool = True
    mxfp4_kernels: bool = True
    cuda_graphs: bool = True


@dataclass
class SwitchState:
    on: bool
    available: bool
    reason: str | None = None  # why it is unavailable


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens actually run (the rest came from the kept state)
    generated_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_tok_s: float = 0.0
    prefill_tok_s: float = 0.0
    tpot_ms: float = 0.0
    # speculative decoding
    accept_length_mean: float | None = None
    accept_length_last: int | None = None
    accept_rate_per_position: list[float] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    verify_decode_ratio: float | None = None
    switches: dict[str, Any] = field(default_factory=dict)
    peak_memory_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ResponseEvent:
    text: str  # the text added by this event (never half a UTF-8 character)
    token_ids: list[int]  # the tokens added by this event
    finish_reason: str | None  # None while streaming; then "stop", "length" or "cancelled"
    stats: GenerationStats

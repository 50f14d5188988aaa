"""What generation yields: sampling parameters in, response events with stats out.

The CLI, the terminal app and the server consume these and nothing below them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from sparkchat.engine.draft_vocab import DEFAULT_DRAFT_VOCAB

# The one range check of sampling values (CLI flags, the app's settings form, settings.toml):
# field -> (what the user calls it, rule, test of a value).
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits

SAMPLING_RULES: dict[str, tuple[str, str, Any]] = {
    "temperature": ("temperature", "must be 0 (greedy) or more", lambda v: v >= 0),
    "top_p": ("top-p", "must be in (0, 1]", lambda v: 0 < v <= 1),
    "top_k": ("top-k", "must be 0 (no cut) or more", lambda v: v >= 0),
    "max_tokens": ("max tokens", "must be at least 1", lambda v: v >= 1),
    "seed": ("seed", "must be from 0 to 2**64 - 1", lambda v: 0 <= v <= MAX_SEED),
}


def sampling_problem(name: str, value: Any) -> str | None:
    """What is wrong with one sampling value ("must be in (0, 1]"); None when it is allowed."""
    rule = SAMPLING_RULES.get(name)
    if rule is None or value is None:  # seed None: a fresh seed each answer
        return None
    if isinstance(value, float) and not math.isfinite(value):  # NaN passes no comparison: say why first
        return "must be a finite number"
    return None if rule[2](value) else rule[1]


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    max_tokens: int = 512
    ignore_eos: bool = False  # keep going past stop tokens (benchmarks, tests on random models)

    def validate(self, *, flags: bool = False) -> SamplingParams:
        """Raise ValueError, one line, for the first value out of range; values are named as a user
        sees them ("top-p"), or as command-line flags ("--top-p") with `flags`. Returns self."""
        for name in SAMPLING_RULES:
            value = getattr(self, name)
            problem = sampling_problem(name, value)
            if problem:
                label = "--" + name.replace("_", "-") if flags else SAMPLING_RULES[name][0]
                raise ValueError(f"{label} {problem}, got {value}")
        return self


@dataclass
class Switches:
    """The engine's optimizations, switchable between two answers without reloading weights."""

    mtp: bool = True
    draft_steps: int = 3
    fp8_head: bool = True
    mxfp4_kernels: bool = True
    cuda_graphs: bool = True
    # MTP drafts through the head's rows of the `draft_vocab` most frequent tokens only (the verify
    # keeps the full head, so output does not change; see engine/draft_vocab.py)
    truncated_draft_head: bool = True
    draft_vocab: int = DEFAULT_DRAFT_VOCAB


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
    # queued MTP cycles on a GPU: the time between a verify's end and the next draft chain's start, summed
    # (the host's acceptance, KDA commit, the chain's inputs and launch; Decoder.host_gap)
    host_gap_s: float = 0.0
    verify_decode_ratio: float | None = None
    switches: dict[str, Any] = field(default_factory=dict)
    peak_memory_bytes: int = 0
    # why it is as fast as it is: the bytes a plain decode step reads with the switches in use, and the
    # read bandwidth measured here; their ratio is the fastest plain decoding can go (speculation beats it)
    bytes_per_token: int = 0
    read_bw_bytes_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ResponseEvent:
    text: str  # the text added by this event (never half a UTF-8 character)
    token_ids: list[int]  # the tokens added by this event
    finish_reason: str | None  # None while streaming; then "stop", "length" or "cancelled"
    stats: GenerationStats

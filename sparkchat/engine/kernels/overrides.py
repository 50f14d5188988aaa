"""Kernel config fields from an environment variable, for timing configs where they run (the graphed
step, through benchmarks/profile_step.py --switch NAME=V1,V2): items `<key>.<field>:<value>` joined by
`/` (profile_step lists values with commas), the key naming the call shape they apply to; and the
kernel switches read by more than one kernel module (tail_at_once, weight_eviction)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from sparkchat.engine.kernels.device import is_sm90


def field_overrides(variable: str, config_cls: type, key: str, key_ok: Callable[[str], bool],
                    key_form: str) -> dict:
    """The fields of dataclass `config_cls` that `variable`'s items give for `key` (ints; 0/1 for bools);
    {} when it is unset or "0". An item whose key fails `key_ok` (the form `key_form`), whose field is
    not one of the class's, or whose value is not a number raises ValueError naming the variable."""
    spec = os.environ.get(variable, "0")
    if spec in ("", "0"):
        return {}
    types = {f.name: f.type for f in dataclasses.fields(config_cls)}
    out: dict = {}
    for item in spec.split("/"):
        item_key, _, setting = item.rpartition(".")
        name, _, value = setting.partition(":")
        if not key_ok(item_key) or name not in types or not value.isdigit():
            raise ValueError(f"{variable}: {item!r} is not {key_form}.<field>:<value> "
                             f"(fields: {', '.join(types)})")
        if item_key == key:
            out[name] = bool(int(value)) if types[name] in (bool, "bool") else int(value)
    return out


def tail_at_once() -> int:
    """SPARKCHAT_TAIL_AT_ONCE, bits: which of a verify window's serial tails take all its tokens at once,
    every load before any store, instead of one token after another — 2: MoE stage 2's sum of the slots
    (mxfp4_moe._sum_slots); 4: KDA's gated output norm, run by each head's last program
    (kda_decode_kernel). One token after another, each token's loads wait for the stores before them
    (the compiler cannot move a load above a store that may alias it): T trips to L2 where one would do.
    Both on by default (6): the H100's graphed 4-token verify 4.338 -> 4.247 ms (medians of 6 rounds,
    docs/benchmarks.md session 30), outputs bit for bit the same. (Bit 1 did the same for the output
    projection's fused add+norm and its norm: slower in the verify, 16.0 -> 18.9 µs exposed a call, and
    removed.)"""
    return int(os.environ.get("SPARKCHAT_TAIL_AT_ONCE", "6"))


def weight_eviction(kind: int, device: torch.device | None = None) -> str:
    """The L2 eviction hint for one kind of weight stream on `device` (tl.load's eviction_policy):
    "evict_first" when bit `kind` of SPARKCHAT_WEIGHT_EVICT is set, else "" (the default policy). Bits:
    - 1: the one-token MoE stages' expert weights and scales (routed and shared);
    - 2: the FMA GEMVs' weights (the FP8 linears and head, the router's BF16 logits);
    - 4: the MoE stages of multi-token windows (a verify): slots sharing an expert (real routing repeats
      experts between neighbouring tokens) re-read its lines from L2, which the hint would drop first.
    Unset: 1 and 2 on sm_90 GPUs (the H100 and H200), none elsewhere. Weights are read once a step, so
    marking them first out keeps L2 for what is read again: the paced L2 prefetch's lines (router.route's
    `l2_prefetch`, sm_90 only), partial sums, activations. The H100's graphed step 2.448 -> 2.396 ms, the
    logits bit for bit the same (docs/benchmarks.md session 36); the DGX Spark (sm_121) stays off until
    measured there. Not the verify windows' tensor-core GEMV: Triton's pipeliner turns its weight loads
    into cp.async and drops the hint (Triton 3.6, sm_90 PTX)."""
    value = os.environ.get("SPARKCHAT_WEIGHT_EVICT")
    if value is None:
        bits = DEFAULT_WEIGHT_EVICT if device is not None and is_sm90(torch.device(device)) else 0
    else:
        bits = int(value) if value.isdigit() else 0
    return "evict_first" if bits & kind else ""


DEFAULT_WEIGHT_EVICT = 3  # not 4: timed only with random routing, which repeats no expert

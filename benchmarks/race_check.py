"""Look for a race in the graphed decode step: the same step replayed many times from one saved state,
each answer compared with the switches-off path's, per switch (full Ling-3.0-flash-fp4 shapes, synthetic
weights). A race shows as replays that answer differently from each other,
some far from the off path's answer (or an argmax flipped).

    python benchmarks/race_check.py [--replays N] [--tokens 1,4] --switch A=1 --switch "A=1+B=2" ...
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.profile_step import fast_synthetic, graph_step_ms, logits_agreement
from sparkchat.engine import fastpath
from sparkchat.engine.generate import Decoder
from sparkchat.engine.graphs import StepGraphs


def replay_answers(model, state, tokens: int, replays: int, start) -> list[torch.Tensor]:
    """The graphed step's logits [tokens, V], replayed `replays` times from `start`, one capture."""
    decoder = Decoder(model, state, StepGraphs(model, state))
    answers = []
    for _ in range(replays):
        state.restore(start)
        state.token_ids = [0] * 1024
        _, logits, _ = decoder.forward(list(range(1, tokens + 1)), keep_steps=tokens > 1)
        answers.append(logits.float().clone())
    state.restore(start)
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--switch", action="append", default=[], help="NAME=VALUE or A=1+B=2 (set together)")
    parser.add_argument("--replays", type=int, default=8)
    parser.add_argument("--tokens", default="1,4")
    parser.add_argument("--start-after", default=None, metavar="SPEC",
                        help="take the saved state after SPEC's graphed step and verify were replayed (as "
                             "profile_step --switch does for its first variant); 'off' for the switches off")
    args = parser.parse_args()
    windows = [int(t) for t in args.tokens.split(",")]
    model, state = fast_synthetic(None, 2048)
    variants = [dict(p.partition("=")[::2] for p in spec.split("+")) for spec in args.switch]
    names = sorted({n for v in variants for n in v})
    off = {n: "0" for n in names}
    if args.start_after:
        os.environ.update(off)
        if args.start_after != "off":
            os.environ.update(dict(p.partition("=")[::2] for p in args.start_after.split("+")))
        fastpath.install(model, linears=True, experts=True, head=True)
        print(f"start after {args.start_after}: step {graph_step_ms(model, state):.3f} ms, "
              f"verify {graph_step_ms(model, state, tokens=4):.3f} ms", flush=True)
    state.token_ids = [0] * 1024
    start = state.checkpoint()
    os.environ.update(off)
    fastpath.install(model, linears=True, experts=True, head=True)
    reference = {t: replay_answers(model, state, t, 1, start)[0] for t in windows}
    for spec, variant in zip(["off", *args.switch], [off, *variants]):
        os.environ.update(off)
        os.environ.update(variant)
        fastpath.install(model, linears=True, experts=True, head=True)
        for t in windows:
            answers = replay_answers(model, state, t, args.replays, start)
            distinct = []  # the replays' different answers: one when the step is deterministic
            for a in answers:
                if not any(torch.equal(a, d) for d in distinct):
                    distinct.append(a)
            print(f"{spec} · {t} tokens: {len(distinct)} distinct answer(s) in {args.replays} replays", flush=True)
            for d in distinct[:4]:
                print(f"    against off: {logits_agreement(d, reference[t])}", flush=True)


if __name__ == "__main__":
    main()

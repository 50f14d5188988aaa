"""Look for a race in the graphed decode step: the same step replayed many times from one saved state,
each answer compared with the switches-off path's, per switch (full Ling-3.0-flash-fp4 shapes, synthetic
weights). A race shows as replays that answer differently from each other,
some far from the off path's answer (or an argmax flipped).

    python benchmarks/race_check.py [--replays N] [--tokens 1,4] [--start-after SPEC] [--routes]
                                    --switch A=1 --switch "A=1+B=2" ...

With --routes it also records every MoE layer's expert ids in the last replay and names the first layer
whose choice differs from the switches-off path's, with how close off's 8th and 9th expert scores were
there: a path that rounds differently (not bit for bit) can flip a near-tie, and on random synthetic
weights one flipped expert moves the logits far.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the checkout

from benchmarks.profile_step import fast_synthetic, graph_step_ms, logits_agreement  # noqa: E402
from sparkchat.engine import fastpath  # noqa: E402
from sparkchat.engine.generate import Decoder  # noqa: E402
from sparkchat.engine.graphs import StepGraphs  # noqa: E402


def replay_answers(model, state, tokens: int, replays: int, start,
                   routes: list | None = None) -> list[torch.Tensor]:
    """The graphed step's logits [tokens, V], replayed `replays` times from `start`, one capture.
    routes: filled with (router input, expert ids) per MoE layer as the last replay left them."""
    from sparkchat.engine.nn.ops import ops

    inner, calls = ops.route, []
    if routes is not None:
        def recording(x, *args):  # graph-safe: keeps references, the captured tensors refill each replay
            ids, weights = inner(x, *args)
            calls.append((x, ids, args))
            return ids, weights
        ops.route = recording
    try:
        decoder = Decoder(model, state, StepGraphs(model, state))
        answers = []
        for _ in range(replays):
            state.restore(start)
            state.token_ids = [0] * 1024
            _, logits, _ = decoder.forward(list(range(1, tokens + 1)), keep_steps=tokens > 1)
            answers.append(logits.float().clone())
    finally:
        ops.route = inner
    if routes is not None:
        last = {id(args[0]): (x, ids, args) for x, ids, args in calls}  # each router's last call: the capture's
        gates = [layer.mlp.gate for layer in model.layers if hasattr(layer.mlp, "gate")]
        routes[:] = [(x.float().clone(), ids.clone(), args)
                     for x, ids, args in (last[id(g.weight)] for g in gates if id(g.weight) in last)]
    state.restore(start)
    return answers


def first_route_change(routes: list, off_routes: list) -> str:
    """The first MoE layer whose chosen experts differ from off's, and off's score gap there."""
    for layer, ((_, ids, _), (x, off_ids, args)) in enumerate(zip(routes, off_routes)):
        if set(ids.flatten().tolist()) != set(off_ids.flatten().tolist()):
            weight, bias, k = args[0], args[1], args[4]
            scores = (torch.sigmoid(x @ weight.float().T) + bias.float()).flatten().sort(descending=True).values
            return (f"MoE layer {layer} of {len(routes)} chose other experts; off's 8th and 9th scores there "
                    f"{scores[k - 1].item():.6f} and {scores[k].item():.6f} (a gap of {(scores[k - 1] - scores[k]).item():.2e})")
    return f"the same experts in all {len(routes)} MoE layers"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--switch", action="append", default=[], help="NAME=VALUE or A=1+B=2 (set together)")
    parser.add_argument("--replays", type=int, default=8)
    parser.add_argument("--tokens", default="1,4")
    parser.add_argument("--start-after", default=None, metavar="SPEC",
                        help="take the saved state after SPEC's graphed step and verify were replayed (as "
                             "profile_step --switch does for its first variant); 'off' for the switches off")
    parser.add_argument("--routes", action="store_true", help="compare each MoE layer's experts with off's")
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
    off_routes = {t: [] if args.routes else None for t in windows}
    reference = {t: replay_answers(model, state, t, 1, start, off_routes[t])[0] for t in windows}
    for spec, variant in zip(["off", *args.switch], [off, *variants]):
        os.environ.update(off)
        os.environ.update(variant)
        fastpath.install(model, linears=True, experts=True, head=True)
        for t in windows:
            routes = [] if args.routes else None
            answers = replay_answers(model, state, t, args.replays, start, routes)
            distinct = []  # the replays' different answers: one when the step is deterministic
            for a in answers:
                if not any(torch.equal(a, d) for d in distinct):
                    distinct.append(a)
            print(f"{spec} · {t} tokens: {len(distinct)} distinct answer(s) in {args.replays} replays", flush=True)
            for d in distinct[:4]:
                print(f"    against off: {logits_agreement(d, reference[t])}", flush=True)
            if routes is not None:
                print(f"    routes: {first_route_change(routes, off_routes[t])}", flush=True)


if __name__ == "__main__":
    main()

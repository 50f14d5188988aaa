"""Time to first token for a prompt, as `generate_tokens` spends it: the prompt through every layer, then
the head for the next token's logits. Full-shape synthetic Ling-3.0-flash-fp4 on one GPU, every kernel
installed, FP8 head.

    python benchmarks/prefill_ttft.py [--lengths 2048 8192] [--continue-at 4096] [--switch NAME]

For each length: a fresh conversation, the prompt from position 0 (median of 3 after a warm-up prompt),
then (with --continue-at N) the same prompt after N tokens already in the cache: a second turn's prefill,
which attends to the earlier rows too. With --switch NAME each measurement is taken with the environment
switch NAME on (1) and off (0), alternated in one process (the kernels re-installed each time). Runs on
trees without `Decoder.forward(last_logits=)` as well (they compute the logits of every prompt token), so
an older checkout can be timed the same way.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_step import fast_synthetic  # noqa: E402

from sparkchat.engine import fastpath  # noqa: E402
from sparkchat.engine.generate import Decoder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--continue-at", type=int, default=0)
    ap.add_argument("--switch", default=None, help="alternate this environment switch 1/0")
    args = ap.parse_args()
    context = max(args.lengths) + args.continue_at + 64
    model, state = fast_synthetic(None, context)
    last = "last_logits" in inspect.signature(Decoder.forward).parameters
    print(f"{torch.cuda.get_device_name()}; Decoder.forward(last_logits=) {'used' if last else 'absent (every row)'}",
          flush=True)
    extra = {"last_logits": True} if last else {}

    def prefill(ids: list[int], before: int) -> float:
        state.reset()
        if before:
            Decoder(model, state).forward([5] * before, **extra)
            state.token_ids = [5] * before
        torch.cuda.synchronize()
        t = time.perf_counter()
        _, logits, _ = Decoder(model, state).forward(ids, **extra)
        int(logits[-1].argmax())  # the first token, on the host
        return time.perf_counter() - t

    def setting(value: str | None) -> str:
        if value is None:
            return ""
        os.environ[args.switch] = value
        fastpath.install(model, linears=True, experts=True, head=True)
        return f" {args.switch}={value}"

    prefill([7] * 64, 0)  # compiles (fla-core's prompt kernels, the torch ops) before anything is timed
    for n in args.lengths:
        ids = [(7 * i) % 1000 + 5 for i in range(n)]
        for before in (0, args.continue_at) if args.continue_at else (0,):
            for value in ("1", "0") if args.switch else (None,):
                label = setting(value)
                prefill(ids, before)
                times = [prefill(ids, before) for _ in range(3)]
                s = statistics.median(times)
                print(f"  {n:6d} tokens after {before:5d}{label}: {1000 * s:8.1f} ms to the first token "
                      f"({1000 * s / n:.4f} ms a prompt token; runs {', '.join(f'{1000 * t:.1f}' for t in times)})",
                      flush=True)


if __name__ == "__main__":
    main()

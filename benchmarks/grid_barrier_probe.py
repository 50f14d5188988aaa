"""What a kernel boundary costs against a grid-wide barrier inside one persistent kernel (H200 probe).

A decode step is ~470 dependent kernels; inserting one more no-op PDL kernel after each add+norm cost
1.86 µs apiece (docs/benchmarks.md, session 12). A persistent kernel would replace each boundary with
a grid barrier: every program arrives on a counter, then spins until all have. This probe times both
with the same grid (programs_per_sm programs of one warp on every SM, all resident at once):

- `launches`: N dependent launches of a kernel whose programs each load one value the previous
  launch wrote and store one, captured in a CUDA graph — with programmatic dependent launch (as the
  engine's kernels run) and without;
- `barrier`: one launch whose programs do the same load and store N times, a grid barrier between
  rounds (an acq_rel arrival on a monotone counter, a spin on volatile loads until it reaches the
  round's target, then one acquire).

    python benchmarks/grid_barrier_probe.py [--rounds N] [--programs-per-sm P]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_kernels import graph_us  # noqa: E402
from sparkchat.engine.kernels.pdl import pdl_args, pdl_wait  # noqa: E402


@triton.jit
def hop_kernel(src_ptr, dst_ptr, PDL: tl.constexpr = False):
    """One boundary's worth of work: read what the previous launch wrote, write for the next one."""
    pdl_wait(PDL)
    p = tl.program_id(0)
    tl.store(dst_ptr + p, tl.load(src_ptr + p) + 1.0)


@triton.jit
def barrier_kernel(buf_ptr, cnt_ptr, ROUNDS: tl.constexpr, NP: tl.constexpr):
    """ROUNDS hops in one launch: each round reads its slot of one buffer half, writes the other's,
    then waits at a grid barrier (all NP programs resident, so the spin always ends)."""
    p = tl.program_id(0)
    for r in range(ROUNDS):
        src = buf_ptr + (r % 2) * NP
        dst = buf_ptr + ((r + 1) % 2) * NP
        tl.store(dst + p, tl.load(src + (p + 1) % NP, volatile=True) + 1.0)  # a neighbour's value
        tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        target = (r + 1) * NP
        while tl.load(cnt_ptr, volatile=True) < target:  # spin on plain loads (L2), not atomics
            pass
        tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")  # then one acquire: the others' writes visible


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--programs-per-sm", type=int, default=4)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for per_sm in sorted({1, args.programs_per_sm}):
        n = sms * per_sm
        bufs = [torch.zeros(n, device="cuda") for _ in range(2)]

        def launches(pdl: bool) -> None:
            extra = pdl_args("cuda") if pdl else {}
            for r in range(args.rounds):
                hop_kernel[(n,)](bufs[r % 2], bufs[(r + 1) % 2], num_warps=1, **extra)

        buf = torch.zeros(2 * n, device="cuda")
        cnt = torch.zeros(1, dtype=torch.int32, device="cuda")

        def barrier() -> None:
            cnt.zero_()
            barrier_kernel[(n,)](buf, cnt, ROUNDS=args.rounds, NP=n, num_warps=1)

        for name, fn in (("launches, PDL", lambda: launches(True)), ("launches, no PDL", lambda: launches(False)),
                         ("one kernel, grid barriers", barrier)):
            us = graph_us([fn])  # the whole fn (all its rounds) replayed in a CUDA graph
            print(f"{n} programs ({per_sm} an SM), {args.rounds} rounds, {name}: "
                  f"{us / args.rounds:.2f} µs a round", flush=True)


if __name__ == "__main__":
    main()

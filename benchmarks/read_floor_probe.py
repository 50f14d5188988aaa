"""What a launch that only reads can reach, by size: the ceiling under the weight-streaming kernels.

    python benchmarks/read_floor_probe.py [--json out.json]

For each size the decode step's kernels stream (2 MB: the shared expert's down projection … 403 MB:
the FP8 head), a Triton kernel reads the bytes once (16-byte loads, STEPS independent blocks a program,
a sum stored per program so the loads stay) under several shapes, and torch's `sum` does too; the best
time per size is printed with its share of the 4 GiB read bandwidth (bench_kernels.measure_read_bw).
Every figure is the median replay of a CUDA graph of calls over rotating buffers (≥ 256 MB in all, so
each call reads HBM, not L2), divided by the calls. Last, the one-token MoE's two stages as two plain
reads back to back (16.7 MB, then 8.4 MB), with and without programmatic dependent launch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import graph_us, measure_read_bw  # noqa: E402

from sparkchat.engine.kernels.pdl import pdl_args, pdl_wait  # noqa: E402

# bytes a launch streams in the one-token step (docs/benchmarks.md): shared expert down and gate|up, the
# output projection, the one-token MoE's stage 1 and both stages, the KDA projection, the 4-token MoE,
# the FP8 head
SIZES_MB = (2.0, 3.9, 10.5, 16.7, 25.3, 52.5, 101.2, 403.0)
CONFIGS = [(block, steps, warps) for block in (1024, 2048, 4096) for steps in (1, 2, 4, 8) for warps in (4, 8)
           if block * steps <= 16384]


@triton.jit
def stream_read_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr = False):
    """Program p sums int32 words [p*BLOCK*STEPS, (p+1)*BLOCK*STEPS): its STEPS loads are independent
    (all in flight at once), the sum only keeps them from being dead code."""
    p = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for s in tl.static_range(STEPS):
        i = (p * STEPS + s) * BLOCK + offs
        acc += tl.load(src_ptr + i, mask=i < n, other=0)
    pdl_wait(PDL)  # the weights-before-the-wait shape of the engine's kernels
    tl.store(out_ptr + p, tl.sum(acc, axis=0))


def launch(buf: torch.Tensor, out: torch.Tensor, cfg: tuple[int, int, int], pdl: bool = True) -> None:
    """One read of buf with config (block words, steps, warps)."""
    block, steps, warps = cfg
    n = buf.numel()
    stream_read_kernel[(triton.cdiv(n, block * steps),)](buf, out, n, BLOCK=block, STEPS=steps, num_warps=warps,
                                                         **(pdl_args(buf.device) if pdl else {}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bw = measure_read_bw()["read_GBps"]
    print(f"read bandwidth (4 GiB sum) {bw:.0f} GB/s", flush=True)
    out = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    rows = []
    for mb in SIZES_MB:
        n = int(mb * 1e6) // 4 // 4096 * 4096  # whole 16-byte vectors: the loads vectorize
        copies = max(2, int(256 / mb) + 1)
        bufs = [torch.randint(0, 1 << 30, (n,), dtype=torch.int32, device="cuda") for _ in range(copies)]
        times = {cfg: graph_us([lambda b=b, cfg=cfg: launch(b, out, cfg) for b in bufs]) for cfg in CONFIGS}
        (block, steps, warps), best = min(times.items(), key=lambda kv: kv[1])
        t_sum = graph_us([lambda b=b: b.sum() for b in bufs])
        gbps = n * 4 / best / 1e3
        row = {"MB": mb, "best_us": round(best, 2), "GBps": round(gbps), "pct_read_bw": round(100 * gbps / bw, 1),
               "config": {"block_words": block, "steps": steps, "warps": warps},
               "torch_sum_us": round(t_sum, 2), "torch_sum_pct": round(100 * n * 4 / t_sum / 1e3 / bw, 1)}
        rows.append(row)
        print(f"  {mb:7.1f} MB  best {best:8.2f} us  {gbps:6.0f} GB/s  {row['pct_read_bw']:5.1f} %  "
              f"(block {block}, steps {steps}, warps {warps})   torch sum {t_sum:8.2f} us  {row['torch_sum_pct']:5.1f} %",
              flush=True)
        del bufs
    # the two stages of the one-token MoE as plain reads: stage 1's bytes, then stage 2's
    pairs = []
    for pdl in (True, False):
        n1, n2 = int(16.7e6) // 4 // 4096 * 4096, int(8.4e6) // 4 // 4096 * 4096
        copies = 10
        b1 = [torch.randint(0, 1 << 30, (n1,), dtype=torch.int32, device="cuda") for _ in range(copies)]
        b2 = [torch.randint(0, 1 << 30, (n2,), dtype=torch.int32, device="cuda") for _ in range(copies)]
        best = min(graph_us([lambda i=i, c=c: (launch(b1[i], out, c, pdl), launch(b2[i], out, c, pdl))
                             for i in range(copies)]) for c in ((2048, 2, 4), (2048, 4, 8), (1024, 4, 4)))
        gbps = (n1 + n2) * 4 / best / 1e3
        pairs.append({"pdl": pdl, "us": round(best, 2), "pct_read_bw": round(100 * gbps / bw, 1)})
        print(f"  two reads back to back (16.7 + 8.4 MB), PDL {'on' if pdl else 'off'}: {best:.2f} us, "
              f"{100 * gbps / bw:.1f} %", flush=True)
        del b1, b2
    if args.json:
        Path(args.json).write_text(json.dumps({"read_GBps": bw, "device": torch.cuda.get_device_name(),
                                               "sizes": rows, "two_stage_reads": pairs}, indent=1))


if __name__ == "__main__":
    main()

"""The FP8 head's streaming efficiency — the figure `sparkchat bench` scales its Spark projection by —
timed both ways in one process: eight eager calls between CUDA events (how bench timed it before
2026-12-06) and the same eight calls replayed in a CUDA graph (how it times them now, as the step runs).

    python benchmarks/head_efficiency.py [--rounds N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparkchat.engine.kernels.fp8_gemv import fp8_head_argmax  # noqa: E402
from sparkchat.engine.traffic import measure_read_bandwidth, median_graph_time, median_time  # noqa: E402

V, H = 157184, 2560  # Ling-3.0-flash's head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two timings")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    w = (torch.randn(V, H, device=dev) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.rand(V, device=dev) * 0.01 + 0.005
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    nbytes = w.numel() + 4 * scale.numel()
    calls = 8

    def stream():
        for _ in range(calls):
            fp8_head_argmax(x, w, scale)

    bw = measure_read_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}: read bandwidth {bw / 1e9:.0f} GB/s; head {nbytes / 1e6:.1f} MB")
    for r in range(args.rounds):
        for name, timer in (("eager", lambda: median_time(stream, dev, args.iters)),
                            ("graph", lambda: median_graph_time(stream, args.iters))):
            us = timer() / calls * 1e6
            print(f"  round {r} {name}: {us:.1f} us a call, {nbytes / us / 1e3:.0f} GB/s, "
                  f"{100 * nbytes / (us * 1e-6) / bw:.1f}% of read BW", flush=True)


if __name__ == "__main__":
    main()

"""What the host does while the GPU waits in the real MTP loop (generate_tokens, greedy, 3 drafts, the
32K-row draft head, a 1000-token prompt, synthetic weights at the full shapes).

    python benchmarks/loop_trace.py [--cycles 30] [--show 3] [--trace loop.json.gz]

Traces the loop's middle cycles with torch.profiler (host ops and CUDA runtime calls, GPU kernels),
then prints every stretch longer than --min-gap µs in which no kernel or copy ran on the GPU, with the
host calls that ran meanwhile: the time between a verify's end and the next draft chain's start that
`sparkchat bench` reports as loop_gap_ms, taken apart.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from profile_step import fast_synthetic
from sparkchat.engine.events import SamplingParams
from sparkchat.engine.generate import generate_tokens
from sparkchat.engine.graphs import StepGraphs
from sparkchat.engine.nn.ops import enable_compile

GPU_KINDS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_KINDS = {"cpu_op", "cuda_runtime", "cuda_driver", "user_annotation"}


def traced_loop(cycles: int, skip: int = 4) -> list[dict]:
    """The chrome-trace events of `cycles` speculative cycles, after `skip` cycles and a whole warm run."""
    enable_compile()
    model, state = fast_synthetic(None, 2048)
    model.lm_head.set_draft_rows(list(range(32768)))
    graphs = StepGraphs(model, state)
    prompt = [(i * 7919) % model.cfg.vocab_size for i in range(1000)]
    params = SamplingParams(temperature=0.0, max_tokens=skip + cycles + 2, ignore_eos=True, seed=0)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    for run in range(2):  # the first run captures the graphs the second replays
        state.reset()
        for i, _ in enumerate(generate_tokens(model, state, prompt, params, set(), mtp=True, draft_steps=3,
                                              graphs=graphs)):
            if run and i == skip:
                torch.cuda.synchronize()
                prof.start()
            if run and i == skip + cycles:
                torch.cuda.synchronize()
                prof.stop()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def idle_stretches(events: list[dict], min_gap: float) -> list[tuple[float, float]]:
    """(start, end) µs of each stretch longer than min_gap with nothing running on the GPU."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in GPU_KINDS)
    out, busy_to = [], None
    for start, end in spans:
        if busy_to is not None and start - busy_to > min_gap:
            out.append((busy_to, start))
        busy_to = end if busy_to is None else max(busy_to, end)
    return out


def host_calls(events: list[dict], start: float, end: float) -> list[dict]:
    """The host calls overlapping [start, end], outermost first where they nest, in start order."""
    calls = [e for e in events if e.get("cat") in HOST_KINDS and e["ts"] < end and e["ts"] + e.get("dur", 0) > start]
    return sorted(calls, key=lambda e: (e["ts"], -e.get("dur", 0)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=30)
    ap.add_argument("--show", type=int, default=3, help="idle stretches to list call by call")
    ap.add_argument("--min-gap", type=float, default=5.0, help="µs")
    ap.add_argument("--trace", default=None, help="also write the chrome trace here (gzipped)")
    args = ap.parse_args()
    events = traced_loop(args.cycles)
    if args.trace:
        with gzip.open(args.trace, "wt") as f:
            json.dump(events, f)
    gpu = [e for e in events if e.get("cat") in GPU_KINDS]
    first = min(e["ts"] for e in gpu)
    last = max(e["ts"] + e.get("dur", 0) for e in gpu)
    stretches = idle_stretches(events, args.min_gap)
    idle = sum(b - a for a, b in stretches)
    print(f"{args.cycles} cycles traced: {(last - first) / args.cycles:.1f} µs a cycle on the GPU clock, "
          f"{idle / args.cycles:.1f} µs of it idle in stretches over {args.min_gap} µs "
          f"({len(stretches) / args.cycles:.1f} a cycle)")
    lengths = sorted((b - a for a, b in stretches), reverse=True)
    if lengths:
        print(f"idle stretches: median {statistics.median(lengths):.1f} µs, longest {lengths[:8]}")
    middle = sorted(stretches, key=lambda s: s[1] - s[0], reverse=True)[len(stretches) // 4:][:args.show]
    for a, b in sorted(middle):
        print(f"\nGPU idle {b - a:.1f} µs; host calls around it (µs from the stretch's start, duration):")
        for e in host_calls(events, a - 150, b + 30):
            print(f"  {e['ts'] - a:+9.1f} {e.get('dur', 0):8.1f}  {e.get('cat', ''):13s} {e['name'][:90]}")
    totals: dict[str, list[float]] = {}
    for a, b in stretches:
        for e in host_calls(events, a, b):
            if e.get("cat") == "cuda_runtime":
                totals.setdefault(e["name"], []).append(e.get("dur", 0))
    print("\nCUDA runtime calls overlapping the idle stretches: calls a cycle, µs a call (median)")
    for name, durs in sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:15]:
        print(f"  {len(durs) / args.cycles:6.2f} {statistics.median(durs):8.1f}  {name}")


if __name__ == "__main__":
    main()

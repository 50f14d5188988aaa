"""Does an L2 prefetch issued while the bus idles survive a MoE layer's streaming, and does the next
layer's input projection then read faster for it?

    python benchmarks/l2_prefetch_probe.py [--json out.json]

The decode step's MoE chain leaves HBM mostly idle for ~6 µs a layer (the router's latency-bound GEMV
and the one-warp top-k), then streams ~30 MB (the two expert stages), then the next layer's input
projection streams 52.5 MB at read bandwidth (docs/benchmarks.md, session 32's timeline). This probe
replays that shape in a CUDA graph, per rotating weight copy (all of them together larger than L2):
  1. an "idle" kernel: one program spinning IDLE_US on the global timer (the router and top-k), and,
     in the same launch, P programs issuing `prefetch.global.L2` (optionally ::evict_last) for the first
     X MB of the next projection's FP8 weight, then exiting;
  2. a read of S MB of other buffers (the expert stages), plain loads or evict_first;
  3. the projection: fp8_block_gemv at the KDA shape (N 20480, K 2560, one token) over that weight.
Each case's time per layer is printed against the same sequence without a prefetch: the difference is
what prefetching X MB would save a layer, if the step's chain allows it.
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

from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv  # noqa: E402

N, K = 20480, 2560  # the KDA layers' fused input projection
LINE = 128


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def idle_prefetch_kernel(w_ptr, flag_ptr, idle_ns, n_lines, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Program 0 spins idle_ns on the global timer; programs 1.. each ask L2 for LINES 128-byte lines of
    w_ptr (the first n_lines in all) and exit without waiting for them."""
    p = tl.program_id(0)
    if p == 0:
        t0 = _now()
        t = t0
        while t - t0 < idle_ns:
            t = _now()
        tl.store(flag_ptr, (t - t0).to(tl.int32))
    else:
        line = (p - 1).to(tl.int64) * LINES + tl.arange(0, LINES)
        ptrs = w_ptr + tl.minimum(line, n_lines - 1) * 128  # the last program's lines past X: repeats
        if EVICT_LAST:
            r = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs],
                                          dtype=tl.int32, is_pure=False, pack=1)
        else:
            r = tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs],
                                          dtype=tl.int32, is_pure=False, pack=1)
        tl.store(flag_ptr + 1 + p, tl.sum(r, axis=0), mask=p < 0)  # never: keeps r live


@triton.jit
def stream_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """Sum int32 words [p*BLOCK*STEPS, (p+1)*BLOCK*STEPS) of src: a read of every byte once."""
    p = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for s in tl.static_range(STEPS):
        i = (p * STEPS + s) * BLOCK + offs
        if EVICT_FIRST:
            acc += tl.load(src_ptr + i, mask=i < n, other=0, eviction_policy="evict_first")
        else:
            acc += tl.load(src_ptr + i, mask=i < n, other=0)
    tl.store(out_ptr + p, tl.sum(acc, axis=0))


def case_us(ws, scales, streams, x, outs, flag, sink, prefetch_mb: float, stream_mb: float, evict_last: bool,
            evict_first: bool, idle_us: float, gemv: bool = True, reps: int = 30) -> float:
    """Median µs per layer of the idle(+prefetch) -> stream -> projection sequence, one layer per copy."""
    lines = int(prefetch_mb * 1e6) // LINE
    per = 256  # lines a prefetch program asks for (32 KB)
    n_stream = int(stream_mb * 1e6) // 4
    block, steps = 2048, 4

    def layer(i):
        idle_prefetch_kernel[(1 + triton.cdiv(lines, per),)](ws[i], flag, int(idle_us * 1000), lines, LINES=per,
                                                           EVICT_LAST=evict_last, num_warps=8)
        if n_stream:
            stream_kernel[(triton.cdiv(n_stream, block * steps),)](streams[i], sink, n_stream, BLOCK=block,
                                                                  STEPS=steps, EVICT_FIRST=evict_first, num_warps=8)
        if gemv:
            fp8_block_gemv(x, ws[i], scales[i], out=outs[i])

    return graph_us([lambda i=i: layer(i) for i in range(len(ws))], reps=reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--idle-us", type=float, default=6.0)
    ap.add_argument("--stream-mb", type=float, default=30.0)
    args = ap.parse_args()
    bw = measure_read_bw()
    print(f"device {torch.cuda.get_device_name()}, read bandwidth {bw['read_GBps']:.0f} GB/s", flush=True)
    copies = 8
    ws = [(torch.randn(N, K, device="cuda") * 0.5).to(torch.float8_e4m3fn) for _ in range(copies)]
    scales = [torch.rand(N // 128, K // 128, device="cuda") * 0.01 for _ in range(copies)]
    streams = [torch.randint(0, 100, (int(args.stream_mb * 1e6) // 4,), device="cuda", dtype=torch.int32)
               for _ in range(copies)]
    x = torch.randn(1, K, device="cuda").bfloat16()
    outs = [torch.empty(1, N, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    flag = torch.zeros(1 << 16, device="cuda", dtype=torch.int32)
    sink = torch.zeros(1 << 20, device="cuda", dtype=torch.int32)
    common = (ws, scales, streams, x, outs, flag, sink)
    S, idle = args.stream_mb, args.idle_us
    rows = []

    def run(label, **kw):
        kw = {"stream_mb": S, "evict_last": False, "evict_first": False, "idle_us": idle, **kw}
        us = case_us(*common, **kw)
        rows.append({"case": label, "us_per_layer": round(us, 2), **kw})
        print(f"{label:58s} {us:8.2f} µs a layer", flush=True)
        return us

    print(f"idle {idle} µs, then {S} MB streamed, then the KDA projection (52.5 MB), per layer:")
    run("no projection: idle + stream only", prefetch_mb=0, gemv=False)
    run("no projection, stream evict_first", prefetch_mb=0, gemv=False, evict_first=True)
    base = run("no prefetch", prefetch_mb=0)
    base_ef = run("no prefetch, stream evict_first", prefetch_mb=0, evict_first=True)
    for mb in (10, 20, 30):
        for el in (False, True):
            for ef in (False, True):
                us = run(f"prefetch {mb} MB{' evict_last' if el else ''}{', stream evict_first' if ef else ''}",
                         prefetch_mb=mb, evict_last=el, evict_first=ef)
                print(f"{'':58s} {us - (base_ef if ef else base):+8.2f} µs against no prefetch")
    for mb in (20, 40):
        us0 = run("no stream: no prefetch", prefetch_mb=0, stream_mb=0.0)
        us = run(f"no stream: prefetch {mb} MB", prefetch_mb=mb, stream_mb=0.0)
        print(f"{'':58s} {us - us0:+8.2f} µs against no prefetch")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), **bw, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()

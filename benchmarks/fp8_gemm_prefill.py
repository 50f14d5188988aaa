"""A prompt's FP8 linears at Ling-3.0-flash-fp4's real shapes: the FP8 GEMM kernel and the one-pass
Triton dequant + torch matmul (kernels/fp8_gemm.py) against what the prompt path did before them
(dequantize each weight to bf16 in torch, then a torch matmul) and against a torch matmul on a bf16 copy
made once (compute only: the bound).

    python benchmarks/fp8_gemm_prefill.py [--tokens 16 64 256 1024 8192] [--sweep]

The shapes and how often a prompt runs each come from one real prefill of the full synthetic model
(every FP8 linear that reaches the GEMM hook is recorded). Each figure is the median over replays of
a CUDA graph holding calls on rotating weight copies (at least ~128 MB of them, so weights stream from
HBM, not L2), per call. --sweep also times gemm_config's neighbourhood (sweep_configs) up to 512 tokens
and reports the best. Every config is checked against the oracle first.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import graph_us  # noqa: E402
from profile_step import fast_synthetic  # noqa: E402

from sparkchat.engine.generate import Decoder  # noqa: E402
from sparkchat.engine.kernels.fp8_gemm import fp8_block_gemm, fp8_dequant, gemm_config, sweep_configs  # noqa: E402
from sparkchat.engine.quant import dequant_fp8_block  # noqa: E402


def prompt_shapes() -> collections.Counter:
    """(N, K) -> calls, for one prompt through the full synthetic model."""
    model, state = fast_synthetic(None, 2048)
    seen: collections.Counter = collections.Counter()
    for lin in model.linears():
        if lin.fast_prompt is not None:
            def record(x, w, s, inner=lin.fast_prompt):
                seen[tuple(w.shape)] += 1
                return inner(x, w, s)
            lin.fast_prompt = record
    Decoder(model, state).forward(list(range(5, 69)), last_logits=True)
    torch.cuda.synchronize()
    del model, state
    torch.cuda.empty_cache()
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024, 8192])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shapes = prompt_shapes()
    print(f"{torch.cuda.get_device_name()}; a prompt's FP8 linears (N, K) x calls: "
          + ", ".join(f"{n}x{k} x{c}" for (n, k), c in sorted(shapes.items())), flush=True)
    rows = []
    totals = collections.defaultdict(float)
    for (N, K), calls in sorted(shapes.items()):
        copies = max(2, min(32, -(-128 * 2**20 // (N * K))))
        g = torch.Generator(device="cuda").manual_seed(0)
        ws = [torch.randn(N, K, device="cuda", generator=g).to(torch.float8_e4m3fn) for _ in range(copies)]
        ss = [torch.full((-(-N // 128), -(-K // 128)), 2.0 ** -6, device="cuda") for _ in range(copies)]
        dense = [dequant_fp8_block(w, s) for w, s in zip(ws[:2], ss[:2])]  # compute-only bound: 2 copies
        for M in args.tokens:
            x = torch.randn(M, K, device="cuda").bfloat16()
            want = F.linear(x, dense[0])
            old = graph_us([lambda i=i: F.linear(x, dequant_fp8_block(ws[i], ss[i])) for i in range(copies)], reps=10)
            bound = graph_us([lambda i=i: F.linear(x, dense[i % 2]) for i in range(copies)], reps=10)
            assert torch.equal(fp8_dequant(ws[0], ss[0]), dense[0])
            one_pass = graph_us([lambda i=i: F.linear(x, fp8_dequant(ws[i], ss[i])) for i in range(copies)], reps=10)
            best_cfg, best = None, float("inf")
            cfgs = sweep_configs(M, N, K, "cuda") if args.sweep and M <= 512 else [gemm_config(M, N, K, "cuda")]
            for cfg in cfgs:
                y = fp8_block_gemm(x, ws[0], ss[0], config=cfg)
                err = ((y.float() - want.float()).norm() / want.float().norm()).item()
                assert err < 1e-2, (cfg, err)
                us = graph_us([lambda i=i, c=cfg: fp8_block_gemm(x, ws[i], ss[i], config=c) for i in range(copies)],
                              reps=10)
                if cfg == cfgs[0]:
                    default = us
                if us < best:
                    best_cfg, best = cfg, us
            tflops = 2 * M * N * K / default / 1e6
            gbps = N * K / default / 1e3  # the FP8 weight bytes alone
            row = dict(N=N, K=K, M=M, calls=calls, dequant_matmul_us=old, bf16_matmul_us=bound,
                       triton_dequant_matmul_us=one_pass, gemm_us=default,
                       gemm_tflops=tflops, weight_gbps=gbps, best_us=best, best_config=str(best_cfg))
            rows.append(row)
            totals[(M, "old")] += calls * old
            totals[(M, "bound")] += calls * bound
            totals[(M, "gemm")] += calls * default
            totals[(M, "one_pass")] += calls * one_pass
            totals[(M, "best")] += calls * best
            print(f"  N={N:6d} K={K:5d} M={M:5d} x{calls:3d}: dequant+matmul {old:9.1f} us | bf16 matmul "
                  f"{bound:9.1f} | Triton dequant+matmul {one_pass:9.1f} | FP8 GEMM {default:9.1f} ({tflops:6.1f} "
                  f"TFLOP/s, {gbps:6.0f} GB/s of FP8 weights)" + (f" | best {best:9.1f} {best_cfg}" if len(cfgs) > 1 else ""),
                  flush=True)
        del ws, ss, dense
        torch.cuda.empty_cache()
    print("a prompt's FP8 linears, summed over the calls above:")
    for M in args.tokens:
        print(f"  M={M:5d}: dequant+matmul {totals[(M, 'old')] / 1e3:8.2f} ms | bf16 matmul on a kept copy "
              f"{totals[(M, 'bound')] / 1e3:8.2f} ms | Triton dequant+matmul {totals[(M, 'one_pass')] / 1e3:8.2f} ms | "
              f"FP8 GEMM {totals[(M, 'gemm')] / 1e3:8.2f} ms (best configs {totals[(M, 'best')] / 1e3:8.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()

"""Shared-memory pipelining (cp.async through Triton's pipeliner) for the decode kernels' k loops, timed
against their register-held loads on one GPU.

    python benchmarks/pipeline_probe.py [--only moe|gemv] [--moe-calls 16] [--tokens 1]

The MoE stages get `MoeConfig.stages1/stages2`, the FMA GEMV `GemvConfig.pipe`: k steps of weights
kept in flight in shared memory where the tuned configs hold one or two in registers. Every config is
checked against the torch twin first; times are bench_kernels.py's (median over CUDA-graph replays of
calls on rotating experts or weight copies beyond L2), with the read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import BLOCK_SHAPES, H, INTER, K, graph_us, make_layer, measure_read_bw, moe_bytes, routings  # noqa: E402


def moe_variants(T: int) -> list:
    from sparkchat.engine.kernels.mxfp4_moe import _TUNED_BEFORE_STAGES, moe_config

    now = moe_config(T, H, INTER)
    before = _TUNED_BEFORE_STAGES.get((T, H, INTER))  # the register-held config the variants start from
    d = replace(before, packed=now.packed, packed_act=now.packed_act) if before else now
    out = [d, now]
    for s1 in (2, 3, 4, 6):
        out.append(replace(d, stages1=s1))
    for s2 in (2, 3, 4):
        out.append(replace(d, stages2=s2))
    if T == 1:
        out += [replace(d, bn1=8, warps1=2, stages1=6), replace(d, bn1=32, warps1=4, stages1=4),
                replace(d, bn1=32, warps1=8, stages1=6), replace(d, bkw1=32, stages1=8),
                replace(d, bkw1=32, bn1=32, warps1=4, stages1=6), replace(d, bkw1=128, bn1=8, warps1=4, stages1=3),
                replace(d, bn2=16, warps2=2, stages2=4), replace(d, bkw2=16, stages2=6),
                replace(d, bkw2=16, bn2=64, warps2=4, stages2=6),
                # narrow k steps, many of them in flight (the first sweep's best: bkw1 32, 8 stages)
                replace(d, bkw1=32, stages1=6), replace(d, bkw1=32, stages1=10), replace(d, bkw1=32, stages1=11),
                replace(d, bkw1=32, bn1=8, warps1=2, stages1=8), replace(d, bkw1=32, bn1=8, warps1=2, stages1=11),
                replace(d, bkw1=32, bn1=8, warps1=4, stages1=8), replace(d, bkw1=32, bn1=16, warps1=8, stages1=8),
                replace(d, bkw1=16, stages1=12), replace(d, bkw1=16, stages1=21),
                replace(d, bkw1=16, bn1=32, warps1=4, stages1=12), replace(d, bkw1=32, prefetch=False),
                replace(d, bkw1=32, stages1=8, bkw2=16, stages2=7), replace(d, bkw1=32, stages1=8, bn2=16, warps2=2)]
    else:
        out += [replace(d, bkw1=64, stages1=4), replace(d, bn1=8, warps1=2, stages1=4),
                replace(d, bn1=8, warps1=2, bkw1=64, stages1=4), replace(d, bn1=16, warps1=4, bkw1=64, stages1=5),
                replace(d, bkw1=16, stages1=8), replace(d, bn2=16, warps2=2, stages2=3),
                replace(d, bkw2=16, stages2=4), replace(d, bn2=32, warps2=4, bkw2=16, stages2=6)]
    return out


def probe_moe(read: float, calls: int, tokens: list[int] | None = None) -> None:
    from sparkchat.engine.kernels import reference as ref
    from sparkchat.engine.kernels.mxfp4_layout import permute_words_
    from sparkchat.engine.kernels.mxfp4_moe import _plan, mxfp4_moe, mxfp4_moe_workspace, pack_moe_x

    w13, s13, w2, s2 = make_layer()
    p13, p2 = permute_words_(w13.clone()), permute_words_(w2.clone())  # the engine's paired words
    for T, repeat, label in ((1, 0, "T=1"), (4, 0, "T=4 random"), (4, 4, "T=4 half repeated")):
        if tokens and T not in tokens:
            continue
        routes = routings(T, calls, repeat, seed=T * 100 + repeat)
        nbytes, uniq = moe_bytes(routes, T)
        xs = [torch.randn(T, H, device="cuda").bfloat16() for _ in routes]
        xps = [pack_moe_x(x) for x in xs]  # as the add+norm before the MoE writes it
        outs = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in routes]
        ws = mxfp4_moe_workspace(T, K, H, INTER, "cuda")
        want = ref.mxfp4_moe_reference(xs[0], routes[0][0], routes[0][1], w13, s13, w2, s2, 4.0)
        print(f"MoE {label}: {uniq:.1f} experts a call, {nbytes / 1e6:.1f} MB", flush=True)
        for cfg in dict.fromkeys(moe_variants(T)):
            got = mxfp4_moe(xs[0], routes[0][0], routes[0][1], p13, s13, p2, s2, 4.0, workspace=ws, config=cfg,
                            paired=True, x_packed=xps[0])
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert err < 1e-2, f"{label} {cfg}: relative error {err}"
            plan = _plan(T, K, H, INTER, cfg, True, x_packed=True)
            full = graph_us([lambda i=i, r=r: mxfp4_moe(xs[i], r[0], r[1], p13, s13, p2, s2, 4.0, out=outs[i],
                                                        workspace=ws, config=cfg, paired=True, x_packed=xps[i])
                             for i, r in enumerate(routes)])
            s1 = graph_us([lambda i=i, r=r: plan.stage1(xps[i].view(torch.int32), r[0], r[1], p13.view(torch.int32),
                                                        s13, ws.act, 4.0) for i, r in enumerate(routes)])
            s2us = graph_us([lambda i=i, r=r: plan.stage2(ws.act, r[0], p2.view(torch.int32), s2, ws.part, ws.count,
                                                          outs[i]) for i, r in enumerate(routes)])
            pct = 100 * nbytes / full / 1e3 / read
            keys = ("bn1", "warps1", "bkw1", "stages1", "bn2", "warps2", "bkw2", "stages2")
            short = {k: v for k, v in asdict(cfg).items() if k in keys}
            print(f"  {full:7.2f} us ({pct:5.1f} %)  stage1 {s1:6.2f}  stage2 {s2us:6.2f}  err {err:.1e}  {short}",
                  flush=True)


def probe_gemv(read: float) -> None:
    from sparkchat.engine.kernels import reference as ref
    from sparkchat.engine.kernels.fp8_gemv import GemvConfig, fp8_block_gemv, gemv_config

    for N, Kd, label in BLOCK_SHAPES:
        copies = max(4, min(24, int(240e6 // (N * Kd))))
        ws_ = [(torch.randn(N, Kd, device="cuda") * 0.5).to(torch.float8_e4m3fn) for _ in range(copies)]
        sis = [torch.rand((N + 127) // 128, (Kd + 127) // 128, device="cuda") * 0.01 for _ in range(copies)]
        nbytes = N * Kd + 4 * sis[0].numel() + (N + Kd) * 2
        x = torch.randn(1, Kd, device="cuda").bfloat16()
        outs = [torch.empty(1, N, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        want = ref.fp8_block_gemv_reference(x, ws_[0], sis[0]).float()
        d = gemv_config("block", 1, N, Kd)
        cands = [d] + [replace(d, pipe=p) for p in (2, 3, 4, 5)]
        cands += [replace(d, bk=256, kacc=16, pipe=p) for p in (3, 5, 8)]
        cands += [GemvConfig(bn=32, rs=1, bk=256, unroll=1, warps=4, kacc=16, split=d.split, pipe=p) for p in (3, 6)]
        print(f"GEMV {label} N={N} K={Kd}: {nbytes / 1e6:.1f} MB", flush=True)
        for cfg in dict.fromkeys(cands):
            if Kd % (cfg.split * min(cfg.bk, Kd)):
                continue
            got = fp8_block_gemv(x, ws_[0], sis[0], config=cfg).float()
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-2, f"{label} {cfg}: relative error {err}"
            us = graph_us([lambda i=i: fp8_block_gemv(x, ws_[i], sis[i], out=outs[i], config=cfg)
                           for i in range(copies)])
            pct = 100 * nbytes / us / 1e3 / read
            short = {k: v for k, v in asdict(cfg).items() if k in ("bn", "bk", "warps", "split", "kacc", "pipe")}
            print(f"  {us:7.2f} us ({pct:5.1f} %)  {short}", flush=True)
        del ws_
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("moe", "gemv"), default=None)
    ap.add_argument("--moe-calls", type=int, default=16)
    ap.add_argument("--tokens", type=int, action="append", help="MoE window sizes to time (1, 4; default both)")
    args = ap.parse_args()
    bw = measure_read_bw()
    read = bw["read_GBps"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; read bandwidth {read:.0f} GB/s", flush=True)
    if args.only in (None, "moe"):
        probe_moe(read, args.moe_calls, args.tokens)
    if args.only in (None, "gemv"):
        probe_gemv(read)


if __name__ == "__main__":
    main()

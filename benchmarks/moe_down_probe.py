"""The MoE's stage 2 as one program per (row block, token) summing its K experts in registers
(MoeConfig.by_token2), timed against the per-slot programs with partials and an arrival counter.

    python benchmarks/moe_down_probe.py [--tokens 4] [--calls 16]

Every config is checked against the torch twin and (same tile config) bit for bit against the per-slot
stage 2 first; times are bench_kernels.py's (median over CUDA-graph replays of calls on rotating experts
beyond L2), with the read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import H, INTER, K, graph_us, make_layer, measure_read_bw, moe_bytes, routings  # noqa: E402


def variants(T: int) -> list:
    from sparkchat.engine.kernels.mxfp4_moe import moe_config

    d = moe_config(T, H, INTER)
    out = [d, replace(d, by_token2=True)]
    for bn2, w2, bkw2 in ((4, 1, 32), (16, 1, 32), (16, 2, 32), (32, 4, 32), (8, 1, 16), (16, 2, 16), (32, 2, 32),
                          (64, 4, 32)):
        out.append(replace(d, by_token2=True, bn2=bn2, warps2=w2, bkw2=bkw2, rs2=1))
    out.append(replace(d, by_token2=True, prefetch=not d.prefetch))
    return out


def probe(read: float, calls: int, tokens: list[int]) -> None:
    from sparkchat.engine.kernels import reference as ref
    from sparkchat.engine.kernels.mxfp4_layout import permute_words_
    from sparkchat.engine.kernels.mxfp4_moe import _plan, mxfp4_moe, mxfp4_moe_workspace, pack_moe_x

    w13, s13, w2, s2 = make_layer()
    p13, p2 = permute_words_(w13.clone()), permute_words_(w2.clone())  # the engine's paired words
    cases = [(T, r, label) for T, r, label in ((1, 0, "T=1"), (4, 0, "T=4 random"), (4, 4, "T=4 half repeated"))
             if T in tokens]
    for T, repeat, label in cases:
        routes = routings(T, calls, repeat, seed=T * 100 + repeat)
        nbytes, uniq = moe_bytes(routes, T)
        xs = [torch.randn(T, H, device="cuda").bfloat16() for _ in routes]
        xps = [pack_moe_x(x) for x in xs]  # as the add+norm before the MoE writes it
        adds = [torch.randn(T, H, device="cuda").bfloat16() for _ in routes]
        outs = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in routes]
        ws = mxfp4_moe_workspace(T, K, H, INTER, "cuda")
        want = ref.mxfp4_moe_reference(xs[0], routes[0][0], routes[0][1], w13, s13, w2, s2, 4.0)
        print(f"MoE {label}: {uniq:.1f} experts a call, {nbytes / 1e6:.1f} MB", flush=True)
        per_slot = {}
        for cfg in dict.fromkeys(variants(T)):
            got = mxfp4_moe(xs[0], routes[0][0], routes[0][1], p13, s13, p2, s2, 4.0, workspace=ws, config=cfg,
                            paired=True, x_packed=xps[0], add=adds[0])
            err = ((got.float() - want.float() - adds[0].float()).norm() / want.float().norm()).item()
            assert err < 1e-2, f"{label} {cfg}: relative error {err}"
            key = (cfg.bn2, cfg.bkw2, cfg.warps2, cfg.prefetch)
            if not cfg.by_token2 and cfg.rs2 == 1:
                per_slot[key] = got
            same = torch.equal(got, per_slot[key]) if cfg.by_token2 and key in per_slot else None
            plan = _plan(T, K, H, INTER, cfg, True, x_packed=True)
            full = graph_us([lambda i=i, r=r: mxfp4_moe(xs[i], r[0], r[1], p13, s13, p2, s2, 4.0, out=outs[i],
                                                        workspace=ws, config=cfg, paired=True, x_packed=xps[i],
                                                        add=adds[i]) for i, r in enumerate(routes)])
            s2us = graph_us([lambda i=i, r=r: plan.stage2(ws.act, r[0], p2.view(torch.int32), s2, ws.part, ws.count,
                                                          outs[i], adds[i]) for i, r in enumerate(routes)])
            pct = 100 * nbytes / full / 1e3 / read
            short = {k: v for k, v in asdict(cfg).items() if k in ("bn2", "rs2", "warps2", "bkw2", "prefetch", "by_token2")}
            print(f"  {full:7.2f} us ({pct:5.1f} %)  stage2 {s2us:6.2f}  err {err:.1e}  same as per-slot: {same}  {short}",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--tokens", type=int, action="append", help="window sizes (1, 4; default both)")
    args = ap.parse_args()
    read = measure_read_bw()["read_GBps"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; read bandwidth {read:.0f} GB/s", flush=True)
    probe(read, args.calls, args.tokens or [1, 4])


if __name__ == "__main__":
    main()

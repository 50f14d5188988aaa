"""Tensor-core decode MoE (mxfp4_moe_tc) against the FMA kernel (mxfp4_moe) at the full shapes.

    python benchmarks/moe_tc_probe.py [--json out.json]

Same method as bench_kernels.py: rotating routings in one CUDA graph, median per call; each config is
first checked against the torch twin.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_kernels import H, INTER, K, graph_us, make_layer, moe_bytes, routings  # noqa: E402
from sparkchat.engine.kernels import reference as ref  # noqa: E402
from sparkchat.engine.kernels.mxfp4_moe import _plan, moe_config, mxfp4_moe, mxfp4_moe_workspace  # noqa: E402
from sparkchat.engine.kernels.mxfp4_moe_tc import (TcConfig, mxfp4_moe_tc, mxfp4_moe_tc_workspace,  # noqa: E402
                                                   tc_plan)

_TILES = [dict(), dict(bk1=512), dict(warps1=2, warps2=2), dict(bk1=128, warps1=1, bk2=128, warps2=1),
          dict(bn1=32, bn2=32), dict(bn1=64, bn2=64), dict(bk1=512, warps1=8, bn2=32, bk2=128)]
TC = [TcConfig(mode=m, **t) for m in (1, 0) for t in _TILES]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="moe_tc_probe.json")
    args = ap.parse_args()
    layer = make_layer()
    w13, s13, w2, s2 = layer
    rows = []
    for T, repeat, calls in ((1, 0, 16), (4, 0, 8), (4, 4, 8), (2, 4, 12)):
        routes = routings(T, calls, repeat, seed=T * 100 + repeat)
        nbytes, uniq = moe_bytes(routes, T)
        xs = [torch.randn(T, H, device="cuda").bfloat16() for _ in routes]
        outs = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in routes]
        want = ref.mxfp4_moe_reference(xs[0], routes[0][0], routes[0][1], w13, s13, w2, s2, 4.0)
        label = f"T={T} repeat={repeat} ({uniq:.1f} distinct experts, {nbytes / 1e6:.1f} MB)"
        ws = mxfp4_moe_workspace(T, K, H, INTER, "cuda")
        cfg = moe_config(T, H, INTER)
        plan = _plan(T, K, H, INTER, cfg)
        got = mxfp4_moe(xs[0], routes[0][0], routes[0][1], w13, s13, w2, s2, 4.0, workspace=ws)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        us = graph_us([lambda i=i, r=r: mxfp4_moe(xs[i], r[0], r[1], w13, s13, w2, s2, 4.0, out=outs[i], workspace=ws)
                       for i, r in enumerate(routes)])
        w13i, w2i = w13.view(torch.int32), w2.view(torch.int32)
        u1 = graph_us([lambda i=i, r=r: plan.stage1(xs[i], r[0], r[1], w13i, s13, ws.act, 4.0) for i, r in enumerate(routes)])
        u2 = graph_us([lambda i=i, r=r: plan.stage2(ws.act, r[0], w2i, s2, ws.part, ws.count, outs[i])
                       for i, r in enumerate(routes)])
        print(f"{label}\n  fma kernel {us:7.2f} us (stage1 {u1:.2f}, stage2 {u2:.2f}) err {err:.4f}", flush=True)
        rows.append(dict(T=T, repeat=repeat, distinct=uniq, MB=nbytes / 1e6, kernel="fma", us=us, s1=u1, s2=u2, err=err))
        tws = mxfp4_moe_tc_workspace(T, K, H, INTER, "cuda")
        for tc in TC:
            try:
                got = mxfp4_moe_tc(xs[0], routes[0][0], routes[0][1], w13, s13, w2, s2, 4.0, workspace=tws, config=tc)
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                tp = tc_plan(T, K, H, INTER, tc)
                us = graph_us([lambda i=i, r=r: mxfp4_moe_tc(xs[i], r[0], r[1], w13, s13, w2, s2, 4.0, out=outs[i],
                                                             workspace=tws, config=tc) for i, r in enumerate(routes)])
                u1 = graph_us([lambda i=i, r=r: tp.stage1(xs[i], r[0], r[1], w13, s13, tws.act, 4.0)
                               for i, r in enumerate(routes)])
                u2 = graph_us([lambda i=i, r=r: tp.stage2(tws.act, r[0], w2, s2, tws.part, tws.count, outs[i])
                               for i, r in enumerate(routes)])
            except Exception as e:  # a config the compiler rejects: report, go on
                print(f"  tc {asdict(tc)} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            print(f"  tc {asdict(tc)} {us:7.2f} us (stage1 {u1:.2f}, stage2 {u2:.2f}) err {err:.4f}", flush=True)
            rows.append(dict(T=T, repeat=repeat, distinct=uniq, MB=nbytes / 1e6, kernel="tc", config=asdict(tc),
                             us=us, s1=u1, s2=u2, err=err))
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""The tensor-core MoE stage 1 (kernels/mxfp4_mma.py) against the CUDA-core one, alone and in the whole
MoE call, at Ling-3.0-flash's shape on the GPU (synthetic weights, CUDA graphs rotating routings as
bench_kernels.py does). H200 probe, not a test:

    python benchmarks/moe_mma_probe.py
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_kernels import EXPERT_BYTES, H, INTER, K, graph_us, make_layer, moe_bytes, routings  # noqa: E402


def main() -> None:
    from sparkchat.engine.kernels import reference as ref
    from sparkchat.engine.kernels.mxfp4_layout import permute_words_
    from sparkchat.engine.kernels.mxfp4_mma import mma_stage1_reference, mxfp4_moe_stage1_mma, pack_x_f16
    from sparkchat.engine.kernels.mxfp4_moe import _plan, moe_config, mxfp4_moe_workspace, pack_moe_x

    w13, s13, w2, s2 = make_layer()
    p13, p2 = permute_words_(w13.clone()), permute_words_(w2.clone())
    print(f"expert bytes {EXPERT_BYTES / 1e6:.2f} MB", flush=True)
    for T, repeat, calls, label in ((1, 0, 16, "T=1"), (4, 0, 8, "T=4 random"), (4, 4, 8, "T=4 half repeated")):
        routes = routings(T, calls, repeat, seed=T * 100 + repeat)
        nbytes, uniq = moe_bytes(routes, T)
        s1_bytes = uniq * (2 * INTER * H // 2 + 2 * INTER * H // 32)
        xs = [torch.randn(T, H, device="cuda").bfloat16() for _ in routes]
        xps = [pack_moe_x(x) for x in xs]
        ws = mxfp4_moe_workspace(T, K, H, INTER, "cuda")
        cfg = moe_config(T, H, INTER)
        plan = _plan(T, K, H, INTER, cfg, True, x_packed=True)
        x_in = [xp.view(torch.int32) if plan.meta1["X_PACKED"] else x for x, xp in zip(xs, xps)]
        now = graph_us([lambda i=i, r=r: plan.stage1(x_in[i], r[0], r[1], p13.view(torch.int32), s13, ws.act, 4.0)
                        for i, r in enumerate(routes)])
        print(f"{label}: {uniq:.1f} experts, stage 1 reads {s1_bytes / 1e6:.1f} MB", flush=True)
        print(f"  CUDA-core stage 1 (engine config {cfg}): {now:.2f} us"
              f" ({s1_bytes / now / 1e3:.0f} GB/s)", flush=True)
        packed = [pack_x_f16(x) for x in xs]
        pk = graph_us([lambda i=i: pack_x_f16(xs[i], *packed[i]) for i in range(len(xs))])
        print(f"  pack_x_f16 alone: {pk:.2f} us", flush=True)
        act = torch.empty(T * K, INTER, device="cuda")
        want = mma_stage1_reference(xs[0].cpu(), routes[0][0].cpu(), routes[0][1].cpu(), w13.cpu(), s13.cpu(), 4.0)
        best = None
        for dedupe in ((False,) if T == 1 else (True, False)):
            for warps, chunk in ((4, 4), (2, 4), (8, 2), (4, 5), (2, 8), (1, 8), (4, 2)):
                if (H // 32) % (warps * chunk):
                    continue
                try:
                    mxfp4_moe_stage1_mma(*packed[0], routes[0][0], routes[0][1], w13, s13, act, 4.0,
                                         warps=warps, chunk=chunk, dedupe=dedupe)
                    err = ((act.cpu() - want).norm() / want.norm()).item()
                    us = graph_us([lambda i=i, r=r: mxfp4_moe_stage1_mma(*packed[i], r[0], r[1], w13, s13, act, 4.0,
                                                                         warps=warps, chunk=chunk, dedupe=dedupe)
                                   for i, r in enumerate(routes)])
                except Exception as e:  # noqa: BLE001 — report and go on
                    print(f"  mma dedupe={dedupe} warps={warps} chunk={chunk}: failed {type(e).__name__}: {e}"[:300])
                    continue
                print(f"  mma stage 1 dedupe={dedupe} warps={warps} chunk={chunk}: {us:.2f} us"
                      f" ({s1_bytes / us / 1e3:.0f} GB/s), rel err vs twin {err:.1e}", flush=True)
                if best is None or us < best[0]:
                    best = (us, warps, chunk, dedupe)
        # the whole MoE: engine stage 2 (fp32 act, checkpoint-order words) after each stage 1
        us_b, warps, chunk, dedupe = best
        c2 = replace(cfg, packed_act=False)
        plan2 = _plan(T, K, H, INTER, c2, False)
        outs = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in routes]

        def whole_mma(i, r):
            pack_x_f16(xs[i], *packed[i])
            mxfp4_moe_stage1_mma(*packed[i], r[0], r[1], w13, s13, ws.act, 4.0, warps=warps, chunk=chunk,
                                 dedupe=dedupe)
            plan2.stage2(ws.act, r[0], w2.view(torch.int32), s2, ws.part, ws.count, outs[i])

        def whole_now(i, r):
            plan.stage1(x_in[i], r[0], r[1], p13.view(torch.int32), s13, ws.act, 4.0)
            plan.stage2(ws.act, r[0], p2.view(torch.int32), s2, ws.part, ws.count, outs[i])

        whole_mma(0, routes[0])
        ref_out = ref.mxfp4_moe_reference(xs[0], routes[0][0], routes[0][1], w13, s13, w2, s2, 4.0)
        err = ((outs[0].float() - ref_out.float()).norm() / ref_out.float().norm()).item()
        t_mma = graph_us([lambda i=i, r=r: whole_mma(i, r) for i, r in enumerate(routes)])
        t_now = graph_us([lambda i=i, r=r: whole_now(i, r) for i, r in enumerate(routes)])
        print(f"  whole MoE ({nbytes / 1e6:.1f} MB): engine {t_now:.2f} us ({nbytes / t_now / 1e3:.0f} GB/s);"
              f" pack + mma stage 1 + stage 2 {t_mma:.2f} us ({nbytes / t_mma / 1e3:.0f} GB/s),"
              f" rel err vs the reference MoE {err:.1e}", flush=True)


if __name__ == "__main__":
    main()

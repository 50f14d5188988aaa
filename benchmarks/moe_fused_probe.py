"""The one-token MoE in one launch (kernels/moe_fused.py) against the two-stage kernel, alone.

    python benchmarks/moe_fused_probe.py [--quick]

Full Ling-3.0-flash shapes (512 experts, H 2560, I 768, top 8), paired words as the engine runs them,
16 calls on rotating routings in one CUDA graph (bench_kernels.graph_us). Every config is checked
against the torch twin first. Down weights in the checkpoint's layout and in column blocks.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import H, INTER, K, graph_us, make_layer, measure_read_bw, moe_bytes, routings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the default config only")
    args = ap.parse_args()
    from sparkchat.engine.kernels import reference as ref
    from sparkchat.engine.kernels.moe_fused import DownLayout, FusedConfig, column_blocks, fused_one_token
    from sparkchat.engine.kernels.mxfp4_layout import permute_words_
    from sparkchat.engine.kernels.mxfp4_moe import moe_config, mxfp4_moe, mxfp4_moe_workspace, pack_moe_x

    bw = measure_read_bw()["read_GBps"]
    print(f"read bandwidth {bw:.0f} GB/s", flush=True)
    w13, s13, w2, s2 = make_layer()
    routes = routings(1, 16, 0, seed=100)
    nbytes, _ = moe_bytes(routes, 1)
    xs = [torch.randn(1, H, device="cuda").bfloat16() for _ in routes]
    xps = [pack_moe_x(x) for x in xs]
    wants = [ref.mxfp4_moe_reference(x, r[0], r[1], w13, s13, w2, s2, 4.0) for x, r in zip(xs, routes)]
    p13, p2 = permute_words_(w13.clone()), permute_words_(w2.clone())
    del w13, w2
    outs = [torch.empty(1, H, device="cuda", dtype=torch.bfloat16) for _ in routes]
    ws = mxfp4_moe_workspace(1, K, H, INTER, "cuda")

    def row(label: str, us: float) -> None:
        gbps = nbytes / us / 1e3
        print(f"  {label:<72} {us:7.2f} us  {nbytes / 1e6:6.2f} MB  {gbps:6.0f} GB/s  {100 * gbps / bw:5.1f} %",
              flush=True)

    cfg2 = moe_config(1, H, INTER)
    for i, r in enumerate(routes[:2]):
        got = mxfp4_moe(xs[i], r[0], r[1], p13, s13, p2, s2, 4.0, config=cfg2, paired=True, x_packed=xps[i])
        assert (got.float() - wants[i].float()).norm() / wants[i].float().norm() < 1e-2
    row("two stages (engine default)", graph_us(
        [lambda i=i, r=r: mxfp4_moe(xs[i], r[0], r[1], p13, s13, p2, s2, 4.0, out=outs[i], workspace=ws, config=cfg2,
                                    paired=True, x_packed=xps[i]) for i, r in enumerate(routes)]))

    configs = [FusedConfig()]
    if not args.quick:
        configs += [FusedConfig(bn=8), FusedConfig(bn=32), FusedConfig(bkw=32), FusedConfig(ch=128),
                    FusedConfig(ch=512), FusedConfig(unroll=1), FusedConfig(warps=2), FusedConfig(bn=8, warps=2),
                    FusedConfig(bn=8, bkw=128), FusedConfig(prefetch=False), FusedConfig(warps=8, ch=512)]
    blocks = {}
    for layout in (DownLayout(False), DownLayout(True)):
        for cfg in configs:
            if layout.blocks:
                if cfg.bn not in blocks:
                    blocks[cfg.bn] = column_blocks(p2, s2, cfg.bn)
                d2, ds2 = blocks[cfg.bn]
            else:
                d2, ds2 = p2, s2

            def call(i, add=None, cfg=cfg, d2=d2, ds2=ds2, layout=layout):
                r = routes[i]
                return fused_one_token(xs[i], r[0], r[1], p13, s13, d2, ds2, 4.0, outs[i], ws.act, add=add, config=cfg,
                                       paired=True, x_packed=xps[i], layout=layout)

            try:
                for i in range(3):
                    got = call(i)
                    err = ((got.float() - wants[i].float()).norm() / wants[i].float().norm()).item()
                    assert err < 1e-2, f"relative error {err}"
                us = graph_us([lambda i=i: call(i) for i in range(len(routes))])
            except Exception as e:  # a config that does not compile or fit is reported, not fatal
                print(f"  {asdict(cfg)} blocks={layout.blocks}: failed: {str(e).splitlines()[0][:200]}", flush=True)
                continue
            row(f"one launch, {'column blocks' if layout.blocks else 'checkpoint w2'} {asdict(cfg)}", us)
        blocks.clear()


if __name__ == "__main__":
    main()

"""Decode kernels at the Ling-3.0-flash shapes on one GPU: time, bytes, GB/s, % of measured read bandwidth.

    python benchmarks/bench_kernels.py [--json out.json] [--sweep]

Each configuration is first checked against its torch twin. Every figure is the median over replays of a CUDA graph holding R calls on rotating inputs (weights or
experts distinct across the R calls, so each call streams from HBM, not L2), divided by R; graph
replay keeps launch gaps at in-graph size (~1 us per kernel). Bytes are the weights a call must read
(each distinct expert once) plus activations. Baselines: MoE = gather the selected experts, dequantize
to bf16, batched matmuls (torch); head = bf16 weight, torch matmul.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the checkout

H, INTER, E, K, V = 2560, 768, 512, 8, 157184
EXPERT_BYTES = (2 * INTER * H // 2 + 2 * INTER * H // 32) + (H * INTER // 2 + H * INTER // 32)


def graph_us(calls, reps: int = 25) -> float:
    """Median microseconds per call of `calls` (list of zero-arg callables) replayed in one CUDA graph."""
    from sparkchat.engine.traffic import capture_graph

    def all_calls():
        for c in calls:
            c()

    graph = capture_graph(all_calls)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def eager_us(fn, reps: int) -> float:
    """Median microseconds of `fn` launched eagerly (CUDA events around each call), after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def measure_read_bw() -> dict:
    n = 1 << 30  # 4 GiB of fp32
    big = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    t_sum = graph_us([lambda: big.sum()], reps=10)
    half = big[: n // 2]
    dst = torch.empty_like(half)
    t_copy = graph_us([lambda: dst.copy_(half)], reps=10)
    del big, dst
    torch.cuda.empty_cache()
    return {"sum_4GiB_us": t_sum, "read_GBps": 4 * n / t_sum / 1e3,
            "copy_2GiB_us": t_copy, "copy_rw_GBps": 2 * 4 * (n // 2) / t_copy / 1e3}


class Recorder:
    def __init__(self, read_gbps: float, path: str, header: dict):
        self.read = read_gbps
        self.rows: list[dict] = []
        self.path, self.header = path, header

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump({**self.header, "rows": self.rows}, f, indent=1)

    def add(self, name: str, us: float, nbytes: float, **extra) -> dict:
        gbps = nbytes / us / 1e3
        row = {"name": name, "us": round(us, 2), "MB": round(nbytes / 1e6, 2), "GBps": round(gbps, 1),
               "pct_read_bw": round(100 * gbps / self.read, 1), **extra}
        self.rows.append(row)
        self.save()
        print(f"  {name:<44} {us:9.2f} us {nbytes / 1e6:9.2f} MB {gbps:8.0f} GB/s {row['pct_read_bw']:6.1f} %"
              + (f"  {extra}" if extra else ""), flush=True)
        return row


# ---------------------------------------------------------------- MoE
def make_layer():
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randint(0, 256, (E, 2 * INTER, H // 2), dtype=torch.uint8, device="cuda", generator=g)
    s13 = torch.randint(118, 125, (E, 2 * INTER, H // 32), dtype=torch.uint8, device="cuda", generator=g)
    w2 = torch.randint(0, 256, (E, H, INTER // 2), dtype=torch.uint8, device="cuda", generator=g)
    s2 = torch.randint(118, 125, (E, H, INTER // 32), dtype=torch.uint8, device="cuda", generator=g)
    return w13, s13, w2, s2


def routings(T: int, calls: int, repeat: int, seed: int):
    """`calls` routings of T tokens: distinct experts per token, token t keeps `repeat` of token t-1's;
    the first token of each call draws from experts the previous calls did not use when possible."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(E, generator=gen).tolist()
    out = []
    for _ in range(calls):
        rows = []
        for t in range(T):
            keep = rows[-1][:repeat] if t else []
            fresh = []
            while len(keep) + len(fresh) < K:
                if not pool:
                    pool = torch.randperm(E, generator=gen).tolist()
                e = pool.pop()
                if e not in keep and e not in fresh:
                    fresh.append(e)
            rows.append(keep + fresh)
        ids = torch.tensor(rows, dtype=torch.int32, device="cuda")
        w = torch.rand(T, K, generator=gen) + 0.1
        out.append((ids, (w / w.sum(-1, keepdim=True) * 2.5).float().cuda()))
    return out


def moe_bytes(routes, T: int) -> float:
    uniq = statistics.mean(len(set(ids.flatten().tolist())) for ids, _ in routes)
    act = T * H * 2 * 2 + T * K * (INTER + H) * 4 * 2
    return uniq * EXPERT_BYTES + act, uniq


def bench_moe(rec: Recorder, layer, sweep: bool) -> dict:
    from sparkchat.engine.kernels import reference as ref
    from sparkchat.engine.kernels.mxfp4_layout import permute_words_
    from sparkchat.engine.kernels.mxfp4_moe import (MoeConfig, _plan, moe_config, mxfp4_moe, mxfp4_moe_workspace,
                                                    pack_moe_x)
    w13, s13, w2, s2 = layer
    # the engine's layout (kernels/mxfp4_layout.py): every config runs on paired words, the default also
    # on the checkpoint's
    p13, p2 = permute_words_(w13.clone()), permute_words_(w2.clone())
    best = {}

    def case(T, repeat, calls, label, cfgs, baseline=False):
        cfgs = [(c, True) for c in cfgs] + [(cfgs[0], False)]
        routes = routings(T, calls, repeat, seed=T * 100 + repeat)
        nbytes, uniq = moe_bytes(routes, T)
        xs = [torch.randn(T, H, device="cuda").bfloat16() for _ in routes]
        # packed configs read x as the step's add+norm kernel writes it (planes), not packed in each program
        xps = [pack_moe_x(x) for x in xs]
        outs = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in routes]
        ws = mxfp4_moe_workspace(T, K, H, INTER, "cuda")
        results = []
        want = ref.mxfp4_moe_reference(xs[0], routes[0][0], routes[0][1], w13, s13, w2, s2, 4.0)
        for cfg, paired in cfgs:
            a13, a2 = (p13, p2) if paired else (w13, w2)
            xp = xps if cfg.packed else [None] * len(xs)
            got = mxfp4_moe(xs[0], routes[0][0], routes[0][1], a13, s13, a2, s2, 4.0, workspace=ws, config=cfg,
                            paired=paired, x_packed=xp[0])
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert err < 1e-2, f"mxfp4_moe {label} {cfg} paired={paired}: relative error {err}"
            plan = _plan(T, K, H, INTER, cfg, paired, x_packed=cfg.packed)
            full = [lambda i=i, r=r: mxfp4_moe(xs[i], r[0], r[1], a13, s13, a2, s2, 4.0, out=outs[i], workspace=ws,
                                               config=cfg, paired=paired, x_packed=xp[i]) for i, r in enumerate(routes)]
            us = graph_us(full)
            x1 = [x.view(torch.int32) for x in xps] if cfg.packed else xs
            s1 = graph_us([lambda i=i, r=r: plan.stage1(x1[i], r[0], r[1], a13.view(torch.int32), s13, ws.act, 4.0)
                           for i, r in enumerate(routes)])
            s2us = graph_us([lambda i=i, r=r: plan.stage2(ws.act, r[0], a2.view(torch.int32), s2, ws.part, ws.count,
                                                          outs[i]) for i, r in enumerate(routes)])
            results.append((us, cfg, s1, s2us, paired))
            print(f"    cfg {asdict(cfg)} paired={paired}: {us:.2f} us (stage1 {s1:.2f}, stage2 {s2us:.2f})",
                  flush=True)
        us, cfg, s1, s2us, paired = min(results, key=lambda r: r[0])
        unpaired = results[-1]
        row = rec.add(f"mxfp4_moe {label}", us, nbytes, unique_experts=uniq, stage1_us=round(s1, 2),
                      stage2_us=round(s2us, 2), config=asdict(cfg), paired=paired,
                      default_checkpoint_order_us=round(unpaired[0], 2),
                      default_checkpoint_order_stage_us=[round(unpaired[2], 2), round(unpaired[3], 2)])
        best[label] = row
        if baseline:
            n = min(4, len(routes))
            base = [lambda i=i, r=r: ref.mxfp4_moe_baseline(xs[i], r[0], r[1], w13, s13, w2, s2, 4.0)
                    for i, r in enumerate(routes[:n])]
            b_us = graph_us(base, reps=10)
            rec.add(f"baseline dequant+bf16 bmm {label}", b_us, nbytes, speedup_of_kernel=round(b_us / us, 2))
        return row

    d = moe_config(1, H, INTER, vec=0)  # the word-load stages, which the variants below vary
    c1 = [moe_config(1, H, INTER), d,  # the default (16-byte-load stages), then the word-load ones
          replace(d, packed=not d.packed),  # the bf16x2 products (packed) against fp32 FMAs
          replace(d, packed=True, bn1=8, warps1=2, bn2=16, warps2=2),
          replace(d, packed=True, bkw1=32, unroll1=2, bn1=32, warps1=4, bkw2=32, bn2=32, warps2=4),
          replace(d, packed=True, bn1=8, rs1=2, bkw1=64, warps1=4, bn2=32, rs2=1, bkw2=16, warps2=4),
          replace(d, packed_act=not d.packed_act),  # stage 1 writing stage 2's bf16x2 activation words or not
          # every weight load of a program issued before its multiplies (stage 2: before its PDL wait)
          replace(d, preload1=True), replace(d, preload2=True), replace(d, preload1=True, preload2=True),
          replace(d, preload1=True, bn1=8), replace(d, preload1=True, warps1=8),
          # stage 1 in 16-byte loads, whole groups a thread, every load in front (vec1), with and without
          # the register cap that fits 3 programs an SM
          replace(d, vec1=True, bn1=16, bkw1=64, warps1=8, maxnreg1=80),
          replace(d, vec1=True, bn1=16, bkw1=64, warps1=8),
          replace(d, vec1=True, bn1=8, bkw1=64, warps1=4, maxnreg1=80),
          replace(d, vec1=True, bn1=16, bkw1=32, warps1=8, maxnreg1=80),
          # stage 2 likewise (vec2), alone and with stage 1's
          replace(d, vec2=True), replace(d, vec1=True, bn1=16, bkw1=64, warps1=8, maxnreg1=80, vec2=True),
          replace(d, vec1=True, bn1=16, bkw1=64, warps1=8, maxnreg1=80, vec2=True, bn2=16, warps2=2)]
    listed = len(c1)
    if sweep:  # wider k steps over fewer rows (what won for the FP8 GEMVs), fewer warps
        c1 += [MoeConfig(rs1=1, unroll1=2, prefetch=True),
               MoeConfig(bn1=8, rs1=1, bkw1=64, warps1=2, bn2=8, rs2=1, bkw2=32, warps2=2),
               MoeConfig(bn1=8, rs1=1, bkw1=128, warps1=4, bn2=8, rs2=1, bkw2=32, warps2=2),
               MoeConfig(bn1=4, rs1=1, bkw1=128, warps1=2, bn2=16, rs2=1, bkw2=32, warps2=2),
               MoeConfig(bn1=16, rs1=1, bkw1=64, warps1=4, unroll1=2, bn2=32, rs2=1, bkw2=32, warps2=4),
               MoeConfig(bn1=8, rs1=2, bkw1=64, warps1=4, bn2=8, rs2=2, bkw2=32, warps2=2),
               MoeConfig(bn1=4, rs1=2, bkw1=64, warps1=2, bn2=4, rs2=2, bkw2=32, warps2=1),
               MoeConfig(bn1=8, rs1=1, bkw1=64, warps1=2, bn2=8, rs2=1, bkw2=32, warps2=2, prefetch=True)]
    # sweep candidates serve one token per program (T=1, or no dedupe): bf16x2 products, as the engine runs them
    c1 = c1[:listed] + [replace(c, packed=True, packed_act=d.packed_act) for c in c1[listed:]]
    case(1, 0, 16, "T=1 (8 experts)", c1, baseline=True)
    d4 = moe_config(4, H, INTER, vec=0)
    c4 = [moe_config(4, H, INTER), d4, replace(d4, packed=not d4.packed), MoeConfig(dedupe=False, prefetch=True),
          MoeConfig(rs1=1, rs2=1, dedupe=True), replace(d4, packed_act=not d4.packed_act),
          # each slot's loads up front, as at one token: 40 words a thread in stage 1, 24 in stage 2
          replace(d4, preload2=True),
          replace(d4, preload1=True, preload2=True, bn1=2, bkw1=64, unroll1=1),
          replace(d4, preload1=True, preload2=True, bn1=4, bkw1=64, unroll1=1, warps1=2),
          replace(d4, preload1=True, preload2=True, bn1=8, bkw1=64, unroll1=1, warps1=4),
          replace(d4, preload1=True, preload2=True, bn1=16, bkw1=64, unroll1=1, warps1=8),
          replace(d4, preload1=True, preload2=True, bn1=4, bkw1=64, unroll1=1, warps1=2, bn2=16, warps2=2),
          replace(d4, vec1=True, bn1=4, bkw1=64, warps1=2, maxnreg1=80),
          replace(d4, vec1=True, bn1=8, bkw1=64, warps1=4, maxnreg1=80),
          replace(d4, vec1=True, bn1=4, bkw1=64, warps1=2, maxnreg1=80, preload2=True),
          replace(d4, vec1=True, bn1=4, bkw1=64, warps1=2, maxnreg1=80, vec2=True),
          replace(d4, vec1=True, bn1=4, bkw1=64, warps1=2, maxnreg1=80, vec2=True, bn2=16, warps2=2)]
    listed4 = len(c4)
    if sweep:
        c4 += [MoeConfig(bn1=8, rs1=1, bkw1=64, warps1=2, bn2=8, rs2=1, bkw2=32, warps2=2, dedupe=False),
               MoeConfig(bn1=8, rs1=1, bkw1=128, warps1=4, bn2=8, rs2=1, bkw2=32, warps2=2, dedupe=False),
               MoeConfig(bn1=4, rs1=1, bkw1=64, warps1=1, bn2=8, rs2=1, bkw2=32, warps2=1, dedupe=False),
               # one-warp programs with an unrolled k loop (what won at one token), and narrower tiles
               MoeConfig(bn1=4, rs1=1, bkw1=64, unroll1=2, warps1=1, bn2=8, rs2=1, bkw2=32, warps2=1, dedupe=False),
               MoeConfig(bn1=4, rs1=1, bkw1=32, unroll1=2, warps1=1, bn2=8, rs2=1, bkw2=32, warps2=1, dedupe=False),
               MoeConfig(bn1=4, rs1=2, bkw1=64, warps1=2, bn2=4, rs2=1, bkw2=32, warps2=1, dedupe=False),
               MoeConfig(bn1=4, rs1=1, bkw1=64, unroll1=2, warps1=1, bn2=16, rs2=1, bkw2=32, warps2=2, dedupe=False)]
    c4 = c4[:listed4] + [replace(c, packed=not c.dedupe, packed_act=d4.packed_act) for c in c4[listed4:]]
    case(4, 0, 8, "T=4 random routing", c4, baseline=True)
    case(4, 4, 8, "T=4 half repeated", c4)
    case(5, 0, 6, "T=5 random routing", c4[:2])
    case(2, 4, 12, "T=2 half repeated", c4[:2])
    return best


# ---------------------------------------------------------------- MoE prefill
def bench_moe_prefill(rec: Recorder, layer, sweep: bool) -> dict:
    """Routed experts of one layer for a prompt of T = 512, 2048, 8192 tokens at the full shapes: the
    grouped MXFP4 GEMM (kernels/moe_prefill.py) against the engine's reference path, Experts.forward
    (per distinct expert: dequantize to bf16, index, two matmuls; it syncs, so it is timed eagerly with
    events). Uniform random top-8 routing (every expert is hit from T = 512 on), clamp 4, the shared
    expert's output added. Kernel figures: median over CUDA-graph replays of whole calls, grouping
    included; stage figures for the best config. Bytes: each distinct expert once, x and add read, the
    act [T*K, I] and part [T*K, H] bf16 scratch written and read, out written. FLOPs: 2*T*K*3*H*I."""
    from sparkchat.engine.kernels.moe_prefill import (_Launch, group_by_expert, moe_prefill, prefill_config,
                                                      sweep_configs)
    from sparkchat.engine.kernels.mxfp4_layout import permute_words_
    from sparkchat.engine.nn.moe import Experts

    w13, s13, w2, s2 = layer
    limit = 4.0
    experts = Experts(E, H, INTER, limit)
    experts.w13, experts.w13_scale, experts.w2, experts.w2_scale = w13, s13, w2, s2

    def timed_us(fn) -> float:
        try:
            return graph_us([fn], reps=10)
        except Exception as e:  # noqa: BLE001 - capture refused (a host sync?): time it eagerly, say so
            print(f"    CUDA graph capture failed ({type(e).__name__}: {str(e)[:200]}); timing eagerly", flush=True)
            return eager_us(fn, reps=5)

    best = {}
    for T in (512, 2048, 8192):
        gen = torch.Generator(device="cuda").manual_seed(T)
        ids = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=-1).indices.to(torch.int32)
        w = torch.rand(T, K, device="cuda", generator=gen) + 0.1
        wts = (w / w.sum(-1, keepdim=True) * 2.5).float()
        x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
        add = (torch.randn(T, H, device="cuda", generator=gen) * 0.1).bfloat16()
        out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
        uniq = int(ids.unique().numel())
        nbytes = uniq * EXPERT_BYTES + 3 * T * H * 2 + 2 * T * K * (INTER + H) * 2
        flops = 2 * T * K * 3 * H * INTER
        want = (experts(x, ids.long(), wts) + add).float()
        base_us = eager_us(lambda: experts(x, ids.long(), wts) + add, reps=3)
        cfgs = sweep_configs(T, K, E, H, INTER, "cuda") if sweep else [prefill_config(T, K, E, H, INTER, "cuda")]
        results = []
        for cfg in cfgs:
            try:
                got = moe_prefill(x, ids, wts, w13, s13, w2, s2, limit, add=add, config=cfg)
            except Exception as e:  # a config the compiler or the device rejects: report it, keep sweeping
                print(f"    T={T} cfg {asdict(cfg)}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            err = ((got.float() - want).norm() / want.norm()).item()
            assert err < 2e-2, f"moe_prefill T={T} {cfg}: relative error {err} against Experts.forward"
            us = timed_us(lambda cfg=cfg: moe_prefill(x, ids, wts, w13, s13, w2, s2, limit, add=add, out=out,
                                                      config=cfg))
            results.append((us, cfg))
            print(f"    T={T} cfg {asdict(cfg)}: {us:.1f} us, {flops / us / 1e6:.1f} TFLOP/s, "
                  f"{us / T:.3f} us/token (err {err:.1e})", flush=True)
        assert results, f"moe_prefill T={T}: every config failed"
        us, cfg = min(results, key=lambda r: r[0])
        p13, p2 = permute_words_(w13.clone()), permute_words_(w2.clone())  # the engine's layout
        got = moe_prefill(x, ids, wts, p13, s13, p2, s2, limit, add=add, config=cfg, paired=True)
        assert torch.equal(got, moe_prefill(x, ids, wts, w13, s13, w2, s2, limit, add=add, config=cfg))
        paired_us = timed_us(lambda: moe_prefill(x, ids, wts, p13, s13, p2, s2, limit, add=add, out=out, config=cfg,
                                                 paired=True))
        print(f"    T={T} best cfg on paired words: {paired_us:.1f} us (checkpoint order {us:.1f})", flush=True)
        del p13, p2
        launch = _Launch(T, K, H, INTER, cfg)
        blocks = group_by_expert(ids, E, cfg.bm)
        act = torch.empty(T * K, INTER, dtype=torch.bfloat16, device="cuda")
        part = torch.empty(T * K, H, dtype=torch.bfloat16, device="cuda")
        rw = wts.reshape(-1)
        g_us = timed_us(lambda: group_by_expert(ids, E, cfg.bm))
        s1_us = timed_us(lambda: launch.stage1(x, blocks, w13, s13, act, limit))
        s2_us = timed_us(lambda: launch.stage2(act, blocks, rw, w2, s2, part))
        c_us = timed_us(lambda: launch.combine(part, out, add))
        best[T] = rec.add(
            f"moe_prefill T={T}", us, nbytes, tflops=round(flops / us / 1e6, 1), us_per_token=round(us / T, 3),
            unique_experts=uniq, group_us=round(g_us, 1), stage1_us=round(s1_us, 1),
            stage1_tflops=round(flops * 2 / 3 / s1_us / 1e6, 1), stage2_us=round(s2_us, 1),
            stage2_tflops=round(flops / 3 / s2_us / 1e6, 1), combine_us=round(c_us, 1), paired_us=round(paired_us, 1),
            default_us=round(results[0][0], 1) if results[0][1] == cfgs[0] else None, config=asdict(cfg))
        rec.add(f"reference Experts.forward T={T}", base_us, nbytes, tflops=round(flops / base_us / 1e6, 2),
                us_per_token=round(base_us / T, 3), speedup_of_kernel=round(base_us / us, 1))
        del act, part, blocks, want, out
        torch.cuda.empty_cache()
    return best


# ---------------------------------------------------------------- FP8 GEMVs
# The FP8 block-scaled linears of one decode step (N, K, label); fused projections padded as loaded.
BLOCK_SHAPES = [
    (5 * 4096, H, "KDA q/k/v/f/g fused"),
    (H, 4096, "o_proj / MLA dense"),
    (2 * 768 * 1, H, "shared expert gate|up"),
    (H, 768, "shared expert down"),
    (32 * 192 + 640 + 128, H, "MLA q|kv_a|g fused"),
    (2 * 6144, H, "dense MLP gate|up"),
    (H, 6144, "dense MLP down"),
]


def gemv_candidates(kind: str, T: int, N: int, K: int, sweep: bool):
    from sparkchat.engine.kernels.fp8_gemv import _TUNED, GemvConfig, _pow2, gemv_config

    base = [gemv_config(kind, T, N, K)]
    if not sweep:
        return base
    if (kind, T, N, K) in _TUNED and T == 1:  # one-token shapes: swept before (docs); now narrower accumulators
        b = base[0]
        bk = min(b.bk, _pow2(K))  # the k step the kernel takes
        out = base + [replace(b, kacc=bk // 16), replace(b, kacc=bk // 8)]
        out += [replace(c, kacc=min(c.bk, _pow2(K)) // 16, split=b.split) for c in (
            GemvConfig(bn=16, rs=1, bk=512, unroll=1, warps=2), GemvConfig(bn=16, rs=1, bk=512, unroll=1, warps=4),
            GemvConfig(bn=8, rs=1, bk=512, unroll=2, warps=2), GemvConfig(bn=8, rs=1, bk=1024, unroll=1, warps=4),
            GemvConfig(bn=32, rs=1, bk=256, unroll=1, warps=4), replace(b, prefetch=True))]
        return [c for c in dict.fromkeys(out) if K % min(c.bk, K) == 0 or c is b]
    rows = max(1, N // 128)
    wide = [GemvConfig(bn=64, rs=1, bk=128, unroll=1, warps=8), GemvConfig(bn=32, rs=1, bk=256, unroll=1, warps=8),
            GemvConfig(bn=32, rs=1, bk=256, unroll=2, warps=4), GemvConfig(bn=16, rs=1, bk=512, unroll=1, warps=4),
            GemvConfig(bn=16, rs=2, bk=256, unroll=1, warps=4), GemvConfig(bn=32, rs=2, bk=128, unroll=1, warps=8),
            GemvConfig(bn=32, rs=1, bk=256, unroll=1, warps=8, prefetch=True),
            GemvConfig(bn=64, rs=1, bk=64, unroll=2, warps=8, prefetch=True),
            GemvConfig(bn=128, rs=1, bk=64, unroll=1, warps=8), GemvConfig(bn=8, rs=1, bk=512, unroll=1, warps=2)]
    if T > 2:  # several tokens: per-row accumulators keep registers free for the weight tiles
        wide = [GemvConfig(**{**c.__dict__, "row_acc": True}) for c in wide if c.rs == 1 and not c.prefetch]
        wide += [GemvConfig(bn=32, rs=1, bk=64, unroll=2, warps=4), GemvConfig(bn=16, rs=1, bk=128, warps=4)]
        # [BN, BK] accumulators per token that fit in registers without spilling (sm_90 SASS: 7.4-8.4
        # instructions per weight for four tokens, no shuffles in the k loop)
        wide += [GemvConfig(bn=bn, rs=1, bk=bk, unroll=1, warps=w)
                 for bn, bk, w in ((32, 128, 4), (32, 256, 8), (16, 128, 2), (16, 256, 4), (16, 512, 8))]
        # the tensor-core kernel (bn rows x 16 tokens MMA tiles), a few pipeline depths and splits
        wide += [GemvConfig(bn=bn, rs=1, bk=128, warps=w, stages=st, split=sp, mma=True)
                 for bn, w in ((64, 4), (128, 8)) for st in (3, 4) for sp in (1, 2, 4)
                 if K % (sp * 128) == 0 and (kind == "block" or sp == 1)]
    out = base + wide
    if kind == "block" and rows < 200:  # few row blocks: split K
        for split in (2, 4, 8):
            for bn, bk, warps in ((16, 256, 4), (32, 128, 4), (32, 256, 8), (64, 128, 8), (8, 512, 2)):
                if K % (split * bk) == 0:
                    out.append(GemvConfig(bn=bn, rs=1, bk=bk, unroll=1, warps=warps, split=split, row_acc=T > 2))
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def bench_fp8(rec: Recorder, sweep: bool) -> None:
    from sparkchat.engine.kernels import reference as ref
    from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv, fp8_head_argmax, fp8_head_gemv

    # LM head: 402 MB in FP8, larger than L2 on its own.
    w = (torch.randn(V, H, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    scale = torch.rand(V, device="cuda") * 0.01 + 0.005
    head_bytes = V * H + 4 * V
    for T in (1, 4):
        x = torch.randn(T, H, device="cuda").bfloat16()
        out = torch.empty(T, V, device="cuda")
        res = []
        want = ref.fp8_head_gemv_reference(x, w, scale)
        for cfg in gemv_candidates("head", T, V, H, sweep):
            got = fp8_head_gemv(x, w, scale, config=cfg)
            assert ((got - want).norm() / want.norm()).item() < 1e-5, f"fp8_head_gemv {cfg}"
            us = graph_us([lambda: fp8_head_gemv(x, w, scale, out=out, config=cfg)] * 4)
            res.append((us, cfg))
            print(f"    head T={T} cfg {asdict(cfg)}: {us:.2f} us", flush=True)
        us, cfg = min(res, key=lambda r: r[0])
        assert torch.equal(fp8_head_argmax(x, w, scale, config=cfg), want.argmax(-1)), f"fp8_head_argmax {cfg}"
        rec.add(f"fp8_head_gemv T={T}", us, head_bytes + T * V * 4, config=asdict(cfg))
        tok = torch.empty(T, dtype=torch.int64, device="cuda")
        us_a = graph_us([lambda: fp8_head_argmax(x, w, scale, out=tok, config=cfg)] * 4)
        rec.add(f"fp8_head_argmax T={T}", us_a, head_bytes, config=asdict(cfg))
        if T == 1:
            head_us = us
    wb = torch.randn(V, H, device="cuda").bfloat16()
    del w
    x = torch.randn(1, H, device="cuda").bfloat16()
    b_us = graph_us([lambda: torch.matmul(x, wb.T)] * 4)
    rec.add("bf16 head torch.matmul T=1 (baseline)", b_us, V * H * 2, fp8_speedup=round(b_us / head_us, 2))
    del wb
    torch.cuda.empty_cache()

    # Block-scaled linears: enough weight copies rotated that every call streams from HBM (> L2).
    for (N, Kd, label) in BLOCK_SHAPES:
        copies = max(4, min(24, int(240e6 // (N * Kd))))
        ws_ = [(torch.randn(N, Kd, device="cuda") * 0.5).to(torch.float8_e4m3fn) for _ in range(copies)]
        sis = [torch.rand((N + 127) // 128, (Kd + 127) // 128, device="cuda") * 0.01 for _ in range(copies)]
        nbytes = N * Kd + 4 * sis[0].numel()
        for T in (1, 4) if label.startswith(("KDA", "o_proj", "shared")) else (1,):
            x = torch.randn(T, Kd, device="cuda").bfloat16()
            outs = [torch.empty(T, N, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            res = []
            want = ref.fp8_block_gemv_reference(x, ws_[0], sis[0]).float()
            for cfg in gemv_candidates("block", T, N, Kd, sweep):
                got = fp8_block_gemv(x, ws_[0], sis[0], config=cfg).float()
                assert ((got - want).norm() / want.norm()).item() < 1e-2, f"fp8_block_gemv {cfg}"
                us = graph_us([lambda i=i: fp8_block_gemv(x, ws_[i], sis[i], out=outs[i], config=cfg) for i in range(copies)])
                res.append((us, cfg))
                print(f"    block {label} T={T} cfg {asdict(cfg)}: {us:.2f} us", flush=True)
            us, cfg = min(res, key=lambda r: r[0])
            rec.add(f"fp8_block_gemv {label} N={N} K={Kd} T={T}", us, nbytes + T * (N + Kd) * 2, config=asdict(cfg),
                    default_us=round(res[0][0], 2))
        del ws_
        torch.cuda.empty_cache()


def bench_router(rec: Recorder, sweep: bool) -> None:
    """The router: split-K fp32 logits GEMV + the group-limited top-k kernel (two launches)."""
    from sparkchat.engine.kernels.fp8_gemv import GemvConfig, plain_gemv_partials
    from sparkchat.engine.kernels.router import route
    from sparkchat.engine.nn.moe import route as route_ref

    copies = 24
    ws_ = [(torch.randn(E, H, device="cuda") * H ** -0.5).bfloat16() for _ in range(copies)]  # BF16, as released
    bias = torch.zeros(E, device="cuda")
    for T in (1, 4):
        x = torch.randn(T, H, device="cuda").bfloat16()
        i1, _ = route_ref(x, ws_[0], bias, 8, 4, K, 2.5, True)
        i2, _ = route(x, ws_[0], bias, 8, 4, K, 2.5, True)
        assert torch.equal(i1.sort(-1).values, i2.sort(-1).values), "router kernel disagrees with its twin"
        us = graph_us([lambda i=i: route(x, ws_[i], bias, 8, 4, K, 2.5, True) for i in range(copies)])
        rec.add(f"router (logits GEMV + top-k) T={T}", us, E * H * 2 + T * H * 2)
        if sweep:
            # fewer split-K partials make the top-k kernel's loads shorter; more rows per program less
            for gcfg in (None, GemvConfig(bn=4, rs=1, bk=512, warps=2, split=1),
                         GemvConfig(bn=2, rs=1, bk=512, warps=2, split=1),
                         GemvConfig(bn=4, rs=1, bk=256, warps=2, split=2),
                         GemvConfig(bn=8, rs=1, bk=256, warps=4, split=2)):
                for nw in (1, 4):
                    g = graph_us([lambda i=i: route(x, ws_[i], bias, 8, 4, K, 2.5, True, num_warps=nw, gemv=gcfg)
                                  for i in range(copies)])
                    print(f"    router T={T} top-k warps={nw} gemv {gcfg}: {g:.2f} us", flush=True)
            for cfg in (GemvConfig(bn=16, rs=1, bk=256, warps=4, split=5), GemvConfig(bn=8, rs=1, bk=512, warps=2, split=5),
                        GemvConfig(bn=16, rs=1, bk=128, warps=4, split=10), GemvConfig(bn=32, rs=1, bk=256, warps=8, split=5)):
                g = graph_us([lambda i=i: plain_gemv_partials(x, ws_[i], cfg) for i in range(copies)])
                print(f"    router GEMV T={T} cfg {asdict(cfg)}: {g:.2f} us", flush=True)
    del ws_
    torch.cuda.empty_cache()


def bench_kda(rec: Recorder, sweep: bool) -> None:
    """One KDA layer's core (conv, norms, gate, recurrence, output norm): the fused kernel against the
    torch.compile'd twin, at 32 heads x 128."""
    import triton

    import sparkchat.engine.nn.kda  # noqa: F401  (registers ops.kda_core before compiling)
    from sparkchat.engine.kernels.kda_decode import kda_decode
    from sparkchat.engine.nn import ops as opsmod
    from tests.test_kda_kernel import make_inputs

    opsmod.enable_compile()
    heads, dh = 32, 128
    for T, keep in ((1, False), (4, True)):
        x, (conv, recur), w = make_inputs(T, heads, dh, 4, torch.bfloat16, "cuda")
        args = (*x, conv, recur, *w, heads, dh, True, -5.0, 1e-6, keep, False)
        fns = {"compiled torch twin": lambda: opsmod.ops.kda_core(*args)}
        launches = [(None, None)]  # the kernel's default for this window
        if sweep:
            launches += ([(1, 8), (4, 4), (4, 2), (8, 4), (8, 2), (8, 1), (16, 1), (16, 2)] if T == 1 else
                         [(1, 8), (2, 8), (4, 8), (4, 4), (8, 4), (8, 2), (8, 1), (16, 1), (16, 2), (4, 2)])
        for nb, nw in launches:
            label = "default" if nb is None else f"dv_blocks={nb} warps={nw}"
            fns[f"kernel {label}"] = lambda nb=nb, nw=nw: kda_decode(*args, dv_blocks=nb, num_warps=nw)
        # the state read and written; a verify (keep) reads it and writes its inputs instead
        state_bytes = heads * dh * dh * 4 * (1 if keep else 2) + (T * heads * 4 * dh * 4 if keep else 0)
        for name, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            us = triton.testing.do_bench_cudagraph(fn) * 1e3
            rec.add(f"kda core T={T} keep_steps={keep}: {name}", us, state_bytes)
    opsmod.disable_compile()
    # a prompt's KDA layer: the torch chunked form a chunk at a time and 16 chunks at once (nn.kda.chunk_group),
    # and fla-core's chunked kernels (kernels/kda_prefill.py)
    import os
    import time

    from sparkchat.engine.kernels.kda_prefill import fla_chunk_kda

    for T in (2048, 8192):
        x, (conv, recur), w = make_inputs(T, heads, dh, 4, torch.bfloat16, "cuda")
        for label, switch, group in (("torch chunked form, a chunk at a time", "0", "1"),
                                     ("torch chunked form, 16 chunks at once", "0", "16"),
                                     ("torch chunked form, 64 chunks at once", "0", "64"),
                                     ("fla-core chunk_kda", "1", "16")):
            os.environ["SPARKCHAT_FLA_PREFILL"] = switch
            os.environ["SPARKCHAT_KDA_CHUNK_GROUP"] = group
            if switch == "1" and fla_chunk_kda() is None:
                print("fla-core is not installed: no fla prefill row")
                continue
            run = lambda: opsmod.ops.kda_core(*x, conv.clone(), recur.clone(), *w, heads, dh, True, -5.0, 1e-6,
                                              False, True)
            t0 = time.perf_counter()
            run()  # the first call compiles (and for fla-core autotunes): a new process pays it once
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            us = (time.perf_counter() - t0) / 3 * 1e6
            rec.add(f"kda prefill of {T} tokens, one layer: {label}", us, 0, us_per_token=round(us / T, 3),
                    first_call_s=round(first_s, 2))
    os.environ.pop("SPARKCHAT_FLA_PREFILL", None)
    os.environ.pop("SPARKCHAT_KDA_CHUNK_GROUP", None)
    # the commit after a 4-token verify: Ling-3.0-flash's 35 KDA layers in one launch, each reading and
    # writing its state (and reading the kept inputs of the positions it applies)
    from sparkchat.engine.kernels.kda_commit import kda_commit

    x, (conv, recur), w = make_inputs(4, heads, dh, 4, torch.bfloat16, "cuda")
    _, window, inputs = kda_decode(*x, conv, recur, *w, heads, dh, True, -5.0, 1e-6, True, False)
    layers = [(recur.clone(), inputs.clone(), conv.clone(), window.clone()) for _ in range(35)]
    for last in (0, 3):
        kda_commit(layers, last)
        torch.cuda.synchronize()
        us = triton.testing.do_bench_cudagraph(lambda: kda_commit(layers, last)) * 1e3
        moved = 35 * (2 * recur.numel() * 4 + (last + 1) * heads * 4 * dh * 4 + 2 * conv.numel() * conv.element_size())
        rec.add(f"kda commit of 35 layers after a 4-token verify, last={last}", us, moved)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="bench_kernels.json")
    ap.add_argument("--sweep", action="store_true", help="also time a small list of block-size configs")
    ap.add_argument("--only", choices=["moe", "fp8", "router", "kda", "moe_prefill"], default=None)
    args = ap.parse_args()
    import triton
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    t0 = time.time()
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    print(info, flush=True)
    bw = measure_read_bw()
    print(f"read bandwidth: {bw}", flush=True)
    rec = Recorder(bw["read_GBps"], args.json, {"info": info, "bandwidth": bw, "command": " ".join(sys.argv)})
    if args.only in (None, "moe"):
        layer = make_layer()
        bench_moe(rec, layer, args.sweep)
        del layer
        torch.cuda.empty_cache()
    if args.only in (None, "moe_prefill"):
        layer = make_layer()
        bench_moe_prefill(rec, layer, args.sweep)
        del layer
        torch.cuda.empty_cache()
    if args.only in (None, "fp8"):
        bench_fp8(rec, args.sweep)
    if args.only in (None, "fp8", "router"):
        bench_router(rec, args.sweep)
    if args.only in (None, "kda"):
        bench_kda(rec, args.sweep)
    print(f"\n{'kernel':<46} {'us':>9} {'MB':>9} {'GB/s':>8} {'%read':>7}")
    for r in rec.rows:
        print(f"{r['name']:<46} {r['us']:9.2f} {r['MB']:9.2f} {r['GBps']:8.0f} {r['pct_read_bw']:7.1f}")
    rec.header["seconds"] = round(time.time() - t0)
    rec.save()
    print("\n| kernel | µs | MB | GB/s | % of read BW | notes |\n|---|---|---|---|---|---|")
    for r in rec.rows:
        notes = {k: v for k, v in r.items() if k not in ("name", "us", "MB", "GBps", "pct_read_bw", "config")}
        print(f"| {r['name']} | {r['us']:.1f} | {r['MB']:.1f} | {r['GBps']:.0f} | {r['pct_read_bw']:.0f} | "
              + ", ".join(f"{k} {v}" for k, v in notes.items()) + " |")
    print(f"wrote {args.json} in {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()

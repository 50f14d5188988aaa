"""The tensor-core FP8 GEMV (fp8_mma_kernel) against the FMA kernel's tuned config, at Ling-3.0-flash's
verify-window shapes — the measurement behind the T = 4 entries of fp8_gemv._TUNED.

    python benchmarks/gemv_mma_probe.py            # KDA (T = 4 and 1), o_proj, shared expert, MLA, head
    python benchmarks/gemv_mma_probe.py --dense    # the dense MLP's gate|up at T = 4, KDA at T = 2, 3

Each line: one config, median µs per call in a CUDA graph of calls rotating over weight copies larger
than L2 together, GB/s of weight bytes, and the relative error against the torch twin. Writes
$OUT/gemv_mma_probe.json (or /tmp).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench_kernels import graph_us, measure_read_bw  # noqa: E402
from sparkchat.engine.kernels import reference as ref  # noqa: E402
from sparkchat.engine.kernels.fp8_gemv import GemvConfig, fp8_block_gemv, fp8_head_gemv, gemv_config  # noqa: E402

G = GemvConfig


def mma(bn: int, warps: int, stages: int, split: int = 1) -> GemvConfig:
    return G(bn=bn, rs=1, bk=128, warps=warps, stages=stages, split=split, mma=True)


def probe(out: dict, label: str, N: int, K: int, tokens: tuple[int, ...], head: bool, configs: list) -> None:
    copies = max(2, min(24, int(240e6 // (N * K))))
    ws = [(torch.randn(N, K, device="cuda") * 0.5).to(torch.float8_e4m3fn) for _ in range(copies)]
    if head:
        ss = [torch.rand(N, device="cuda") * 0.01 + 0.005 for _ in range(copies)]
    else:
        ss = [torch.rand((N + 127) // 128, (K + 127) // 128, device="cuda") * 0.01 for _ in range(copies)]
    nbytes = N * K + 4 * ss[0].numel()
    fn = fp8_head_gemv if head else fp8_block_gemv
    twin = ref.fp8_head_gemv_reference if head else ref.fp8_block_gemv_reference
    for T in tokens:
        x = torch.randn(T, K, device="cuda").bfloat16()
        want = twin(x, ws[0], ss[0]).float()
        outs = [torch.empty(T, N, device="cuda", dtype=torch.float32 if head else torch.bfloat16)
                for _ in range(copies)]
        for cfg in [gemv_config("head" if head else "block", T, N, K)] + configs:
            got = fn(x, ws[0], ss[0], config=cfg).float()
            err = ((got - want).norm() / want.norm()).item()
            assert err < (1e-5 if head else 1e-2), (label, T, cfg, err)
            us = graph_us([lambda i=i: fn(x, ws[i], ss[i], out=outs[i], config=cfg) for i in range(copies)])
            kind = "mma" if cfg.mma else "fma"
            print(f"{label} T={T} {kind} bn={cfg.bn} bk={cfg.bk} w={cfg.warps} st={cfg.stages} split={cfg.split}: "
                  f"{us:.2f} us {nbytes / us / 1e3:.0f} GB/s err {err:.1e}", flush=True)
            out[f"{label} T={T} {cfg}"] = {"us": us, "err": err, "bytes": nbytes}
    del ws
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dense", action="store_true")
    args = ap.parse_args()
    out: dict = {"read": measure_read_bw()}
    print("read bandwidth", out["read"], flush=True)
    if args.dense:
        probe(out, "dense_gu", 12288, 2560, (4,), False, [G(rs=1), mma(64, 4, 3), mma(64, 4, 3, 2), mma(128, 8, 3)])
        probe(out, "kda_t2", 20480, 2560, (2, 3), False, [mma(64, 4, 3)])
    else:
        big = [mma(bn, w, st) for bn in (64, 128) for w in (4, 8) for st in (3, 4, 5)]
        probe(out, "KDA", 20480, 2560, (4, 1), False, big)
        small = ([mma(64, 4, st, sp) for st in (3, 4) for sp in (1, 2, 4, 5)] + [mma(128, 8, 4, sp) for sp in (2, 4, 5)]
                 + [mma(32, 4, 4, sp) for sp in (1, 2, 4)])
        probe(out, "o_proj", 2560, 4096, (4,), False, small)
        probe(out, "shared_gu", 1536, 2560, (4,), False, small)
        probe(out, "shared_down", 2560, 768, (4,), False, [mma(bn, 4, 3, sp) for bn in (64, 32) for sp in (1, 2, 3)])
        probe(out, "mla_qkv", 6912, 2560, (4,), False, [mma(64, 4, st, sp) for st in (3, 4) for sp in (1, 2)]
              + [mma(128, 8, 4)])
        probe(out, "head", 157184, 2560, (4,), True, [mma(bn, w, st) for bn in (128, 256) for w in (4, 8)
                                                      for st in (3, 4)])
    path = Path(os.environ.get("OUT", "/tmp")) / "gemv_mma_probe.json"
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Launches of the one-token decode kernels for Nsight Compute to profile: the MoE layer (both stages)
and the KDA and output projections' FP8 GEMVs, at the full shapes on synthetic weights (rotated copies,
so each launch streams from HBM). ncu picks launches by name, e.g.

    ncu --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \\
        -k regex:mxfp4_moe_stage --launch-skip 4 --launch-count 4 python3 benchmarks/ncu_targets.py

(ncu locks the clocks to base: its durations run longer than bench_kernels' figures.)

With --step it runs eager decode steps of an 8-layer model at full width instead, so any kernel of the
step can be picked (the KDA core, the router, the add+norm), e.g. with stall samples per SASS line:

    ncu --set full --import-source yes -k regex:kda_decode_kernel --launch-skip 10 --launch-count 1 \\
        -o kda python3 benchmarks/ncu_targets.py --step
    ncu -i kda.ncu-rep --page source --csv --print-source sass > kda-sass.csv"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_kernels import H, INTER, K, make_layer, routings  # noqa: E402
from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv  # noqa: E402
from sparkchat.engine.kernels.mxfp4_moe import mxfp4_moe, mxfp4_moe_workspace  # noqa: E402


def decode_steps(layers: int = 8, steps: int = 4) -> None:
    """Eager one-token decode steps of a synthetic full-width model (kernels launched one by one)."""
    from benchmarks.profile_step import fast_synthetic
    from sparkchat.engine.generate import Decoder
    from sparkchat.engine.nn.ops import enable_compile

    enable_compile()
    model, state = fast_synthetic(layers, 2048)
    state.token_ids = [0] * 1024
    decoder = Decoder(model, state)
    for _ in range(steps):
        decoder.forward([1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", action="store_true", help="eager decode steps of an 8-layer model instead")
    if ap.parse_args().step:
        decode_steps()
        torch.cuda.synchronize()
        print("launched")
        return
    w13, s13, w2, s2 = make_layer()
    ws = mxfp4_moe_workspace(1, K, H, INTER, "cuda")
    x = torch.randn(1, H, device="cuda").bfloat16()
    for ids, wts in routings(1, 6, 0, seed=7):
        mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 4.0, workspace=ws)
    for n, k in ((20480, H), (H, 4096)):  # KDA q|k|v|f|g, then the output projection
        copies = [(torch.randn(n, k, device="cuda") * 0.3).to(torch.float8_e4m3fn) for _ in range(4)]
        scale_inv = torch.rand((n + 127) // 128, (k + 127) // 128, device="cuda") * 0.01
        xk = torch.randn(1, k, device="cuda").bfloat16()
        for w in copies + copies:
            fp8_block_gemv(xk, w, scale_inv)
    torch.cuda.synchronize()
    print("launched")


if __name__ == "__main__":
    main()

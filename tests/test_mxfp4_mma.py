"""The tensor-core MoE stage 1 (kernels/mxfp4_mma.py) against its twin, on a GPU; its activation
packing's twin on the CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sparkchat.engine.kernels.reference import dequant_mxfp4, swiglu

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = torch.cuda.is_available() and HAS_TRITON
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device and triton")


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def test_f16_activations_keep_eleven_bits_of_every_token():
    from sparkchat.engine.kernels.mxfp4_mma import pack_x_f16_reference

    x = torch.randn(3, 2560) * torch.tensor([[1e-3], [1.0], [300.0]])
    xq, xf = pack_x_f16_reference(x.bfloat16())
    assert torch.all((xq - x.bfloat16().float()).abs() <= x.bfloat16().float().abs() * 2.0 ** -11 + 1e-30)
    scaled_max = x.bfloat16().float().abs().amax(-1) * 64 / xf  # max |x| * s: in [2^14, 2^15), f16's top
    assert torch.all((scaled_max >= 2 ** 14) & (scaled_max < 2 ** 15))


def test_the_twin_matches_an_unquantized_stage_one_within_f16_rounding():
    from sparkchat.engine.kernels.mxfp4_mma import mma_stage1_reference

    g = torch.Generator().manual_seed(0)
    E, H, inter, K = 6, 256, 64, 2
    w13 = torch.randint(0, 256, (E, 2 * inter, H // 2), dtype=torch.uint8, generator=g)
    s13 = torch.randint(118, 125, (E, 2 * inter, H // 32), dtype=torch.uint8, generator=g)
    x = torch.randn(2, H, generator=g).bfloat16()
    ids = torch.tensor([[0, 3], [3, 5]])
    rw = torch.rand(2, K, generator=g)
    got = mma_stage1_reference(x, ids, rw, w13, s13, 4.0)
    for t in range(2):
        for k in range(K):
            h = dequant_mxfp4(w13[int(ids[t, k])], s13[int(ids[t, k])]) @ x[t].float()
            want = swiglu(h[:inter], h[inter:], 4.0) * rw[t, k]
            assert rel_err(got[t * K + k], want) < 2e-3


def _experts(E, H, inter, gen):
    w13 = torch.randint(0, 256, (E, 2 * inter, H // 2), dtype=torch.uint8, generator=gen).cuda()
    s13 = torch.randint(118, 125, (E, 2 * inter, H // 32), dtype=torch.uint8, generator=gen).cuda()
    return w13, s13


@gpu
@pytest.mark.parametrize("T,repeat,dedupe,warps,chunk", [
    (1, 0, False, 4, 4), (1, 0, False, 2, 4), (1, 0, False, 8, 2), (2, 4, True, 4, 4), (4, 0, True, 4, 4),
    (4, 4, True, 4, 4), (4, 4, False, 4, 4), (3, 6, True, 2, 4)])
def test_mma_stage1_matches_its_twin_at_lings_shape(T, repeat, dedupe, warps, chunk):
    from sparkchat.engine.kernels.mxfp4_mma import mma_stage1_reference, mxfp4_moe_stage1_mma, pack_x_f16

    g = torch.Generator().manual_seed(T * 10 + repeat)
    E, H, inter, K = 64, 2560, 768, 8
    w13, s13 = _experts(E, H, inter, g)
    rows = []
    for t in range(T):  # distinct experts per token, `repeat` of them shared with the token before
        keep = rows[-1][:repeat] if rows else []
        rest = [e for e in torch.randperm(E, generator=g).tolist() if e not in keep]
        rows.append(keep + rest[:K - len(keep)])
    ids = torch.tensor(rows, dtype=torch.int32).cuda()
    rw = (torch.rand(T, K, generator=g) + 0.1).cuda()
    x = (torch.randn(T, H, generator=g) * 3).bfloat16().cuda()
    xq, xf = pack_x_f16(x)
    act = torch.full((T * K, inter), float("nan"), device="cuda")
    mxfp4_moe_stage1_mma(xq, xf, ids, rw, w13, s13, act, 4.0, warps=warps, chunk=chunk, dedupe=dedupe)
    want = mma_stage1_reference(x.cpu(), ids.cpu(), rw.cpu(), w13.cpu(), s13.cpu(), 4.0)
    assert not act.isnan().any()
    assert rel_err(act.cpu(), want) < 1e-4

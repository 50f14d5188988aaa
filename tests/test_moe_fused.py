"""The one-token MoE in one launch (kernels/moe_fused.py) against the torch twin: under Triton's CPU
interpreter at tiny shapes, and on a GPU at the Ling-3.0-flash shape (both down layouts, paired and
checkpoint words, with and without the shared expert's add, launch after launch and in a CUDA graph)."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from sparkchat.engine.kernels import reference as ref
from tests.interpreter import run_interpreted
from tests.test_kernels import make_experts, make_routing, rel_err

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = HAS_TRITON and torch.cuda.is_available()

_SCRIPT = textwrap.dedent("""
    import torch
    from sparkchat.engine.kernels import reference as ref
    from sparkchat.engine.kernels.mxfp4_layout import pair_words_reference
    from sparkchat.engine.kernels.mxfp4_moe import MoeConfig, mxfp4_moe, pack_moe_x
    from sparkchat.engine.kernels.moe_fused import DownLayout, FusedConfig, column_blocks, fused_one_token
    from tests.test_kernels import make_experts, make_routing, rel_err
    gen = torch.Generator().manual_seed(0)
    H, I = 64, 32
    w13, s13, w2, s2 = make_experts(6, H, I, gen=gen)
    cases = ((8, False, True, 0.0), (16, True, True, 0.1), (16, False, False, 0.1), (32, True, False, 0.0))
    for bn, blocks, paired, limit in cases:  # each block width, layout and word order at least once
        ids, wts = make_routing(1, 4, 6, 0, gen)
        x = torch.randn(1, H, generator=gen).bfloat16()
        want = ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, limit)
        a13 = pair_words_reference(w13) if paired else w13
        a2 = pair_words_reference(w2) if paired else w2
        d2, ds2 = column_blocks(a2, s2, bn) if blocks else (a2, s2)
        act, out = torch.empty(4 * I), torch.empty(1, H, dtype=torch.bfloat16)
        xp = pack_moe_x(x) if paired else None
        # the two-stage kernel with the same bf16x2 products and bf16 activations: the same sums
        two = mxfp4_moe(x, ids, wts, a13, s13, a2, s2, limit, paired=paired,
                        config=MoeConfig(dedupe=False, packed=True, packed_act=True))
        for cfg in (FusedConfig(bn=bn, bkw=4, ch=32), FusedConfig(bn=bn, bkw=8, ch=16, prefetch=False)):
            fused_one_token(x, ids, wts, a13, s13, d2, ds2, limit, out, act, config=cfg, paired=paired,
                            x_packed=xp, layout=DownLayout(blocks), interpret=True)
            assert rel_err(out, want) < 2e-2, (limit, bn, blocks, paired, cfg)  # bf16 activations, bf16x2 sums
            assert rel_err(out, two) < 2e-3, (limit, bn, blocks, paired, cfg)
            shared = torch.randn(1, H, generator=gen).bfloat16()
            fused_one_token(x, ids, wts, a13, s13, d2, ds2, limit, out, act, add=shared, config=cfg,
                            paired=paired, x_packed=xp, layout=DownLayout(blocks), interpret=True)
            assert rel_err(out, want.float() + shared.float()) < 1e-2, (limit, bn, blocks, paired, cfg)
    ids, wts = make_routing(1, 4, 6, 0, gen)
    x = torch.randn(1, H, generator=gen).bfloat16()
    want = ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, 0.0)
    assert rel_err(mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 0.0, config=MoeConfig(fused=True)), want) < 1e-2
    # column blocks hold the same bytes: back to the checkpoint's order
    d2, ds2 = column_blocks(w2, s2, 16)
    back = d2.view(torch.int32).view(6, I // 16, H, 2).permute(0, 2, 1, 3).contiguous()
    assert torch.equal(back.view(torch.uint8).view(w2.shape), w2)
    assert torch.equal(ds2.view(6, I // 32, H).transpose(1, 2), s2)
    print("interpreter ok")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_one_token_under_interpreter():
    proc = run_interpreted(_SCRIPT)
    assert proc.returncode == 0 and "interpreter ok" in proc.stdout, proc.stderr[-3000:]


def test_fused_switch_reaches_the_config(monkeypatch):
    from sparkchat.engine.kernels.mxfp4_moe import moe_config

    monkeypatch.setenv("SPARKCHAT_MOE_FUSED", "1")
    assert moe_config(1, 2560, 768).fused and not moe_config(4, 2560, 768).fused
    monkeypatch.setenv("SPARKCHAT_MOE_FUSED", "0")
    assert not moe_config(1, 2560, 768).fused


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("bn", [8, 16, 32])
def test_fused_one_token_gpu(blocks, paired, bn):
    from sparkchat.engine.kernels.mxfp4_layout import permute_words_
    from sparkchat.engine.kernels.mxfp4_moe import pack_moe_x
    from sparkchat.engine.kernels.moe_fused import DownLayout, FusedConfig, column_blocks, fused_one_token

    gen = torch.Generator().manual_seed(bn)
    H, I, E = 2560, 768, 12
    w13, s13, w2, s2 = (t.cuda() for t in make_experts(E, H, I, gen=gen))
    a13 = permute_words_(w13.clone()) if paired else w13
    a2 = permute_words_(w2.clone()) if paired else w2
    d2, ds2 = column_blocks(a2, s2, bn) if blocks else (a2, s2)
    act, out = torch.empty(8 * I, device="cuda"), torch.empty(1, H, dtype=torch.bfloat16, device="cuda")
    for limit in (0.0, 0.7):
        for _ in range(3):  # each launch must leave the sums and the counter zero for the next
            ids, wts = make_routing(1, 8, E, 0, gen)
            ids, wts = ids.cuda(), wts.cuda()
            x = torch.randn(1, H, generator=gen).bfloat16().cuda()
            want = ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, limit)
            shared = torch.randn(1, H, generator=gen).bfloat16().cuda()
            xp = pack_moe_x(x) if paired else None
            fused_one_token(x, ids, wts, a13, s13, d2, ds2, limit, out, act, config=FusedConfig(bn=bn), paired=paired,
                            x_packed=xp, layout=DownLayout(blocks))
            assert rel_err(out, want) < 1e-2
            fused_one_token(x, ids, wts, a13, s13, d2, ds2, limit, out, act, add=shared, config=FusedConfig(bn=bn),
                            paired=paired, x_packed=xp, layout=DownLayout(blocks))
            assert rel_err(out, want.float() + shared.float()) < 1e-2


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and triton")
def test_fused_one_token_in_a_cuda_graph():
    """Replays of a captured launch: the counter and the sums reset themselves, and the output follows
    new inputs written into the captured buffers."""
    from sparkchat.engine.kernels.mxfp4_moe import MoeConfig, mxfp4_moe, mxfp4_moe_workspace

    gen = torch.Generator().manual_seed(5)
    H, I, E = 2560, 768, 16
    w13, s13, w2, s2 = (t.cuda() for t in make_experts(E, H, I, gen=gen))
    ids, wts = (t.cuda() for t in make_routing(1, 8, E, 0, gen))
    x = torch.randn(1, H, generator=gen).bfloat16().cuda()
    out = torch.empty(1, H, dtype=torch.bfloat16, device="cuda")
    ws = mxfp4_moe_workspace(1, 8, H, I, "cuda")
    cfg = MoeConfig(fused=True)
    mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 0.0, out=out, workspace=ws, config=cfg)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 0.0, out=out, workspace=ws, config=cfg)
    for _ in range(4):
        new_ids, new_wts = make_routing(1, 8, E, 0, gen)
        ids.copy_(new_ids)
        wts.copy_(new_wts)
        x.copy_(torch.randn(1, H, generator=gen).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, 0.0)) < 1e-2

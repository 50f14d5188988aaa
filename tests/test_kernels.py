"""Decode kernels: torch twins vs an independent plain computation (CPU, always), the Triton kernels
vs their twins (CUDA), and tiny kernels under Triton's CPU interpreter (when triton is installed).

Tolerances, as ||out - ref|| / ||ref|| over the whole output:
  twins vs plain float64 loops: 1e-5 for fp32 outputs, 1e-2 where the twin rounds to bf16;
  kernels vs twins: 1e-2 for bf16 outputs (both round fp32 sums to bf16: ~2^-9 per element, plus
  summation order), 1e-5 for fp32 logits; argmax: the kernel's token must reach the twin's max logit.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sparkchat.engine.kernels import reference as ref

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = torch.cuda.is_available() and HAS_TRITON
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device and triton")


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    out, want = out.double(), want.double()
    return ((out - want).norm() / want.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- random inputs in the engine formats
def make_experts(E: int, H: int, I: int, device="cpu", gen=None):
    """Random MXFP4 experts: all 256 byte values, E8M0 scales 2^-9..2^-3 (real weights' range)."""
    def rnd(shape, lo, hi):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, generator=gen).to(device)
    return (rnd((E, 2 * I, H // 2), 0, 256), rnd((E, 2 * I, H // 32), 118, 125),
            rnd((E, H, I // 2), 0, 256), rnd((E, H, I // 32), 118, 125))


def make_routing(T: int, K: int, E: int, repeat: int = 0, gen=None):
    """Distinct experts per token; token t reuses `repeat` experts of token t-1. Weights like the
    router's (normalized, x2.5)."""
    rows = []
    for t in range(T):
        keep = rows[-1][:repeat] if (t and repeat) else []
        rest = [e for e in torch.randperm(E, generator=gen).tolist() if e not in keep]
        rows.append(keep + rest[: K - len(keep)])
    ids = torch.tensor(rows, dtype=torch.int32)
    w = torch.rand(T, K, generator=gen) + 0.1
    return ids, (w / w.sum(-1, keepdim=True) * 2.5).float()


def make_fp8(N: int, K: int, device="cpu", gen=None):
    w = (torch.randn(N, K, generator=gen) * 0.7).to(torch.float8_e4m3fn).to(device)
    scale_inv = torch.exp2(torch.randint(-9, -3, (math.ceil(N / 128), math.ceil(K / 128)), generator=gen)).float()
    return w, scale_inv.to(device)


def make_small_shared(H: int, I: int, gen=None):
    """A small shared expert (I <= 128) for the interpreter scripts: a fused FP8 gate|up of 256 rows, gate rows
    0..I-1 and up rows from 128 (FusedLinear's padding to whole blocks), its down [H, I], SwiGLU clamp 0.5."""
    from sparkchat.engine.kernels.mxfp4_moe import SharedExpert
    gu_w, gu_s = make_fp8(256, H, gen=gen)
    dn_w, dn_s = make_fp8(H, I, gen=gen)
    return SharedExpert(gu_w, gu_s, 128, dn_w, dn_s, 0.5)


# ---------------------------------------------------------------- independent plain computations (float64)
def e2m1_formula(code: int) -> float:
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    v = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -v if s else v


def plain_dequant_mxfp4(w_u8: torch.Tensor, s_u8: torch.Tensor) -> torch.Tensor:
    """Byte by byte: low nibble = even column; float64."""
    R, C2 = w_u8.shape
    table = torch.tensor([e2m1_formula(c) for c in range(16)], dtype=torch.float64)
    lo, hi = table[(w_u8 & 15).long()], table[(w_u8 >> 4).long()]
    vals = torch.empty(R, 2 * C2, dtype=torch.float64)
    vals[:, 0::2], vals[:, 1::2] = lo, hi
    scale = torch.tensor([[math.ldexp(1.0, int(s) - 127) for s in row] for row in s_u8.tolist()], dtype=torch.float64)
    return vals * scale.repeat_interleave(32, dim=1)


def plain_moe(x, ids, wts, w13, s13, w2, s2, limit):
    T, H = x.shape
    inter = w13.shape[1] // 2
    y = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            W = plain_dequant_mxfp4(w13[e], s13[e])
            gu = W @ x[t].double()
            g, u = gu[:inter], gu[inter:]
            a = g * torch.sigmoid(g)
            if limit > 0:
                a, u = a.clamp(max=limit), u.clamp(-limit, limit)
            y[t] += float(wts[t, k]) * (plain_dequant_mxfp4(w2[e], s2[e]) @ (a * u))
    return y


def plain_fp8_block(x, w, scale_inv):
    N, K = w.shape
    wd = w.double()
    for i in range(0, N, 128):
        for j in range(0, K, 128):
            wd[i:i + 128, j:j + 128] *= float(scale_inv[i // 128, j // 128])
    return x.double() @ wd.T


# ---------------------------------------------------------------- CPU: the twins
def test_e2m1_table_and_nibble_order():
    assert [e2m1_formula(c) for c in range(16)] == list(ref.E2M1_VALUES)
    w = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8)  # codes 1, 2 | 8, 15
    s = torch.tensor([[127]], dtype=torch.uint8)
    got = ref.dequant_mxfp4(w.repeat(1, 8), s)[0, :4].tolist()
    assert got == [0.5, 1.0, -0.0, -6.0]
    assert ref.dequant_mxfp4(w.repeat(1, 8), torch.tensor([[130]], dtype=torch.uint8))[0, 1].item() == 8.0


def test_dequant_mxfp4_matches_plain():
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(0, 256, (48, 64), dtype=torch.uint8, generator=gen)
    s = torch.randint(100, 140, (48, 4), dtype=torch.uint8, generator=gen)
    assert torch.equal(ref.dequant_mxfp4(w, s).double(), plain_dequant_mxfp4(w, s))


@pytest.mark.parametrize("T,repeat", [(1, 0), (2, 4), (4, 0), (5, 3)])
@pytest.mark.parametrize("limit", [0.0, 0.02])
def test_moe_reference_vs_plain(T, repeat, limit):
    gen = torch.Generator().manual_seed(T * 10 + repeat)
    E, H, I, K = 12, 64, 32, 4
    w13, s13, w2, s2 = make_experts(E, H, I, gen=gen)
    ids, wts = make_routing(T, K, E, repeat, gen=gen)
    x = torch.randn(T, H, generator=gen).bfloat16()
    want = plain_moe(x, ids, wts, w13, s13, w2, s2, limit)
    assert rel_err(ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, limit), want) < 1e-2
    assert rel_err(ref.mxfp4_moe_baseline(x, ids, wts, w13, s13, w2, s2, limit), want) < 2e-2


def test_swiglu_clamp_is_active():
    g = torch.tensor([-10.0, 0.5, 10.0])
    u = torch.tensor([9.0, -9.0, 9.0])
    assert torch.allclose(ref.swiglu(g, u, 0.0), torch.nn.functional.silu(g) * u)
    assert torch.allclose(ref.swiglu(g, u, 4.0), torch.nn.functional.silu(g).clamp(max=4.0) * u.clamp(-4, 4))


@pytest.mark.parametrize("N,K", [(256, 384), (200, 136), (576, 512)])
@pytest.mark.parametrize("T", [1, 5])
def test_fp8_block_reference_vs_plain(N, K, T):
    gen = torch.Generator().manual_seed(N + K + T)
    w, si = make_fp8(N, K, gen=gen)
    x = torch.randn(T, K, generator=gen).bfloat16()
    assert rel_err(ref.fp8_block_gemv_reference(x, w, si), plain_fp8_block(x, w, si)) < 1e-2


def test_fp8_head_reference_vs_plain():
    gen = torch.Generator().manual_seed(7)
    w, _ = make_fp8(300, 256, gen=gen)
    scale = torch.rand(300, generator=gen) + 0.5
    x = torch.randn(3, 256, generator=gen).bfloat16()
    want = (x.double() @ w.double().T) * scale.double()
    assert rel_err(ref.fp8_head_gemv_reference(x, w, scale), want) < 1e-5
    assert torch.equal(ref.fp8_head_argmax_reference(x, w, scale), want.argmax(-1))


# ---------------------------------------------------------------- CUDA: kernels vs twins
@gpu
@pytest.mark.parametrize("shape", [(16, 256, 128, 4), (512, 2560, 768, 8)], ids=["small", "ling"])
@pytest.mark.parametrize("T,repeat", [(1, 0), (2, 4), (4, 0), (4, 4), (5, 2)])
@pytest.mark.parametrize("limit", [0.0, 4.0])
@pytest.mark.parametrize("dedupe,prefetch,packed", [(True, False, False), (False, False, False), (False, True, False),
                                                    (False, False, True)])
def test_mxfp4_moe_gpu(shape, T, repeat, limit, dedupe, prefetch, packed):
    from sparkchat.engine.kernels.mxfp4_moe import MoeConfig, moe_config, mxfp4_moe, mxfp4_moe_workspace
    E, H, I, K = shape
    gen = torch.Generator().manual_seed(hash((shape, T, repeat)) % 2**31)
    w13, s13, w2, s2 = make_experts(E, H, I, "cuda", gen)
    ws = mxfp4_moe_workspace(T, K, H, I, "cuda")
    ws.act.fill_(float("nan"))
    ws.part.fill_(float("nan"))
    cfg = MoeConfig(**{**moe_config(T, H, I).__dict__, "dedupe": dedupe, "prefetch": prefetch, "packed": packed})
    for _ in range(2):  # fresh inputs, same workspace: the slot counters must have reset
        ids, wts = make_routing(T, K, E, repeat, gen)
        ids, wts = ids.cuda(), wts.cuda()
        x = (torch.randn(T, H, generator=gen) * 2).bfloat16().cuda()
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        mxfp4_moe(x, ids, wts, w13, s13, w2, s2, limit, out=out, workspace=ws, config=cfg)
        want = ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, limit)
        assert not out.isnan().any()
        assert rel_err(out, want) < 1e-2
    assert ws.count.eq(0).all()


@gpu
@pytest.mark.parametrize("paired", [False, True])
def test_mxfp4_moe_tuned_one_token_preloaded_gpu(paired, monkeypatch):
    """The engine's one-token config at the Ling shape (both stages preloaded, mxfp4_moe._TUNED) against
    the twin and against its k-loop form (SPARKCHAT_MOE_PRELOAD=0), with the shared expert's add."""
    from sparkchat.engine.kernels.mxfp4_layout import permute_words_
    from sparkchat.engine.kernels.mxfp4_moe import moe_config, mxfp4_moe, pack_moe_x
    gen = torch.Generator().manual_seed(7)
    w13, s13, w2, s2 = make_experts(16, 2560, 768, "cuda", gen)
    a13, a2 = (permute_words_(w13.clone()), permute_words_(w2.clone())) if paired else (w13, w2)
    preloaded = moe_config(1, 2560, 768, vec=0)  # the word-load stages (the default loads 16 bytes)
    assert preloaded.preload1 and preloaded.preload2
    monkeypatch.setenv("SPARKCHAT_MOE_PRELOAD", "0")
    looped = moe_config(1, 2560, 768, vec=0)
    assert not (looped.preload1 or looped.preload2)
    for _ in range(3):
        ids, wts = make_routing(1, 8, 16, 0, gen)
        ids, wts = ids.cuda(), wts.cuda()
        x = torch.randn(1, 2560, generator=gen).bfloat16().cuda()
        shared = torch.randn(1, 2560, generator=gen).bfloat16().cuda()
        want = ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, 4.0)
        got = mxfp4_moe(x, ids, wts, a13, s13, a2, s2, 4.0, config=preloaded, paired=paired, x_packed=pack_moe_x(x))
        loop = mxfp4_moe(x, ids, wts, a13, s13, a2, s2, 4.0, config=looped, paired=paired, x_packed=pack_moe_x(x))
        assert rel_err(got, want) < 1e-2 and rel_err(got, loop) < 2e-3
        added = mxfp4_moe(x, ids, wts, a13, s13, a2, s2, 4.0, config=preloaded, paired=paired, add=shared)
        assert rel_err(added, want.float() + shared.float()) < 1e-2


@gpu
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("vec2", [False, True])
def test_mxfp4_moe_vectorized_stages_gpu(T, vec2):
    """Stage 1 in 16-byte loads (MoeConfig.vec1, the register cap the bench times), and stage 2 too (vec2),
    at the Ling shape, paired words, the input in planes as the add+norm writes it: against the twin and
    the packed k loops."""
    from dataclasses import replace

    from sparkchat.engine.kernels.mxfp4_layout import permute_words_
    from sparkchat.engine.kernels.mxfp4_moe import moe_config, mxfp4_moe, pack_moe_x
    gen = torch.Generator().manual_seed(11)
    w13, s13, w2, s2 = make_experts(40, 2560, 768, "cuda", gen)
    a13, a2 = permute_words_(w13.clone()), permute_words_(w2.clone())
    tuned = moe_config(T, 2560, 768, vec=0)
    vec = replace(tuned, vec1=True, bn1=16 if T == 1 else 4, bkw1=64, warps1=8 if T == 1 else 2, maxnreg1=80,
                  vec2=vec2)
    for _ in range(2):
        ids, wts = make_routing(T, 8, 40, 0, gen)
        ids, wts = ids.cuda(), wts.cuda()
        x = torch.randn(T, 2560, generator=gen).bfloat16().cuda()
        want = ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, 4.0)
        got = mxfp4_moe(x, ids, wts, a13, s13, a2, s2, 4.0, config=vec, paired=True, x_packed=pack_moe_x(x))
        loop = mxfp4_moe(x, ids, wts, a13, s13, a2, s2, 4.0, config=tuned, paired=True, x_packed=pack_moe_x(x))
        assert rel_err(got, want) < 1e-2 and rel_err(got, loop) < 2e-3
        # the activations as a row and the scales as Triton lays them out (the layout before tile_x)
        row = mxfp4_moe(x, ids, wts, a13, s13, a2, s2, 4.0, config=replace(vec, tile_x=False), paired=True,
                        x_packed=pack_moe_x(x))
        assert rel_err(got, row) < 1e-5


@gpu
@pytest.mark.parametrize("T,vec", [(1, False), (1, True), (4, False)])
def test_mxfp4_moe_shared_expert_in_the_stages_gpu(T, vec):
    """The Ling shape (I = 768 for routed and shared experts alike), the engine's configs (and the
    16-byte-load stages): the shared expert inside the stages, both projections (one token) or only its
    down, against the routed kernel plus the shared MLP's own GEMVs added in stage 2."""
    from dataclasses import replace

    from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv, fp8_block_gemv_swiglu
    from sparkchat.engine.kernels.mxfp4_layout import permute_words_
    from sparkchat.engine.kernels.mxfp4_moe import SharedExpert, _VEC1, moe_config, mxfp4_moe, pack_moe_x
    gen = torch.Generator().manual_seed(13)
    w13, s13, w2, s2 = make_experts(40, 2560, 768, "cuda", gen)
    a13, a2 = permute_words_(w13.clone()), permute_words_(w2.clone())
    gu_w, gu_s = make_fp8(1536, 2560, "cuda", gen)
    dn_w, dn_s = make_fp8(2560, 768, "cuda", gen)
    sh = SharedExpert(gu_w, gu_s, 768, dn_w, dn_s, 7.0)
    cfg = moe_config(T, 2560, 768, vec=0)
    if vec:
        cfg = replace(cfg, vec1=True, vec2=True, **_VEC1[(T, 2560, 768)])
    for _ in range(3):
        ids, wts = make_routing(T, 8, 40, 2, gen)
        ids, wts = ids.cuda(), wts.cuda()
        x = torch.randn(T, 2560, generator=gen).bfloat16().cuda()
        xp = pack_moe_x(x)
        gu = fp8_block_gemv(x, gu_w, gu_s)
        y_sh = fp8_block_gemv_swiglu(gu, 768, 7.0, dn_w, dn_s)
        added = mxfp4_moe(x, ids, wts, a13, s13, a2, s2, 4.0, config=cfg, paired=True, x_packed=xp, add=y_sh)
        down = mxfp4_moe(x, ids, wts, a13, s13, a2, s2, 4.0, config=cfg, paired=True, x_packed=xp,
                         shared=sh, shared_gate_up=gu, join=lambda: None)
        want = ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, 4.0).float() + y_sh.float()
        assert rel_err(down, want) < 1e-2 and rel_err(down, added) < 2e-3
        if T == 1:
            both = mxfp4_moe(x, ids, wts, a13, s13, a2, s2, 4.0, config=cfg, paired=True, x_packed=xp, shared=sh)
            assert rel_err(both, want) < 1e-2 and rel_err(both, added) < 2e-3


@gpu
@pytest.mark.parametrize("T", [1, 4])
def test_mxfp4_moe_add_norm_gpu(T):
    """The Ling shape with the engine's configs: the MoE with the next layer's add+norm in stage 2 against
    the MoE and then the add+norm kernel."""
    from sparkchat.engine.kernels.fp8_gemv import add_rms_norm
    from sparkchat.engine.kernels.mxfp4_layout import permute_words_
    from sparkchat.engine.kernels.mxfp4_moe import mxfp4_moe, mxfp4_moe_add_norm, pack_moe_x
    gen = torch.Generator().manual_seed(17)
    w13, s13, w2, s2 = make_experts(40, 2560, 768, "cuda", gen)
    a13, a2 = permute_words_(w13.clone()), permute_words_(w2.clone())
    nw = (torch.rand(2560, generator=gen) + 0.5).bfloat16().cuda()
    for _ in range(3):
        ids, wts = make_routing(T, 8, 40, 2, gen)
        ids, wts = ids.cuda(), wts.cuda()
        x = torch.randn(T, 2560, generator=gen).bfloat16().cuda()
        res = (torch.randn(T, 2560, generator=gen) * 3).bfloat16().cuda()
        y = mxfp4_moe(x, ids, wts, a13, s13, a2, s2, 4.0, paired=True, x_packed=pack_moe_x(x))
        s_ref, h_ref = add_rms_norm(res, y, nw, 1e-6)
        s_got, h_got = mxfp4_moe_add_norm(x, ids, wts, a13, s13, a2, s2, 4.0, res, nw, 1e-6, paired=True,
                                          x_packed=pack_moe_x(x))
        assert torch.equal(s_got, s_ref)
        assert (h_got == h_ref).float().mean().item() > 0.95 and rel_err(h_got, h_ref) < 1e-2


@gpu
def test_mxfp4_moe_int64_ids_and_defaults():
    from sparkchat.engine.kernels.mxfp4_moe import mxfp4_moe
    gen = torch.Generator().manual_seed(3)
    w13, s13, w2, s2 = make_experts(8, 128, 64, "cuda", gen)
    ids, wts = make_routing(3, 4, 8, 2, gen)
    x = torch.randn(3, 128, generator=gen).bfloat16().cuda()
    out = mxfp4_moe(x, ids.long().cuda(), wts.cuda(), w13, s13, w2, s2, 0.0)
    assert rel_err(out, ref.mxfp4_moe_reference(x, ids.cuda(), wts.cuda(), w13, s13, w2, s2, 0.0)) < 1e-2


@gpu
@pytest.mark.parametrize("N,I,T", [(2560, 768, 1), (2560, 768, 4), (2560, 6144, 1), (200, 256, 2)])
def test_fp8_block_gemv_swiglu_gpu(N, I, T):
    from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv_swiglu
    from sparkchat.engine.nn.moe import swiglu
    gen = torch.Generator().manual_seed(N + I + T)
    w, si = make_fp8(N, I, "cuda", gen)
    gu = torch.randn(T, 2 * I, generator=gen).bfloat16().cuda()
    for limit in (0.0, 7.0):
        act = swiglu(gu[:, :I].float(), gu[:, I:].float(), limit).bfloat16()
        got = fp8_block_gemv_swiglu(gu, I, limit, w, si)
        assert rel_err(got, ref.fp8_block_gemv_reference(act, w, si)) < 1e-2


@gpu
@pytest.mark.parametrize("T", [1, 2, 4, 5])
def test_fp8_block_gemv_add_norm_gpu(T):
    from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv_add_norm
    from sparkchat.engine.nn.ops import add_rms_norm
    gen = torch.Generator().manual_seed(T)
    w, si = make_fp8(2560, 4096, "cuda", gen)
    x = torch.randn(T, 4096, generator=gen).bfloat16().cuda()
    res = torch.randn(T, 2560, generator=gen).bfloat16().cuda()
    nw = (torch.rand(2560, generator=gen) + 0.5).bfloat16().cuda()
    s_ref, h_ref = add_rms_norm(res, ref.fp8_block_gemv_reference(x, w, si), nw, 1e-6)
    s_got, h_got = fp8_block_gemv_add_norm(x, w, si, res, nw, 1e-6)
    assert rel_err(s_got, s_ref) < 1e-2 and rel_err(h_got, h_ref) < 1e-2


@gpu
@pytest.mark.parametrize("T", [1, 4])
def test_fused_add_norm_matches_two_launches_gpu(T, monkeypatch):
    """The output projection with the add+norm in its own last programs (one launch) against the GEMV
    plus the add+norm kernel, at the Ling shape: the same sum, the norm but for the squares' summation
    order, the MoE's packed form of it, and the arrival counters back at zero."""
    from sparkchat.engine.kernels import fp8_gemv
    from sparkchat.engine.kernels.counters import arrival_counters
    from sparkchat.engine.kernels.mxfp4_moe import pack_moe_x
    monkeypatch.setattr(fp8_gemv, "FUSED_ADD_NORM_MIN_TOKENS", 1)
    gen = torch.Generator().manual_seed(11 + T)
    w, si = make_fp8(2560, 4096, "cuda", gen)
    nw = (torch.rand(2560, generator=gen) + 0.5).bfloat16().cuda()
    for _ in range(2):
        x = torch.randn(T, 4096, generator=gen).bfloat16().cuda()
        res = (torch.randn(T, 2560, generator=gen) * 2).bfloat16().cuda()
        monkeypatch.setenv("SPARKCHAT_FUSED_ADD_NORM", "0")
        s2, h2 = fp8_gemv.fp8_block_gemv_add_norm(x, w, si, res, nw, 1e-6, moe_x=True)
        monkeypatch.setenv("SPARKCHAT_FUSED_ADD_NORM", "1")
        s1, h1 = fp8_gemv.fp8_block_gemv_add_norm(x, w, si, res, nw, 1e-6, moe_x=True)
        assert torch.equal(s1, s2)
        assert (h1 == h2).float().mean().item() > 0.99 and rel_err(h1, h2) < 1e-2
        assert torch.equal(h1.moe_x, pack_moe_x(h1))
        if T > 1:  # the tensor-core GEMVs' fp16 form of the norm, as f16_block_acts makes it
            h16, hd = fp8_gemv.f16_block_acts(h1)
            assert torch.equal(h1.f16_acts[0], h16) and torch.equal(h1.f16_acts[1], hd)
    assert arrival_counters("gemv_add_norm", w.device, 1).eq(0).all()  # the kernel's own buffer (cuda:0)


@gpu
@pytest.mark.parametrize("T", [2, 4, 5])
def test_moe_slot_sum_with_every_token_at_once_gpu(T, monkeypatch):
    """SPARKCHAT_TAIL_AT_ONCE bit 2 at the Ling shapes with the engine's configs: MoE stage 2's slot sum
    over every token at once gives the one-token-after-another output to the bit, the shared expert's
    output added."""
    from sparkchat.engine.kernels.mxfp4_layout import permute_words_
    from sparkchat.engine.kernels.mxfp4_moe import mxfp4_moe, pack_moe_x
    gen = torch.Generator().manual_seed(31 + T)
    w13, s13, w2, s2 = make_experts(40, 2560, 768, "cuda", gen)
    a13, a2 = permute_words_(w13.clone()), permute_words_(w2.clone())
    for _ in range(2):
        xm = torch.randn(T, 2560, generator=gen).bfloat16().cuda()
        ids, wts = make_routing(T, 8, 40, 2, gen)
        ids, wts = ids.cuda(), wts.cuda()
        add = torch.randn(T, 2560, generator=gen).bfloat16().cuda()
        got = {}
        for bits in ("0", "2"):
            monkeypatch.setenv("SPARKCHAT_TAIL_AT_ONCE", bits)
            got[bits] = mxfp4_moe(xm, ids, wts, a13, s13, a2, s2, 4.0, paired=True, x_packed=pack_moe_x(xm), add=add)
        assert torch.equal(got["2"], got["0"])


@gpu
@pytest.mark.parametrize("T", [1, 2, 4, 5])
def test_moe_input_norm_finished_by_the_router_gpu(T):
    """SPARKCHAT_SPLIT_MOE_INPUT_NORM=1 at the Ling shapes with the engine's configs (T > 1: verify
    windows, SPARKCHAT_SPLIT_NORM_WINDOW; the shared gate|up on the tensor cores): KDA's output
    projection writes s and its sums of squares, the shared expert's gate|up applies the norm without
    writing it, the router's logits GEMV applies it and writes h and stage 1's planes."""
    import dataclasses

    from sparkchat.engine.kernels.fp8_gemv import (fp8_block_gemv, fp8_block_gemv_add_norm, plain_gemv_partials,
                                                   take_split_norm)
    from sparkchat.engine.kernels.mxfp4_moe import pack_moe_x
    gen = torch.Generator().manual_seed(23)
    wo, so = make_fp8(2560, 4096, "cuda", gen)
    wg, sg = make_fp8(1536, 2560, "cuda", gen)
    wr = (torch.randn(512, 2560, generator=gen) / 50).bfloat16().cuda()
    nw = (torch.rand(2560, generator=gen) + 0.5).bfloat16().cuda()
    for _ in range(3):
        o = torch.randn(T, 4096, generator=gen).bfloat16().cuda()
        res = (torch.randn(T, 2560, generator=gen) * 3).bfloat16().cuda()
        s_ref, h_ref = fp8_block_gemv_add_norm(o, wo, so, res, nw, 1e-6, moe_x=True)
        s, h = fp8_block_gemv_add_norm(o, wo, so, res, nw, 1e-6, moe_x=True, split_norm=True)
        assert torch.equal(s, s_ref)
        view = h.view_as(h)
        view.split_norm = dataclasses.replace(h.split_norm, write=False)
        shared = fp8_block_gemv(view, wg, sg, split_norm=take_split_norm(view))
        logits = plain_gemv_partials(h, wr, split_norm=take_split_norm(h)).sum(0)
        assert (h == h_ref).float().mean().item() > 0.99 and rel_err(h, h_ref) < 1e-2
        assert torch.equal(h.moe_x, pack_moe_x(h))
        assert rel_err(shared, fp8_block_gemv(h_ref, wg, sg)) < 1e-2
        assert rel_err(logits, plain_gemv_partials(h_ref, wr).sum(0)) < 1e-2


@gpu
def test_next_projection_finishing_the_moe_norm_gpu():
    """SPARKCHAT_MOE_ADD_NORM=2 at the Ling shapes, the engine's configs: stage 2 writes s and its sums of
    squares, KDA's fused input projection (20480 rows) finishes the norm as it loads s, against the MoE
    with the whole norm in stage 2 and the GEMV reading its h."""
    from sparkchat.engine.kernels.fp8_gemv import SplitNorm, fp8_block_gemv
    from sparkchat.engine.kernels.mxfp4_layout import permute_words_
    from sparkchat.engine.kernels.mxfp4_moe import mxfp4_moe_add_norm, mxfp4_moe_add_sumsq, pack_moe_x
    gen = torch.Generator().manual_seed(19)
    w13, s13, w2, s2 = make_experts(40, 2560, 768, "cuda", gen)
    a13, a2 = permute_words_(w13.clone()), permute_words_(w2.clone())
    w, si = make_fp8(20480, 2560, "cuda", gen)
    nw = (torch.rand(2560, generator=gen) + 0.5).bfloat16().cuda()
    for _ in range(3):
        ids, wts = (t.cuda() for t in make_routing(1, 8, 40, 0, gen))
        x = torch.randn(1, 2560, generator=gen).bfloat16().cuda()
        res = (torch.randn(1, 2560, generator=gen) * 3).bfloat16().cuda()
        kw = dict(paired=True, x_packed=pack_moe_x(x))
        s_full, h_full = mxfp4_moe_add_norm(x, ids, wts, a13, s13, a2, s2, 4.0, res, nw, 1e-6, **kw)
        s, ssq = mxfp4_moe_add_sumsq(x, ids, wts, a13, s13, a2, s2, 4.0, res, **kw)
        assert torch.equal(s, s_full)
        h = torch.full_like(s, float("nan"))
        got = fp8_block_gemv(h, w, si, split_norm=SplitNorm(s, ssq, nw, 1e-6))
        assert (h == h_full).float().mean().item() > 0.99 and rel_err(h, h_full) < 1e-2
        assert torch.equal(got, fp8_block_gemv(h.clone(), w, si))  # the GEMV read the h it wrote
        assert rel_err(got, fp8_block_gemv(h_full, w, si)) < 1e-2


@gpu
@pytest.mark.parametrize("T,N", [(1, 2560), (4, 2560), (5, 2560), (3, 200)])
def test_add_rms_norm_gpu(T, N):
    """The residual add + RMSNorm kernel against ops.add_rms_norm: the sum is exact, the norm within one
    bf16 rounding (the mean's summation order differs) on a few elements at most."""
    from sparkchat.engine.kernels.fp8_gemv import add_rms_norm
    from sparkchat.engine.nn.ops import add_rms_norm as reference
    gen = torch.Generator().manual_seed(T * N)
    x = (torch.randn(T, N, generator=gen) * 3).bfloat16().cuda()
    h = torch.randn(T, N, generator=gen).bfloat16().cuda()
    nw = (torch.rand(N, generator=gen) + 0.5).bfloat16().cuda()
    s_ref, n_ref = reference(x, h, nw, 1e-6)
    s_got, n_got = add_rms_norm(x, h, nw, 1e-6)
    assert torch.equal(s_got, s_ref)
    assert (n_got == n_ref).float().mean().item() > 0.99 and rel_err(n_got, n_ref) < 1e-2
    assert not torch.equal(add_rms_norm(x, h, nw * 1.01, 1e-6)[1], n_got)  # the weight is applied
    # a MoE's shared expert output added in the same launch: as adding it first (bf16 + bf16), bit for bit
    a = torch.randn(T, N, generator=gen).bfloat16().cuda()
    s_add, n_add = add_rms_norm(x, h, nw, 1e-6, add=a)
    s_two, n_two = add_rms_norm(x, h + a, nw, 1e-6)
    assert torch.equal(s_add, s_two) and torch.equal(n_add, n_two) and not torch.equal(s_add, s_got)


@gpu
def test_mxfp4_moe_fused_shared_add_rounds_like_torch():
    from sparkchat.engine.kernels.mxfp4_moe import mxfp4_moe
    gen = torch.Generator().manual_seed(5)
    w13, s13, w2, s2 = (t.cuda() for t in make_experts(16, 256, 128, gen=gen))
    for T in (1, 4):
        ids, wts = make_routing(T, 8, 16, 2, gen)
        x = torch.randn(T, 256, generator=gen).bfloat16().cuda()
        shared = torch.randn(T, 256, generator=gen).bfloat16().cuda()
        out = mxfp4_moe(x, ids.cuda(), wts.cuda(), w13, s13, w2, s2, 0.0)
        assert torch.equal(mxfp4_moe(x, ids.cuda(), wts.cuda(), w13, s13, w2, s2, 0.0, add=shared), out + shared)


@gpu
@pytest.mark.parametrize("N,K", [(256, 256), (200, 144), (576, 512), (2560, 4096), (20480, 2560)])
@pytest.mark.parametrize("T", [1, 2, 4, 5])
@pytest.mark.parametrize("prefetch,split,bk,row_acc,kacc", [(False, 1, None, False, 0), (True, 1, None, False, 0),
                                                             (False, 4, 256, False, 0), (True, 2, 128, True, 0),
                                                             (False, 1, 512, True, 0), (False, 1, 512, False, 32),
                                                             (True, 4, 256, False, 16)])
def test_fp8_block_gemv_gpu(N, K, T, prefetch, split, bk, row_acc, kacc):
    from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv, gemv_config
    gen = torch.Generator().manual_seed(N * 7 + K + T)
    w, si = make_fp8(N, K, "cuda", gen)
    x = torch.randn(T, K, generator=gen).bfloat16().cuda()
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = gemv_config("block", T)
    fp8_block_gemv(x, w, si, out=out, config=type(cfg)(**{**cfg.__dict__, "prefetch": prefetch, "split": split,
                                                          "bk": bk or cfg.bk, "row_acc": row_acc, "kacc": kacc}))
    assert rel_err(out, ref.fp8_block_gemv_reference(x, w, si)) < 1e-2


@gpu
@pytest.mark.parametrize("N,K", [(200, 256), (2560, 4096), (20480, 2560), (1536, 2560), (2560, 768)])
@pytest.mark.parametrize("T", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("bn,warps,stages,split", [(64, 4, 3, 1), (128, 8, 4, 2), (32, 4, 2, 3)])
def test_fp8_mma_gemv_gpu(N, K, T, bn, warps, stages, split):
    """The tensor-core GEMV at the real shapes against the torch twin, every token on its own."""
    from sparkchat.engine.kernels.fp8_gemv import GemvConfig, fp8_block_gemv
    gen = torch.Generator().manual_seed(N + K + T)
    w, si = make_fp8(N, K, "cuda", gen)
    x = torch.randn(T, K, generator=gen).bfloat16().cuda()
    x[0, :3] *= 3e4
    x[-1] *= 1e-20
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = GemvConfig(bn=bn, rs=1, bk=128, warps=warps, stages=stages, split=split, mma=True)
    fp8_block_gemv(x, w, si, out=out, config=cfg)
    want = ref.fp8_block_gemv_reference(x, w, si)
    for t in range(T):
        assert rel_err(out[t], want[t]) < 1e-2, t


@gpu
@pytest.mark.parametrize("T,N,K,ahead", [(1, 2560, 4096, 1), (4, 2560, 4096, 3), (1, 20480, 2560, 4), (3, 200, 256, 9)])
def test_gemv_asking_l2_ahead_gives_the_same_bits_gpu(T, N, K, ahead):
    """GemvConfig.l2_ahead only asks L2 for lines: the FP8 GEMV (block scales; split-K and add+norm as the
    output projection runs) and the router's plain one give the same bits with it as without, also when it
    reaches past a program's last k step or the matrix's last row."""
    from dataclasses import replace

    from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv, gemv_config, plain_gemv_partials
    gen = torch.Generator().manual_seed(T + N + K)
    w, si = make_fp8(N, K, "cuda", gen)
    x = torch.randn(T, K, generator=gen).bfloat16().cuda()
    cfg = gemv_config("block", T, N, K)
    want = fp8_block_gemv(x, w, si, config=cfg)
    assert torch.equal(fp8_block_gemv(x, w, si, config=replace(cfg, l2_ahead=ahead)), want)
    if T > 1 and N >= 512:  # the tensor-core kernel, which asks from its first step
        mma = replace(cfg, bn=64, rs=1, bk=128, warps=4, split=1, mma=True, stages=3, row_acc=False, kacc=0)
        want = fp8_block_gemv(x, w, si, config=mma)
        assert torch.equal(fp8_block_gemv(x, w, si, config=replace(mma, l2_ahead=ahead)), want)
    wp = torch.randn(512, K, generator=gen).bfloat16().cuda()
    plain = gemv_config("plain", T, 512, K)
    assert torch.equal(plain_gemv_partials(x, wp, replace(plain, l2_ahead=ahead)), plain_gemv_partials(x, wp, plain))


@gpu
@pytest.mark.parametrize("T,N,K,pre", [(1, 2560, 4096, 2), (4, 2560, 4096, 2), (4, 2560, 4096, 4), (1, 6912, 2560, 2),
                                       (1, 512, 2560, 4)])
def test_gemv_steps_loaded_before_the_wait_give_the_same_bits_gpu(T, N, K, pre):
    """GemvConfig.pre at the shapes gpu_queue.sh's preload batch times: the tuned FMA GEMV with `pre` k steps
    held through its wait gives the bits of the tuned one (the output projections with their add and
    sums of squares, one token and a verify; MLA's input projection; the router's plain GEMV)."""
    from dataclasses import replace

    from sparkchat.engine.kernels.fp8_gemv import (fp8_block_gemv, fp8_block_gemv_add_norm, gemv_config,
                                                   plain_gemv_partials)
    gen = torch.Generator().manual_seed(T + N + K + pre)
    x = torch.randn(T, K, generator=gen).bfloat16().cuda()
    if N == 512:
        wp = torch.randn(512, K, generator=gen).bfloat16().cuda()
        cfg = gemv_config("plain", T, 512, K)
        assert torch.equal(plain_gemv_partials(x, wp, replace(cfg, pre=pre)), plain_gemv_partials(x, wp, cfg))
        return
    w, si = make_fp8(N, K, "cuda", gen)
    cfg = gemv_config("block", T, N, K)
    assert not cfg.mma
    assert torch.equal(fp8_block_gemv(x, w, si, config=replace(cfg, pre=pre)), fp8_block_gemv(x, w, si, config=cfg))
    if N == 2560:
        res = torch.randn(T, N, generator=gen).bfloat16().cuda()
        nw = (torch.rand(N, generator=gen) + 0.5).bfloat16().cuda()
        for got, want in zip(fp8_block_gemv_add_norm(x, w, si, res, nw, 1e-6, config=replace(cfg, pre=pre)),
                             fp8_block_gemv_add_norm(x, w, si, res, nw, 1e-6, config=cfg)):
            assert torch.equal(got, want)
        # as the step runs it: the sum and its sums of squares only, the norm left to its readers
        (s1, h1), (s0, h0) = (fp8_block_gemv_add_norm(x, w, si, res, nw, 1e-6, config=c, moe_x=True, split_norm=True)
                              for c in (replace(cfg, pre=pre), cfg))
        assert torch.equal(s1, s0) and torch.equal(h1.split_norm.ssq, h0.split_norm.ssq)


@gpu
def test_f16_acts_from_add_norm_gpu():
    """At the Ling shapes on four tokens: the add+norm kernels hand the tensor-core GEMVs their input in
    fp16 form (f16_block_acts), and the GEMVs give the same bits with it as without."""
    from sparkchat.engine.kernels.fp8_gemv import (add_rms_norm, f16_block_acts, fp8_block_gemv,
                                                   fp8_block_gemv_add_norm, gemv_config)
    gen = torch.Generator().manual_seed(11)
    wo, sio = make_fp8(2560, 4096, "cuda", gen)
    o = torch.randn(4, 4096, generator=gen).bfloat16().cuda()
    res = (torch.randn(4, 2560, generator=gen) * 3).bfloat16().cuda()
    nw = (torch.rand(2560, generator=gen) + 0.5).bfloat16().cuda()
    from sparkchat.engine.kernels.mxfp4_moe import pack_moe_x
    for T in (1, 4):
        _, h = fp8_block_gemv_add_norm(o[:T], wo, sio, res[:T], nw, 1e-6, moe_x=True)
        assert torch.equal(h.moe_x, pack_moe_x(h)), T  # the packed MoE stage 1's input
    for _, h in (add_rms_norm(res, res * 0.5, nw, 1e-6), fp8_block_gemv_add_norm(o, wo, sio, res, nw, 1e-6)):
        h16, hd = f16_block_acts(h)
        assert torch.equal(h.f16_acts[0], h16) and torch.equal(h.f16_acts[1], hd)
        for N in (20480, 6912, 1536):
            w, si = make_fp8(N, 2560, "cuda", gen)
            cfg = gemv_config("block", 4, N, 2560)
            assert cfg.mma
            assert torch.equal(fp8_block_gemv(h, w, si, x_f16=h.f16_acts), fp8_block_gemv(h, w, si)), N


@gpu
@pytest.mark.parametrize("T", [1, 4, 5])
def test_fp8_mma_head_gpu(T):
    from sparkchat.engine.kernels import fp8_head_argmax, fp8_head_gemv
    from sparkchat.engine.kernels.fp8_gemv import GemvConfig
    gen = torch.Generator().manual_seed(T)
    w, _ = make_fp8(157184, 2560, "cuda", gen)
    scale = (torch.rand(157184, generator=gen) * 0.02 + 0.01).cuda()
    x = torch.randn(T, 2560, generator=gen).bfloat16().cuda()
    want = ref.fp8_head_gemv_reference(x, w, scale)
    for cfg in (GemvConfig(bn=256, rs=1, bk=128, warps=8, stages=4, mma=True),
                GemvConfig(bn=128, rs=1, bk=128, warps=4, stages=3, mma=True)):
        assert rel_err(fp8_head_gemv(x, w, scale, config=cfg), want) < 1e-5, cfg
        tok = fp8_head_argmax(x, w, scale, config=cfg)
        picked = want.gather(1, tok[:, None])[:, 0]
        assert torch.allclose(picked, want.max(-1).values, rtol=1e-5, atol=1e-5), cfg


@gpu
@pytest.mark.parametrize("V,H", [(300, 256), (157184, 2560)])
@pytest.mark.parametrize("T", [1, 2, 4, 5])
def test_fp8_head_gpu(V, H, T):
    from sparkchat.engine.kernels import fp8_head_argmax, fp8_head_gemv
    gen = torch.Generator().manual_seed(V + T)
    w, _ = make_fp8(V, H, "cuda", gen)
    scale = (torch.rand(V, generator=gen) * 0.02 + 0.01).cuda()
    x = torch.randn(T, H, generator=gen).bfloat16().cuda()
    want = ref.fp8_head_gemv_reference(x, w, scale)
    logits = torch.full((T, V), float("nan"), device="cuda")
    fp8_head_gemv(x, w, scale, out=logits)
    assert rel_err(logits, want) < 1e-5
    tok = fp8_head_argmax(x, w, scale)
    assert tok.dtype == torch.int64 and tok.shape == (T,)
    picked = want.gather(1, tok[:, None])[:, 0]
    assert torch.allclose(picked, want.max(-1).values, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- Triton's CPU interpreter, tiny shapes
_INTERPRET_SCRIPT = textwrap.dedent("""
    import torch
    from sparkchat.engine.kernels import GemvConfig, fp8_block_gemv, fp8_head_argmax, fp8_head_gemv
    from sparkchat.engine.kernels.mxfp4_moe import mxfp4_moe
    from sparkchat.engine.kernels import reference as ref
    from sparkchat.engine.kernels.mxfp4_moe import MoeConfig
    from tests.test_kernels import make_experts, make_fp8, make_routing, rel_err
    gen = torch.Generator().manual_seed(0)
    w13, s13, w2, s2 = make_experts(6, 64, 32, gen=gen)
    for T, repeat, dedupe, limit, prefetch, packed, preload in [
            (1, 0, True, 0.0, False, False, False), (3, 2, True, 0.02, True, False, False),
            (2, 3, False, 0.0, False, False, False), (1, 0, False, 0.02, True, False, False),
            (1, 0, False, 0.02, False, True, False), (3, 2, False, 0.0, False, True, False),
            (1, 0, False, 0.0, True, True, True), (2, 1, False, 0.0, False, True, True)]:
        ids, wts = make_routing(T, 4, 6, repeat, gen)
        x = torch.randn(T, 64, generator=gen).bfloat16()
        cfg = MoeConfig(bn1=4, rs1=2, bkw1=8, bn2=8, rs2=2, bkw2=4, dedupe=dedupe, prefetch=prefetch, packed=packed,
                        preload1=preload, preload2=preload)
        out = mxfp4_moe(x, ids, wts, w13, s13, w2, s2, limit, config=cfg)
        if preload:  # every weight load issued up front: the same sums as the step-by-step loop
            step = MoeConfig(**{**cfg.__dict__, "preload1": False, "preload2": False})
            assert torch.equal(out, mxfp4_moe(x, ids, wts, w13, s13, w2, s2, limit, config=step)), T
        want = ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, limit)
        assert rel_err(out, want) < 1e-2, T
        shared = torch.randn(T, 64, generator=gen).bfloat16()
        added = mxfp4_moe(x, ids, wts, w13, s13, w2, s2, limit, config=cfg, add=shared)
        assert rel_err(added, out.float() + shared.float()) < 1e-2, T  # interpreter: bf16 casts truncate
    w, si = make_fp8(200, 96, gen=gen)
    x = torch.randn(2, 96, generator=gen).bfloat16()
    for prefetch in (False, True):
        cfg = GemvConfig(bn=16, rs=2, bk=64, prefetch=prefetch)
        assert rel_err(fp8_block_gemv(x, w, si, config=cfg), ref.fp8_block_gemv_reference(x, w, si)) < 1e-2
    # split-K, and k steps wider than a 128-column scale block (each column keeps its block's scale)
    wide, wide_si = make_fp8(136, 1024, gen=gen)
    xw = torch.randn(3, 1024, generator=gen).bfloat16()
    for cfg in (GemvConfig(bn=8, rs=1, bk=256, split=2), GemvConfig(bn=16, rs=2, bk=128, split=4, prefetch=True),
                GemvConfig(bn=8, rs=2, bk=512, split=1), GemvConfig(bn=8, rs=1, bk=128, split=2, row_acc=True),
                GemvConfig(bn=16, rs=1, bk=64, row_acc=True, prefetch=True),
                GemvConfig(bn=8, rs=1, bk=256, kacc=16, split=2)):
        got = fp8_block_gemv(xw, wide, wide_si, config=cfg)
        assert rel_err(got, ref.fp8_block_gemv_reference(xw, wide, wide_si)) < 1e-2, cfg
    # the residual add + RMSNorm of a decode window (bf16 casts truncate here: a tolerance)
    from sparkchat.engine.kernels.fp8_gemv import add_rms_norm
    from sparkchat.engine.nn.ops import add_rms_norm as add_rms_norm_reference
    xa, ha = torch.randn(3, 200, generator=gen).bfloat16(), torch.randn(3, 200, generator=gen).bfloat16()
    nwa = (torch.rand(200, generator=gen) + 0.5).bfloat16()
    for got, want in zip(add_rms_norm(xa, ha, nwa, 1e-6), add_rms_norm_reference(xa, ha, nwa, 1e-6)):
        assert rel_err(got, want) < 1e-2
    # the down projection reading its gate|up input and computing the clamped SwiGLU on the way in
    from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv_swiglu
    from sparkchat.engine.nn.moe import swiglu
    wd, wd_si = make_fp8(72, 256, gen=gen)
    gu = torch.randn(3, 640, generator=gen).bfloat16()
    for limit, cfg in ((0.0, None), (0.7, GemvConfig(bn=8, rs=1, bk=128, split=2)), (0.7, GemvConfig(bn=8, bk=64, row_acc=True))):
        act = swiglu(gu[:, :256].float(), gu[:, 384:640].float(), limit).bfloat16()
        got = fp8_block_gemv_swiglu(gu, 384, limit, wd, wd_si, config=cfg)
        assert rel_err(got, ref.fp8_block_gemv_reference(act, wd, wd_si)) < 1e-2, (limit, cfg)
    # an output projection with the residual add and RMSNorm after it, rounded as ops.add_rms_norm
    from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv_add_norm
    from sparkchat.engine.nn.ops import add_rms_norm
    res = torch.randn(3, 136, generator=gen).bfloat16()
    nw = (torch.rand(136, generator=gen) + 0.5).bfloat16()
    for cfg in (None, GemvConfig(bn=8, rs=1, bk=256, split=4), GemvConfig(bn=8, rs=1, bk=128, split=2, row_acc=True)):
        s_ref, h_ref = add_rms_norm(res, ref.fp8_block_gemv_reference(xw, wide, wide_si), nw, 1e-6)
        s_got, h_got = fp8_block_gemv_add_norm(xw, wide, wide_si, res, nw, 1e-6, config=cfg)
        assert rel_err(s_got, s_ref) < 1e-2 and rel_err(h_got, h_ref) < 1e-2, cfg
    scale = torch.rand(200, generator=gen) + 0.5
    want = ref.fp8_head_gemv_reference(x, w, scale)
    assert rel_err(fp8_head_gemv(x, w, scale), want) < 1e-5
    assert rel_err(fp8_head_gemv(x, w, scale, config=GemvConfig(bn=8, rs=1, bk=32, split=3)), want) < 1e-5
    assert torch.equal(fp8_head_argmax(x, w, scale), want.argmax(-1))
    print("interpreter ok")
""")


def _run_interpreted(script: str) -> None:
    """Run a test script in a fresh process under Triton's CPU interpreter; it prints "interpreter ok"."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "interpreter ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernels_under_triton_interpreter():
    _run_interpreted(_INTERPRET_SCRIPT)


_ADD_NORM_ADD_SCRIPT = textwrap.dedent("""
    import torch
    from sparkchat.engine.kernels.fp8_gemv import add_rms_norm
    from sparkchat.engine.nn.ops import add_rms_norm as reference
    gen = torch.Generator().manual_seed(4)
    for T, N in ((1, 256), (3, 200)):
        x = (torch.randn(T, N, generator=gen) * 3).bfloat16()
        h, a = torch.randn(T, N, generator=gen).bfloat16(), torch.randn(T, N, generator=gen).bfloat16()
        nw = (torch.rand(N, generator=gen) + 0.5).bfloat16()
        s_got, n_got = add_rms_norm(x, h, nw, 1e-6, add=a)
        s_ref, n_ref = reference(x, h + a, nw, 1e-6)
        # within a bf16 rounding of the torch op (the interpreter's bf16 casts round otherwise than torch's;
        # on the GPU, test_add_rms_norm_gpu checks the add bit for bit)
        for got, ref in ((s_got, s_ref), (n_got, n_ref)):
            assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
        s_without, _ = add_rms_norm(x, h, nw, 1e-6)
        assert (s_got.float() - s_without.float()).abs().max().item() > 0.5  # the add is there
    print("interpreter ok")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_add_norm_adding_a_second_output_under_triton_interpreter():
    """add_rms_norm's `add` (the shared expert's output, SPARKCHAT_SHARED_ADD_LATE) is the add done first."""
    _run_interpreted(_ADD_NORM_ADD_SCRIPT)


_TAIL_AT_ONCE_SCRIPT = textwrap.dedent("""
    import os
    import torch
    from sparkchat.engine.kernels import reference as ref
    from sparkchat.engine.kernels.mxfp4_moe import MoeConfig, mxfp4_moe, pack_moe_x
    from sparkchat.engine.nn.moe import swiglu
    from tests.test_kernels import make_experts, make_routing, make_small_shared, rel_err
    gen = torch.Generator().manual_seed(21)
    H, I, E, K = 64, 32, 6, 4
    w13, s13, w2, s2 = make_experts(E, H, I, gen=gen)
    sh = make_small_shared(H, I, gen)
    gu_w, gu_s, dn_w, dn_s = sh.gate_up, sh.gate_up_scale, sh.down, sh.down_scale
    packed = MoeConfig(bn1=8, rs1=1, bkw1=4, bn2=16, rs2=2, bkw2=4, dedupe=False, packed=True, packed_act=True,
                       vec1=True, vec2=True)
    # the 16-byte stages with the shared expert's down in stage 2; the k-loop stages (deduplicated
    # experts, two row tiles a program) with its output added
    for T, cfg, mode in ((3, packed, "shared"), (5, MoeConfig(bn1=8, rs1=1, bkw1=4, bn2=8, rs2=2, bkw2=4), "add")):
        ids, wts = make_routing(T, K, E, 1, gen)
        x = torch.randn(T, H, generator=gen).bfloat16()
        gu = ref.fp8_block_gemv_reference(x, gu_w, gu_s)
        y_sh = ref.fp8_block_gemv_reference(swiglu(gu[:, :I].float(), gu[:, 128:128 + I].float(), 0.5).bfloat16(),
                                            dn_w, dn_s)
        kw = dict(config=cfg, x_packed=pack_moe_x(x) if cfg.packed else None)
        kw.update(dict(shared=sh, shared_gate_up=gu, join=lambda: None) if mode == "shared" else dict(add=y_sh))
        outs = {}
        for bits in ("0", "2"):
            os.environ["SPARKCHAT_TAIL_AT_ONCE"] = bits
            outs[bits] = mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 0.02, **kw)
        # (the packed configs' products round to bf16: 1-1.5% from the fp32 twin at these sizes)
        want = ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, 0.02) + y_sh
        assert rel_err(outs["2"], want) < 3e-2, (T, mode)
        assert torch.equal(outs["2"], outs["0"]), (T, mode)
    print("interpreter ok")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_moe_slot_sum_with_every_token_at_once_under_triton_interpreter():
    """SPARKCHAT_TAIL_AT_ONCE bit 2: MoE stage 2's slot sum over every token at once gives the very output
    of the one-token-after-another sum, with the shared expert added or run inside (2-5 tokens)."""
    _run_interpreted(_TAIL_AT_ONCE_SCRIPT)


_MOE_X_SCRIPT = textwrap.dedent("""
    import torch
    from sparkchat.engine.kernels import reference as ref
    from sparkchat.engine.kernels.mxfp4_moe import MoeConfig, mxfp4_moe, pack_moe_x
    from tests.test_kernels import make_experts, make_routing, rel_err
    gen = torch.Generator().manual_seed(0)
    w13, s13, w2, s2 = make_experts(6, 64, 32, gen=gen)
    for T, repeat in ((1, 0), (2, 1)):
        ids, wts = make_routing(T, 4, 6, repeat, gen)
        x = torch.randn(T, 64, generator=gen).bfloat16()
        cfg = MoeConfig(bn1=8, rs1=1, bkw1=4, bn2=16, rs2=2, bkw2=4, dedupe=False, packed=True, packed_act=True)
        step = mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 0.02, config=cfg)  # stage 1's act in planes too
        assert rel_err(step, ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, 0.02)) < 1e-2, T
        xp = pack_moe_x(x)
        assert torch.equal(step, mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 0.02, config=cfg, x_packed=xp)), T
        vec = MoeConfig(**{**cfg.__dict__, "vec1": True, "vec2": True})
        tiled = mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 0.02, config=vec, x_packed=xp)
        assert rel_err(tiled, step) < 1e-3, T
        rows = MoeConfig(**{**vec.__dict__, "tile_x": False})  # the activations loaded as a row: same sums
        assert torch.equal(mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 0.02, config=rows, x_packed=xp), tiled), T
        if T == 1:  # stage 1 alone in 16-byte loads, x packed in the kernel itself
            vec1 = MoeConfig(**{**cfg.__dict__, "vec1": True})
            assert rel_err(mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 0.02, config=vec1), step) < 1e-3
    print("interpreter ok")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_moe_input_planes_and_vectorized_stages_under_triton_interpreter():
    """Packed activations in planes (the MoE input, pack_moe_x, and stage 1's act for stage 2) match the
    twin, and the stages in 16-byte loads (MoeConfig.vec1 / vec2) give the packed k loops' result."""
    _run_interpreted(_MOE_X_SCRIPT)


_SHARED_SCRIPT = textwrap.dedent("""
    import dataclasses
    import torch
    from sparkchat.engine.kernels import reference as ref
    from sparkchat.engine.kernels.mxfp4_moe import MoeConfig, mxfp4_moe, pack_moe_x, shared_fusable
    from sparkchat.engine.nn.moe import swiglu
    from tests.test_kernels import make_experts, make_routing, make_small_shared, rel_err
    gen = torch.Generator().manual_seed(0)
    H, I, E, K = 64, 32, 6, 4
    w13, s13, w2, s2 = make_experts(E, H, I, gen=gen)
    sh = make_small_shared(H, I, gen)
    gu_w, gu_s, dn_w, dn_s = sh.gate_up, sh.gate_up_scale, sh.down, sh.down_scale
    ids, wts = make_routing(1, K, E, 0, gen)
    x = torch.randn(1, H, generator=gen).bfloat16()
    gu = ref.fp8_block_gemv_reference(x, gu_w, gu_s)  # the shared MLP's kernels' roundings
    y_sh = ref.fp8_block_gemv_reference(swiglu(gu[:, :I].float(), gu[:, 128:128 + I].float(), 0.5).bfloat16(),
                                        dn_w, dn_s)
    want = ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, 0.02) + y_sh
    base = MoeConfig(bn1=8, rs1=1, bkw1=4, bn2=16, rs2=2, bkw2=4, dedupe=False, packed=True, packed_act=True)
    xp = pack_moe_x(x)
    for cfg in (base, dataclasses.replace(base, preload1=True, preload2=True),
                dataclasses.replace(base, vec1=True, vec2=True)):
        assert shared_fusable(sh, 1, H, I, cfg) and not shared_fusable(sh, 2, H, I, cfg)
        added = mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 0.02, config=cfg, add=y_sh, x_packed=xp)
        both = mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 0.02, config=cfg, shared=sh, x_packed=xp)
        joined = []
        down = mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 0.02, config=cfg, shared=sh, x_packed=xp,
                         shared_gate_up=gu, join=lambda: joined.append(1))
        assert rel_err(both, want) < 1e-2 and joined == [1], cfg
        # the shared expert's sums come out as the side stream's do, to the bf16 bit, at this size
        assert torch.equal(both, added) and torch.equal(down, added), cfg
    # a window of tokens: the down rows in stage 2 from the side stream's gate|up [T, rows]
    ids3, wts3 = make_routing(3, K, E, 1, gen)
    x3 = torch.randn(3, H, generator=gen).bfloat16()
    gu3 = ref.fp8_block_gemv_reference(x3, gu_w, gu_s)
    y3 = ref.fp8_block_gemv_reference(swiglu(gu3[:, :I].float(), gu3[:, 128:128 + I].float(), 0.5).bfloat16(),
                                      dn_w, dn_s)
    cfg3 = dataclasses.replace(base, packed=False, packed_act=False)
    assert shared_fusable(sh, 3, H, I, cfg3, stage1=False) and not shared_fusable(sh, 3, H, I, cfg3)
    added3 = mxfp4_moe(x3, ids3, wts3, w13, s13, w2, s2, 0.02, config=cfg3, add=y3)
    down3 = mxfp4_moe(x3, ids3, wts3, w13, s13, w2, s2, 0.02, config=cfg3, shared=sh, shared_gate_up=gu3,
                      join=lambda: None)
    assert torch.equal(down3, added3)
    moved = dataclasses.replace(sh, up=0)  # the gate rows read as up rows: the up offset is used
    assert not torch.equal(mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 0.02, config=base, shared=moved), both)
    assert not shared_fusable(dataclasses.replace(sh, down=dn_w[:, :16].contiguous()), 1, H, I, base)
    print("interpreter ok")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_shared_expert_inside_the_routed_stages_under_triton_interpreter():
    """mxfp4_moe's `shared`: the shared expert's FP8 gate|up and down run by extra programs of the two
    stages (or only its down, from a side-stream gate|up) give the twin's result, and the very output of
    the routed experts plus the shared MLP's kernels' output added in stage 2 (`add`)."""
    _run_interpreted(_SHARED_SCRIPT)


_ONE_SPLIT_ADD_NORM_SCRIPT = textwrap.dedent("""
    import torch
    from sparkchat.engine.kernels.fp8_gemv import GemvConfig, add_rms_norm, fp8_block_gemv, fp8_block_gemv_add_norm
    from tests.test_kernels import make_fp8
    gen = torch.Generator().manual_seed(4)
    N, K = 200, 256  # a partial last row block
    w, si = make_fp8(N, K, gen=gen)
    nw = (torch.rand(N, generator=gen) + 0.5).bfloat16()
    for T in (1, 3):
        x = torch.randn(T, K, generator=gen).bfloat16()
        res = (torch.randn(T, N, generator=gen) * 2).bfloat16()
        for cfg in (GemvConfig(bn=16, rs=1, bk=256, warps=2, split=1), GemvConfig(bn=8, rs=2, bk=64, warps=2, split=1)):
            # the same y; s rounded as the interpreter rounds fp32 -> bf16 in a kernel (truncating)
            s_ref = ((res.float() + fp8_block_gemv(x, w, si, config=cfg).float()).view(torch.int32) & -65536)
            s_ref = s_ref.view(torch.float32).bfloat16()
            s, h = fp8_block_gemv_add_norm(x, w, si, res, nw, 1e-6, config=cfg, split_norm=True)
            assert torch.equal(s, s_ref), (T, cfg)
            sq = h.split_norm.ssq
            tiles = (s.float() ** 2).reshape(T, -1)
            want = torch.nn.functional.pad(tiles, (0, sq.shape[1] * cfg.bn - N)).reshape(T, -1, cfg.bn).sum(-1)
            assert torch.allclose(sq, want, rtol=1e-5), (T, cfg)
            if T > 1:  # the whole norm in the launch (verify windows)
                s2, h2 = fp8_block_gemv_add_norm(x, w, si, res, nw, 1e-6, config=cfg)
                _, h_k = add_rms_norm(res, fp8_block_gemv(x, w, si, config=cfg), nw, 1e-6)  # the add+norm kernel
                # only the order the squares are summed in differs
                assert torch.equal(s2, s_ref) and (h2 == h_k).float().mean() > 0.95
                assert (h2.float() - h_k.float()).abs().max() < 0.05
    print("interpreter ok")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_one_split_add_norm_under_triton_interpreter():
    """An output projection's add+norm in one split (GemvConfig.split 1): the kernel adds the residual from
    its registers, no partials or arrival counter — s exactly residual + the GEMV's own output, the sums
    of squares those of s by row tile, the whole norm within a rounding of the add+norm's."""
    _run_interpreted(_ONE_SPLIT_ADD_NORM_SCRIPT)


_MOE_NORM_SCRIPT = textwrap.dedent("""
    import dataclasses
    import torch
    from sparkchat.engine.kernels.fp8_gemv import add_rms_norm
    from sparkchat.engine.kernels.mxfp4_moe import MoeConfig, mxfp4_moe, mxfp4_moe_add_norm
    from tests.test_kernels import make_experts, make_routing, make_small_shared
    gen = torch.Generator().manual_seed(0)
    H, I, E, K = 128, 32, 6, 4  # H: one whole 128-column block, for the fp16 form
    w13, s13, w2, s2 = make_experts(E, H, I, gen=gen)
    nw = (torch.rand(H, generator=gen) + 0.5).bfloat16()
    base = MoeConfig(bn1=8, rs1=1, bkw1=4, bn2=16, rs2=2, bkw2=4, dedupe=False, packed=True, packed_act=True)
    for T in (1, 2):
        ids, wts = make_routing(T, K, E, 1, gen)
        x = torch.randn(T, H, generator=gen).bfloat16()
        res = (torch.randn(T, H, generator=gen) * 2).bfloat16()
        for cfg in (base, dataclasses.replace(base, vec1=True, vec2=True))[:3 - T]:  # (the interpreter is slow)
            y = mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 0.02, config=cfg)
            s_ref, h_ref = add_rms_norm(res, y, nw, 1e-6)  # the add+norm kernel it replaces
            s_got, h_got = mxfp4_moe_add_norm(x, ids, wts, w13, s13, w2, s2, 0.02, res, nw, 1e-6, config=cfg)
            assert torch.equal(s_got, s_ref), (T, cfg)  # the same sum
            # only the order the squares are summed in differs
            assert (h_got == h_ref).float().mean() > 0.95 and (h_got.float() - h_ref.float()).abs().max() < 0.05
            assert hasattr(h_got, "f16_acts") == hasattr(h_ref, "f16_acts") == (T > 1)
            if T > 1:  # the tensor-core GEMVs' fp16 form, as the add+norm kernel writes it
                assert (h_got.f16_acts[0] == h_ref.f16_acts[0]).float().mean() > 0.95
    wrong = mxfp4_moe_add_norm(x, ids, wts, w13, s13, w2, s2, 0.02, res, nw * 2, 1e-6, config=base)[1]
    assert not torch.equal(wrong, h_got)  # the norm weight is applied
    # with the shared expert inside the stages too (one token)
    sh = make_small_shared(H, I, gen)
    y = mxfp4_moe(x[:1], ids[:1], wts[:1], w13, s13, w2, s2, 0.02, config=base, shared=sh)
    s_got, _ = mxfp4_moe_add_norm(x[:1], ids[:1], wts[:1], w13, s13, w2, s2, 0.02, res[:1], nw, 1e-6, config=base,
                                  shared=sh)
    assert torch.equal(s_got, add_rms_norm(res[:1], y, nw, 1e-6)[0])
    print("interpreter ok")
""")


_SPLIT_NORM_SCRIPT = textwrap.dedent("""
    import torch
    from sparkchat.engine.kernels.fp8_gemv import GemvConfig, SplitNorm, fp8_block_gemv
    from sparkchat.engine.kernels.mxfp4_moe import MoeConfig, mxfp4_moe_add_norm, mxfp4_moe_add_sumsq
    from tests.test_kernels import make_experts, make_fp8, make_routing
    gen = torch.Generator().manual_seed(2)
    H, I, E, K, N = 256, 32, 6, 4, 64
    w13, s13, w2, s2 = make_experts(E, H, I, gen=gen)
    w, si = make_fp8(N, H, gen=gen)
    nw = (torch.rand(H, generator=gen) + 0.5).bfloat16()
    cfg = MoeConfig(bn1=8, rs1=1, bkw1=4, bn2=16, rs2=2, bkw2=4, dedupe=False, packed=True, packed_act=True)
    ids, wts = make_routing(1, K, E, 0, gen)
    x = torch.randn(1, H, generator=gen).bfloat16()
    res = (torch.randn(1, H, generator=gen) * 2).bfloat16()
    s_full, h_full = mxfp4_moe_add_norm(x, ids, wts, w13, s13, w2, s2, 0.02, res, nw, 1e-6, config=cfg)
    s, ssq = mxfp4_moe_add_sumsq(x, ids, wts, w13, s13, w2, s2, 0.02, res, config=cfg)
    assert torch.equal(s, s_full) and ssq.shape == (1, H // 16)  # one sum of squares a 16-row tile
    split = SplitNorm(s, ssq, nw, 1e-6)
    for gcfg in (GemvConfig(bn=16, rs=1, bk=128, warps=2, split=1, kacc=32),  # the norm finished in the GEMV
                 GemvConfig(bn=8, rs=1, bk=64, warps=2, split=1, prefetch=True),
                 GemvConfig(bn=16, rs=1, bk=64, warps=2, split=2),  # split-K: each split writes its columns
                 GemvConfig(bn=16, rs=1, bk=64, warps=4, split=1, mma=True)):  # finished by its own launch
        h = torch.full_like(s, float("nan"))
        got = fp8_block_gemv(h, w, si, split_norm=split, config=gcfg)
        want = fp8_block_gemv(h_full, w, si, config=gcfg)
        # the same norm as stage 2's last block gives, up to the order the squares are summed in
        assert (h == h_full).float().mean() > 0.95 and (h.float() - h_full.float()).abs().max() < 0.05, gcfg
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2, gcfg
        assert torch.equal(got, fp8_block_gemv(h.clone(), w, si, config=gcfg)), gcfg  # it read the h it wrote
    wrong = SplitNorm(s, ssq * 4, nw, 1e-6)
    assert not torch.equal(fp8_block_gemv(torch.empty_like(s), w, si, split_norm=wrong), got)
    print("interpreter ok")
""")


_SPLIT_MOE_INPUT_SCRIPT = textwrap.dedent("""
    import dataclasses
    import torch
    from sparkchat.engine.kernels.fp8_gemv import (GemvConfig, fp8_block_gemv, fp8_block_gemv_add_norm,
                                                   plain_gemv_partials, take_split_norm)
    from sparkchat.engine.kernels.mxfp4_moe import pack_moe_x
    from tests.test_kernels import make_fp8
    gen = torch.Generator().manual_seed(6)
    H, D = 256, 128  # hidden, the attention output's width
    wo, so = make_fp8(H, D, gen=gen)  # the output projection
    wg, sg = make_fp8(64, H, gen=gen)  # a shared expert's gate|up
    wr = (torch.randn(16, H, generator=gen) / 16).bfloat16()  # the router
    nw = (torch.rand(H, generator=gen) + 0.5).bfloat16()
    ocfg = GemvConfig(bn=8, rs=1, bk=64, warps=2, split=2)
    rcfg = GemvConfig(bn=4, rs=1, bk=64, warps=1, split=2)
    fma = GemvConfig(bn=16, rs=1, bk=64, warps=2, split=2)
    mma = GemvConfig(bn=32, rs=1, bk=64, warps=4, mma=True, split=2)  # a verify window's shared gate|up
    close = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2
    for T, gcfg in ((1, fma), (4, fma), (4, mma), (2, mma), (5, mma)):
        o = torch.randn(T, D, generator=gen).bfloat16()
        res = (torch.randn(T, H, generator=gen) * 2).bfloat16()
        s_ref, h_ref = fp8_block_gemv_add_norm(o, wo, so, res, nw, 1e-6, config=ocfg, moe_x=True)
        s, h = fp8_block_gemv_add_norm(o, wo, so, res, nw, 1e-6, config=ocfg, moe_x=True, split_norm=True)
        assert torch.equal(s, s_ref) and h.split_norm.ssq.shape == (T, H // 8)
        h.fill_(float("nan")); h.moe_x.fill_(float("nan"))
        # the shared expert beside the router: applies the norm (the tensor-core kernel has it written
        # into a tensor of its own first), writes neither h nor its planes
        view = h.view_as(h)
        view.split_norm = dataclasses.replace(h.split_norm, write=False)
        shared = fp8_block_gemv(view, wg, sg, split_norm=take_split_norm(view), config=gcfg)
        assert torch.isnan(h).all() and torch.isnan(h.moe_x).all(), T
        # the router's GEMV: applies the norm and writes it, and the MoE stage 1's packed planes
        logits = plain_gemv_partials(h, wr, rcfg, split_norm=take_split_norm(h))
        assert not hasattr(h, "split_norm")
        assert (h == h_ref).float().mean() > 0.95 and close(h, h_ref), T  # up to the squares' summation order
        assert torch.equal(h.moe_x, pack_moe_x(h)), T  # the planes of the very h it wrote
        assert close(shared, fp8_block_gemv(h_ref, wg, sg, config=gcfg)), T
        assert close(logits.sum(0), plain_gemv_partials(h_ref, wr, rcfg).sum(0)), T
    print("interpreter ok")
""")


_PRE_SCRIPT = textwrap.dedent("""
    import dataclasses
    import torch
    from sparkchat.engine.kernels import reference as ref
    from sparkchat.engine.kernels.fp8_gemv import (GemvConfig, fp8_block_gemv, fp8_block_gemv_add_norm,
                                                   plain_gemv_partials, take_split_norm)
    from tests.test_kernels import make_fp8, rel_err
    gen = torch.Generator().manual_seed(8)
    pre = lambda cfg, n: dataclasses.replace(cfg, pre=n)
    w, si = make_fp8(136, 1024, gen=gen)
    for T in (1, 3):
        x = torch.randn(T, 1024, generator=gen).bfloat16()
        want = ref.fp8_block_gemv_reference(x, w, si)
        # (config, k steps loaded before the wait): 2 of 2 a split, more than a split has (clamped), 3 of
        # 4 with per-row sums, 2 of 2 with [bn, kacc] sums, 4 of 8 over two row tiles, and with the
        # software-pipelined loop, which keeps its one step
        for cfg, n in ((GemvConfig(bn=8, rs=1, bk=256, split=2), 2), (GemvConfig(bn=8, rs=1, bk=256, split=2), 5),
                       (GemvConfig(bn=8, rs=1, bk=128, split=2, row_acc=True), 3),
                       (GemvConfig(bn=8, rs=1, bk=256, kacc=16, split=2), 2), (GemvConfig(bn=8, rs=2, bk=128), 4),
                       (GemvConfig(bn=16, rs=2, bk=128, split=4, prefetch=True), 2)):
            base = fp8_block_gemv(x, w, si, config=cfg)
            got = fp8_block_gemv(x, w, si, config=pre(cfg, n))
            assert torch.equal(got, base), (T, cfg, n)  # the same steps summed in the same order
            assert rel_err(got, want) < 1e-2, (T, cfg, n)
        # K = 96, not a whole number of steps: one whole step and a part (64), or less than one (128)
        xs = x[:, :96].contiguous()
        ws_, ss_ = w[:, :96].contiguous(), si[:, :1].contiguous()
        for cfg in (GemvConfig(bn=8, rs=1, bk=64), GemvConfig(bn=8, rs=1, bk=128)):
            base = fp8_block_gemv(xs, ws_, ss_, config=cfg)
            assert torch.equal(fp8_block_gemv(xs, ws_, ss_, config=pre(cfg, 2)), base), (T, cfg)
            assert rel_err(base, ref.fp8_block_gemv_reference(xs, ws_, ss_)) < 1e-2, (T, cfg)
        # the output projection with the add and the norm, split 4 (two steps a split)
        res = torch.randn(T, 136, generator=gen).bfloat16()
        nw = (torch.rand(136, generator=gen) + 0.5).bfloat16()
        ocfg = GemvConfig(bn=8, rs=1, bk=128, split=4)
        s0, h0 = fp8_block_gemv_add_norm(x, w, si, res, nw, 1e-6, config=ocfg)
        s1, h1 = fp8_block_gemv_add_norm(x, w, si, res, nw, 1e-6, config=pre(ocfg, 2))
        assert torch.equal(s0, s1) and torch.equal(h0, h1), T
    # the router's plain GEMV finishing the MoE input norm (its activations: the norm's output, written to
    # h as they load) with all four of its steps before the wait
    H, D = 256, 128
    wo, so = make_fp8(H, D, gen=gen)
    wr = (torch.randn(16, H, generator=gen) / 16).bfloat16()
    nw = (torch.rand(H, generator=gen) + 0.5).bfloat16()
    ocfg, rcfg = GemvConfig(bn=8, rs=1, bk=64, warps=2, split=2), GemvConfig(bn=4, rs=1, bk=32, warps=1, split=2)
    o = torch.randn(1, D, generator=gen).bfloat16()
    res = (torch.randn(1, H, generator=gen) * 2).bfloat16()
    outs = []
    for n in (1, 4):
        _, h = fp8_block_gemv_add_norm(o, wo, so, res, nw, 1e-6, config=ocfg, moe_x=True, split_norm=True)
        h.fill_(float("nan"))
        logits = plain_gemv_partials(h, wr, pre(rcfg, n), split_norm=take_split_norm(h))
        assert not torch.isnan(h).any(), n  # every column of h written, the pre-wait steps' too
        outs.append((h.clone(), logits))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    print("interpreter ok")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_gemv_steps_loaded_before_the_wait_under_triton_interpreter():
    """GemvConfig.pre: k steps of weights loaded before the PDL wait give the very sums of the
    step-by-step loop (split-K, per-row and kacc sums, two row tiles, add+norm, the router finishing
    the MoE input norm); the software-pipelined loop ignores it."""
    _run_interpreted(_PRE_SCRIPT)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_moe_input_norm_finished_by_the_router_under_triton_interpreter():
    """SPARKCHAT_SPLIT_MOE_INPUT_NORM=1 (and SPARKCHAT_SPLIT_NORM_WINDOW for verify windows): the output
    projection writes s and its sums of squares; the shared expert's GEMV applies the norm without
    writing it, the router's GEMV applies it and writes h and stage 1's planes."""
    _run_interpreted(_SPLIT_MOE_INPUT_SCRIPT)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_next_layers_projection_finishing_the_moe_norm_under_triton_interpreter():
    """SPARKCHAT_MOE_ADD_NORM=2: stage 2 adds the residual and writes the sums of squares
    (mxfp4_moe_add_sumsq); the next projection's GEMV applies the norm as it loads s and writes h."""
    _run_interpreted(_SPLIT_NORM_SCRIPT)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_moe_with_the_next_norm_in_stage_2_under_triton_interpreter():
    """mxfp4_moe_add_norm: stage 2's last programs add the layer's output to the residual and run the next
    RMSNorm, giving what the add+norm kernel after the layer gives (the same sum; the norm but for the
    order its squares are summed in; the fp16 form for verify windows)."""
    _run_interpreted(_MOE_NORM_SCRIPT)


_MMA_SCRIPT = textwrap.dedent("""
    import torch
    from sparkchat.engine.kernels import GemvConfig, fp8_block_gemv, fp8_head_argmax, fp8_head_gemv
    from sparkchat.engine.kernels import reference as ref
    from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv_add_norm, fp8_block_gemv_swiglu
    from sparkchat.engine.nn.moe import swiglu
    from sparkchat.engine.nn.ops import add_rms_norm
    from tests.test_kernels import make_fp8, rel_err
    gen = torch.Generator().manual_seed(1)
    w, si = make_fp8(200, 512, gen=gen)  # 200 rows: the last 64-row tile is partly masked
    for T in (1, 4, 5):
        x = torch.randn(T, 512, generator=gen).bfloat16()
        # columns far apart in magnitude: fp16 holds them only under the per-token power of two
        x[0, :5] *= 3e4
        x[-1] *= 1e-20  # a whole token below fp16's smallest subnormal
        want = ref.fp8_block_gemv_reference(x, w, si)
        for cfg in (GemvConfig(bn=64, rs=1, bk=128, warps=4, mma=True, stages=2),
                    GemvConfig(bn=32, rs=1, bk=64, warps=4, mma=True, split=2),
                    GemvConfig(bn=128, rs=1, bk=128, warps=8, mma=True, split=4, stages=1)):
            got = fp8_block_gemv(x, w, si, config=cfg)
            assert rel_err(got, want) < 1e-2, (T, cfg)
            for t in range(T):  # each token on its own, tiny ones included
                assert rel_err(got[t], want[t]) < 1e-2, (T, t, cfg)
    wd, wd_si = make_fp8(72, 256, gen=gen)
    gu = torch.randn(4, 640, generator=gen).bfloat16()
    act = swiglu(gu[:, :256].float(), gu[:, 384:640].float(), 0.7).bfloat16()
    got = fp8_block_gemv_swiglu(gu, 384, 0.7, wd, wd_si, config=GemvConfig(bn=32, rs=1, bk=128, mma=True, split=2))
    assert rel_err(got, ref.fp8_block_gemv_reference(act, wd, wd_si)) < 1e-2
    xw = torch.randn(4, 512, generator=gen).bfloat16()
    res = torch.randn(4, 200, generator=gen).bfloat16()
    nw = (torch.rand(200, generator=gen) + 0.5).bfloat16()
    s_ref, h_ref = add_rms_norm(res, ref.fp8_block_gemv_reference(xw, w, si), nw, 1e-6)
    s_got, h_got = fp8_block_gemv_add_norm(xw, w, si, res, nw, 1e-6,
                                           config=GemvConfig(bn=64, rs=1, bk=128, mma=True, split=4))
    assert rel_err(s_got, s_ref) < 1e-2 and rel_err(h_got, h_ref) < 1e-2
    # a norm's output in the tensor-core kernel's fp16 form (f16_block_acts, made by the add+norm kernel)
    from sparkchat.engine.kernels.fp8_gemv import add_rms_norm as add_norm_kernel, f16_block_acts
    w2, si2 = make_fp8(200, 256, gen=gen)
    res2 = (torch.randn(4, 256, generator=gen) * 3).bfloat16()
    res2[1, :128] *= 1e-12  # one block far below the other: each block gets its own power of two
    _, h2 = add_norm_kernel(res2, torch.randn(4, 256, generator=gen).bfloat16(), nw[:128].repeat(2), 1e-6)
    h16, hd = f16_block_acts(h2)
    assert torch.equal(h2.f16_acts[0], h16) and torch.equal(h2.f16_acts[1], hd)
    assert torch.equal((h16.float().view(4, 2, 128) * hd[..., None]).view(4, 256), h2.float())  # exact
    assert not hasattr(add_norm_kernel(res2[:1], res2[:1], nw[:128].repeat(2), 1e-6)[1], "f16_acts")  # one token
    s3, h3 = fp8_block_gemv_add_norm(xw, w, si, res, nw, 1e-6, moe_x=True)
    assert not hasattr(h3, "f16_acts")  # 200 columns: not whole 128-column blocks
    from sparkchat.engine.kernels.mxfp4_moe import pack_moe_x
    assert torch.equal(h3.moe_x, pack_moe_x(h3))  # the MoE's packed input too
    for cfg in (GemvConfig(bn=64, rs=1, bk=128, warps=4, mma=True, stages=2),
                GemvConfig(bn=32, rs=1, bk=64, warps=4, mma=True, split=2)):
        plain = fp8_block_gemv(h2, w2, si2, config=cfg)
        assert torch.equal(fp8_block_gemv(h2, w2, si2, config=cfg, x_f16=h2.f16_acts), plain), cfg
        wrong = (h2.f16_acts[0], h2.f16_acts[1] * 2)  # read, not ignored
        assert torch.equal(fp8_block_gemv(h2, w2, si2, config=cfg, x_f16=wrong).float(), 2 * plain.float()), cfg
    scale = torch.rand(200, generator=gen) + 0.5
    for cfg in (GemvConfig(bn=64, rs=1, bk=128, mma=True), GemvConfig(bn=128, rs=1, bk=256, warps=8, mma=True)):
        plain = fp8_head_gemv(h2, w2, scale, config=cfg)  # bk 256: two scale blocks a step, x_f16 unused
        assert torch.equal(fp8_head_gemv(h2, w2, scale, config=cfg, x_f16=h2.f16_acts), plain), cfg
    for T in (1, 4):
        x = torch.randn(T, 512, generator=gen).bfloat16()
        want = ref.fp8_head_gemv_reference(x, w, scale)
        for cfg in (GemvConfig(bn=64, rs=1, bk=128, mma=True), GemvConfig(bn=128, rs=1, bk=256, warps=8, mma=True, split=2)):
            assert rel_err(fp8_head_gemv(x, w, scale, config=cfg), want) < 1e-5, (T, cfg)
            assert torch.equal(fp8_head_argmax(x, w, scale, config=cfg), want.argmax(-1)), (T, cfg)
    print("interpreter ok")
""")


_FUSED_ADD_NORM_SCRIPT = textwrap.dedent("""
    import os
    import torch
    from sparkchat.engine.kernels import GemvConfig, fp8_gemv
    from sparkchat.engine.kernels.fp8_gemv import f16_block_acts, fp8_block_gemv_add_norm
    fp8_gemv.FUSED_ADD_NORM_MIN_TOKENS = 1  # the tail serves any window; the engine fuses verify windows
    from sparkchat.engine.kernels.mxfp4_moe import pack_moe_x
    from tests.test_kernels import make_fp8, rel_err
    gen = torch.Generator().manual_seed(3)
    for N, K in ((256, 512), (136, 1024)):
        w, si = make_fp8(N, K, gen=gen)
        nw = (torch.rand(N, generator=gen) + 0.5).bfloat16()
        for T in (1, 3):
            x = torch.randn(T, K, generator=gen).bfloat16()
            res = (torch.randn(T, N, generator=gen) * 2).bfloat16()
            for cfg in (GemvConfig(bn=8, rs=1, bk=128, split=4, kacc=16), GemvConfig(bn=16, rs=2, bk=64, split=2),
                        GemvConfig(bn=8, rs=1, bk=128, split=1, row_acc=True)):
                os.environ["SPARKCHAT_FUSED_ADD_NORM"] = "0"
                s2, h2 = fp8_block_gemv_add_norm(x, w, si, res, nw, 1e-6, config=cfg, moe_x=True)
                os.environ["SPARKCHAT_FUSED_ADD_NORM"] = "1"
                s1, h1 = fp8_block_gemv_add_norm(x, w, si, res, nw, 1e-6, config=cfg, moe_x=True)
                assert torch.equal(s1, s2), (N, T, cfg)  # the same partials summed in the same order
                # only the order the squares are summed in differs
                assert (h1 == h2).float().mean() > 0.95 and rel_err(h1, h2) < 1e-2, (N, T, cfg)
                assert torch.equal(h1.moe_x, pack_moe_x(h1))
                if T > 1 and N % 128 == 0:
                    h16, hd = f16_block_acts(h1)
                    assert torch.equal(h1.f16_acts[0], h16) and torch.equal(h1.f16_acts[1], hd)
                else:
                    assert not hasattr(h1, "f16_acts")
                wrong = fp8_block_gemv_add_norm(x, w, si, res, nw * 2, 1e-6, config=cfg)[1]
                assert not torch.equal(wrong, h1)  # the norm weight is applied
    print("interpreter ok")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_add_norm_under_triton_interpreter():
    """The output projection's GEMV doing the residual add and RMSNorm in its own last programs against
    the two-launch path: the same sum, the same norm but for the squares' summation order, and the
    tensor-core (F16) and MoE (packed) forms of the norm exactly as their twins make them; every call
    in the loop reuses the arrival counters, so they must come back to zero."""
    _run_interpreted(_FUSED_ADD_NORM_SCRIPT)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_mma_gemv_under_triton_interpreter():
    """fp8_mma_kernel (the tensor-core GEMV for verify windows) against the torch twins: block and row
    scales, split-K, masked row tiles, the SwiGLU and add+norm front ends, and activations spanning far
    more than fp16's range."""
    _run_interpreted(_MMA_SCRIPT)


def test_gemv_configs_are_the_measured_ones(monkeypatch):
    """The verify-window configs the engine picks on the H200 (132 SMs) are the ones measured fastest
    there (docs/benchmarks.md, sessions 6 and 10); one-token steps and small-N projections stay on FMAs."""
    pytest.importorskip("triton")
    from sparkchat.engine.kernels import fp8_gemv
    from sparkchat.engine.kernels.fp8_gemv import gemv_config
    monkeypatch.setattr(fp8_gemv, "_SMS", 132)
    picks = {shape: gemv_config(*shape) for shape in [("block", 4, 20480, 2560), ("block", 4, 6912, 2560),
                                                      ("block", 4, 12288, 2560), ("head", 4, 157184, 2560)]}
    got = {shape: (c.mma, c.bn, c.bk, c.warps, c.stages, c.split) for shape, c in picks.items()}
    assert got == {("block", 4, 20480, 2560): (True, 64, 128, 4, 3, 2),
                   ("block", 4, 6912, 2560): (True, 64, 128, 4, 3, 2),
                   ("block", 4, 12288, 2560): (True, 64, 128, 4, 3, 2),
                   ("head", 4, 157184, 2560): (True, 128, 128, 4, 3, 1)}
    assert gemv_config("block", 4, 1536, 2560).mma
    for shape in [("block", 1, 20480, 2560), ("head", 1, 157184, 2560), ("block", 4, 2560, 4096),
                  ("block", 4, 2560, 768)]:
        assert not gemv_config(*shape).mma, shape


def test_narrow_accumulator_width_must_divide_the_k_step():
    """kacc narrows the accumulators only where it divides the k step; a small K that shrinks the step to
    kacc columns or fewer falls back to [bn, bk] accumulators, a kacc that does not divide it is refused."""
    pytest.importorskip("triton")
    from sparkchat.engine.kernels.fp8_gemv import GemvConfig, _kacc
    assert _kacc(GemvConfig(bk=512, kacc=32), 512) == 32
    assert _kacc(GemvConfig(bk=512, kacc=32), 32) == 0  # K = 32: one 32-column step
    assert _kacc(GemvConfig(bk=512), 512) == 0
    with pytest.raises(AssertionError, match="kacc=48"):
        _kacc(GemvConfig(bk=512, kacc=48), 512)


def test_gemv_config_overrides_take_one_shape_and_refuse_typos(monkeypatch):
    """SPARKCHAT_GEMV_CONFIG changes only the named shape's fields; a malformed item says what it wants."""
    from sparkchat.engine.kernels.fp8_gemv import gemv_config

    monkeypatch.delenv("SPARKCHAT_GEMV_CONFIG", raising=False)
    router, o_proj = gemv_config("plain", 1, 512, 2560), gemv_config("block", 1, 2560, 4096)
    router4 = gemv_config("plain", 4, 512, 2560)
    monkeypatch.setenv("SPARKCHAT_GEMV_CONFIG", "plain.1.512.2560.split:5/plain.1.512.2560.bn:8")
    changed = gemv_config("plain", 1, 512, 2560)
    assert (changed.split, changed.bn, changed.bk) == (5, 8, router.bk)
    assert gemv_config("block", 1, 2560, 4096) == o_proj and gemv_config("plain", 4, 512, 2560) == router4
    for bad in ("plain.1.512.split:5", "plain.1.512.2560.splits:5", "plain.1.512.2560.split:x"):
        monkeypatch.setenv("SPARKCHAT_GEMV_CONFIG", bad)
        with pytest.raises(ValueError, match="SPARKCHAT_GEMV_CONFIG"):
            gemv_config("plain", 1, 512, 2560)


def test_weight_eviction_reads_one_bit_a_kind_of_stream(monkeypatch):
    from sparkchat.engine.kernels import overrides
    from sparkchat.engine.kernels.overrides import weight_eviction

    monkeypatch.delenv("SPARKCHAT_WEIGHT_EVICT", raising=False)
    assert weight_eviction(1) == weight_eviction(2, torch.device("cpu")) == ""  # unset: off but on sm_90
    monkeypatch.setattr(overrides, "is_sm90", lambda device: True)
    assert weight_eviction(1, torch.device("cuda")) == weight_eviction(2, torch.device("cuda")) == "evict_first"
    monkeypatch.setenv("SPARKCHAT_WEIGHT_EVICT", "0")  # profile_step's "off"
    assert weight_eviction(1, torch.device("cuda")) == weight_eviction(2, torch.device("cuda")) == ""
    monkeypatch.setenv("SPARKCHAT_WEIGHT_EVICT", "1")
    assert (weight_eviction(1), weight_eviction(2)) == ("evict_first", "")
    monkeypatch.setenv("SPARKCHAT_WEIGHT_EVICT", "2")
    assert (weight_eviction(1), weight_eviction(2)) == ("", "evict_first")
    monkeypatch.setenv("SPARKCHAT_WEIGHT_EVICT", "3")
    assert weight_eviction(1) == weight_eviction(2) == "evict_first"
    monkeypatch.setenv("SPARKCHAT_WEIGHT_EVICT", "first")  # not a number: off, never an unknown policy
    assert weight_eviction(1, torch.device("cuda")) == ""


def test_moe_stages_take_the_one_token_or_the_window_eviction_bit(monkeypatch):
    """A verify window's MoE stages are hinted only with bit 4: its slots may share an expert and re-read
    it from L2 (real routing repeats experts), which the one-token step's bit 1 must not drop."""
    pytest.importorskip("triton")
    from sparkchat.engine.kernels.mxfp4_moe import _plan, moe_config

    one, window = (_plan(T, 8, 2560, 768, moe_config(T, 2560, 768), True, x_packed=True) for T in (1, 4))
    cpu = torch.device("cpu")
    for bits, want in (("1", ("evict_first", "")), ("4", ("", "evict_first")), ("5", ("evict_first",) * 2),
                       ("0", ("", ""))):
        monkeypatch.setenv("SPARKCHAT_WEIGHT_EVICT", bits)
        assert (one.eviction(cpu), window.eviction(cpu)) == want, bits

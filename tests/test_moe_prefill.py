"""The grouped MXFP4 MoE GEMM for prefill (kernels.moe_prefill): its expert grouping on the CPU, the
kernel under Triton's CPU interpreter (when triton is installed) and on CUDA (when there is a GPU), and
the engine's prefill hook (fastpath.ExpertsKernel with more than 8 tokens).

Oracles and tolerances, as ||out - ref|| / ||ref|| over the whole output:
  - `emulate` (below): the kernel's own rounding points in torch (gate/up and the down projection in
    fp32 from exactly dequantized weights; the SwiGLU output, each slot's weighted down projection,
    the slot sum and the sum with `add` rounded to bf16): 2e-3 — only fp32 summation order differs,
    which now and then flips a bf16 rounding of the SwiGLU output;
  - reference.mxfp4_moe_reference (fp32 throughout, one rounding): 1e-2, as the decode kernel's tests;
  - Experts.forward, the engine's dequantize-then-matmul path (bf16 matmuls, bf16 accumulation): 2e-2.
Under the interpreter the kernel rounds to bf16 by hand (the interpreter's casts truncate), so the same
bounds hold there.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sparkchat.engine.kernels import reference as ref
from tests.test_kernels import make_experts, make_routing, rel_err

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = torch.cuda.is_available() and HAS_TRITON
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def emulate(x, ids, wts, w13, s13, w2, s2, limit, add=None):
    """The kernel's arithmetic in torch: fp32 GEMMs, bf16 at the kernel's rounding points."""
    T, K = ids.shape
    inter = w13.shape[1] // 2
    parts = torch.zeros(T, K, x.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        t, k = (ids == e).nonzero(as_tuple=True)
        gu = x[t].float() @ ref.dequant_mxfp4(w13[e], s13[e]).T
        h = ref.swiglu(gu[:, :inter], gu[:, inter:], limit).bfloat16().float()
        y = (h @ ref.dequant_mxfp4(w2[e], s2[e]).T) * wts[t, k].float()[:, None]
        parts[t, k] = y.bfloat16().float()
    out = parts.sum(1).bfloat16()
    return out if add is None else (out.float() + add.float()).bfloat16()


def experts_module(w13, s13, w2, s2, limit):
    from sparkchat.engine.nn.moe import Experts

    E, two_i, h2 = w13.shape
    ex = Experts(E, 2 * h2, two_i // 2, limit)
    ex.w13, ex.w13_scale, ex.w2, ex.w2_scale = w13, s13, w2, s2
    return ex


def skewed_routing(T, K, E, hot, gen):
    """Every token picks expert `hot` plus K-1 others: one expert's run spans several row blocks."""
    rows = [[hot] + [e for e in torch.randperm(E, generator=gen).tolist() if e != hot][: K - 1] for _ in range(T)]
    w = torch.rand(T, K, generator=gen) + 0.1
    return torch.tensor(rows, dtype=torch.int32), (w / w.sum(-1, keepdim=True) * 2.5).float()


# (E, H, I, K, T, limit, with_add, routing, config overrides): block sizes forced small so that experts span
# several row blocks and the k loops take several steps; shapes that are not powers of two; K = 3.
CASES = [
    (8, 64, 32, 2, 9, 0.0, False, "random", dict(bm=16, bn1=16, bk1=32, bn2=32, bk2=32)),
    (16, 128, 64, 4, 37, 0.05, True, "random", dict(bm=16, bn1=32, bk1=64, bn2=64, bk2=32)),
    (12, 160, 96, 3, 30, 0.05, True, "skewed", dict(bm=16, bn1=32, bk1=128, bn2=32, bk2=64)),
    (8, 256, 128, 2, 100, 0.0, True, "random", None),  # prefill_config's choice
    (32, 128, 64, 4, 20, 0.0, False, "random", None),
    (16, 128, 64, 4, 40, 0.05, False, "skewed", dict(bm=32, bn1=64, bk1=64, bn2=64, bk2=64, swap=False)),
]


def check_case(case, device, seed=0):
    from sparkchat.engine.kernels.moe_prefill import PrefillConfig, moe_prefill

    E, H, I, K, T, limit, with_add, routing, over = case
    gen = torch.Generator().manual_seed(seed + T)
    w13, s13, w2, s2 = (t.to(device) for t in make_experts(E, H, I, gen=gen))
    ids, wts = make_routing(T, K, E, 1, gen) if routing == "random" else skewed_routing(T, K, E, 3, gen)
    x = (torch.randn(T, H, generator=gen) * 2).bfloat16()
    add = (torch.randn(T, H, generator=gen) * 0.1).bfloat16() if with_add else None
    ids, wts, x = ids.to(device), wts.to(device), x.to(device)
    add = None if add is None else add.to(device)
    cfg = None if over is None else PrefillConfig(**over)
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=device)
    got = moe_prefill(x, ids, wts, w13, s13, w2, s2, limit, add=add, out=out, config=cfg)
    assert got is out and not got.isnan().any(), case
    routed = ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, limit)
    fp32 = routed if add is None else (routed.float() + add.float()).bfloat16()
    oracle = experts_module(w13, s13, w2, s2, limit)(x, ids.long(), wts)
    oracle = oracle if add is None else oracle + add
    twin = emulate(x, ids, wts, w13, s13, w2, s2, limit, add)
    errs = (rel_err(got, twin), rel_err(got, fp32), rel_err(got, oracle))
    assert errs[0] < 2e-3 and errs[1] < 1e-2 and errs[2] < 2e-2, (case, errs)
    if limit > 0:  # the clamp is live at these scales, so matching the twin means the kernel clamps
        assert rel_err(emulate(x, ids, wts, w13, s13, w2, s2, 0.0, add), twin) > 2e-2, (case, "clamp inactive")
    return errs


def check_hook(device):
    """fastpath.ExpertsKernel sends more than 8 tokens to moe_prefill, with the shared expert's add."""
    from sparkchat.engine.fastpath import ExpertsKernel

    gen = torch.Generator().manual_seed(11)
    E, H, I, K, T = 16, 128, 64, 4, 24
    w13, s13, w2, s2 = (t.to(device) for t in make_experts(E, H, I, gen=gen))
    ex = experts_module(w13, s13, w2, s2, 0.05)
    ids, wts = (t.to(device) for t in make_routing(T, K, E, 2, gen))
    x = torch.randn(T, H, generator=gen).bfloat16().to(device)
    add = (torch.randn(T, H, generator=gen) * 0.1).bfloat16().to(device)
    got = ExpertsKernel(ex)(x, ids.long(), wts, add=add)
    assert rel_err(got, emulate(x, ids, wts, w13, s13, w2, s2, 0.05, add)) < 2e-3
    assert rel_err(got, ex(x, ids.long(), wts) + add) < 2e-2


def run_all(device):
    if device == "cpu":
        torch.set_num_threads(1)  # tiny torch ops: threads only spin (CI has 2 cores)
    for case in CASES:
        check_case(case, device)
    check_hook(device)
    print("moe prefill ok")


# ---------------------------------------------------------------- CPU: the grouping
@needs_triton
@pytest.mark.parametrize("T,K,E,bm,skew", [(1, 1, 4, 16, False), (9, 2, 8, 16, False), (100, 4, 32, 16, True),
                                           (37, 8, 512, 64, False), (300, 3, 12, 32, True)])
def test_group_by_expert(T, K, E, bm, skew):
    from sparkchat.engine.kernels.moe_prefill import group_by_expert

    gen = torch.Generator().manual_seed(T)
    ids, _ = skewed_routing(T, K, E, 0, gen) if skew else make_routing(T, K, E, 0, gen)
    g = group_by_expert(ids, E, bm)
    flat = ids.reshape(-1).long()
    expert, start, rows = g.meta.long()
    assert g.meta.shape == (3, g.num_blocks) and g.num_blocks == -(-T * K // bm) + min(E, T * K)
    seen = []
    for b in range(g.num_blocks):
        if expert[b] < 0:
            assert rows[b] == 0
            continue
        assert 1 <= rows[b] <= bm
        slots = g.order[start[b]:start[b] + rows[b]].long()
        assert (flat[slots] == expert[b]).all()
        assert (slots.diff() > 0).all()  # stable: token order within an expert
        seen += slots.tolist()
    assert sorted(seen) == list(range(T * K))  # every (token, slot) exactly once
    used = (expert >= 0).nonzero().flatten()
    assert (used == torch.arange(len(used))).all()  # real blocks first, unused ones after
    assert len(used) == sum(-(-int(c) // bm) for c in torch.bincount(flat, minlength=E))


@needs_triton
def test_prefill_config_fits_shared_memory():
    from sparkchat.engine.kernels import moe_prefill as mp

    for T, bm in ((512, 16), (2048, 64), (8192, 128)):
        assert mp.prefill_config(T, 8, 512, 2560, 768).bm == bm
    mp_limit = mp._smem_limit
    try:  # the DGX Spark's ~99 KB per block
        mp._smem_limit = lambda device: 101376
        cfg = mp.prefill_config(8192, 8, 512, 2560, 768, "cuda")
        assert mp._smem_estimate(cfg.bm, cfg.bn1, cfg.bk1, cfg.stages1, 2) <= 101376
        assert mp._smem_estimate(cfg.bm, cfg.bn2, cfg.bk2, cfg.stages2, 1) <= 101376
    finally:
        mp._smem_limit = mp_limit


def test_emulation_matches_plain_float64():
    """The rounding twin itself against the float64 plain computation of test_kernels."""
    from tests.test_kernels import plain_moe

    gen = torch.Generator().manual_seed(4)
    w13, s13, w2, s2 = make_experts(6, 64, 32, gen=gen)
    ids, wts = make_routing(10, 3, 6, 1, gen)
    x = torch.randn(10, 64, generator=gen).bfloat16()
    for limit in (0.0, 0.05):
        want = plain_moe(x, ids, wts, w13, s13, w2, s2, limit)
        assert rel_err(emulate(x, ids, wts, w13, s13, w2, s2, limit), want) < 1e-2


# ---------------------------------------------------------------- Triton's CPU interpreter
@needs_triton
def test_moe_prefill_under_triton_interpreter():
    from tests.interpreter import run_interpreted

    r = run_interpreted("from tests.test_moe_prefill import run_all\nrun_all('cpu')\n", timeout=300)
    assert r.returncode == 0 and "moe prefill ok" in r.stdout, r.stderr[-3000:]


# ---------------------------------------------------------------- CUDA
@pytest.mark.skipif(not GPU, reason="needs a CUDA device and triton")
def test_moe_prefill_on_cuda():
    from sparkchat.engine.kernels.moe_prefill import moe_prefill, prefill_config, sweep_configs

    run_all("cuda")
    # the real shapes (512 experts, H 2560, I 768, top-8), every benchmark sweep config, clamp and add
    E, H, I, K = 512, 2560, 768, 8
    gen = torch.Generator().manual_seed(0)
    w13, s13, w2, s2 = (t.cuda() for t in make_experts(E, H, I, gen=gen))
    ex = experts_module(w13, s13, w2, s2, 4.0)
    for T in (9, 300, 2048):
        ids, wts = (t.cuda() for t in make_routing(T, K, E, 2, gen))
        x = (torch.randn(T, H, generator=gen) * 2).bfloat16().cuda()
        add = torch.randn(T, H, generator=gen).bfloat16().cuda()
        want = emulate(x, ids, wts, w13, s13, w2, s2, 4.0, add)
        oracle = ex(x, ids.long(), wts) + add
        cfgs = sweep_configs(T, K, E, H, I, "cuda") if T == 300 else [prefill_config(T, K, E, H, I, "cuda")]
        for cfg in cfgs:
            got = moe_prefill(x, ids, wts, w13, s13, w2, s2, 4.0, add=add, config=cfg)
            assert rel_err(got, want) < 2e-3 and rel_err(got, oracle) < 2e-2, (T, cfg, rel_err(got, want))
        again = moe_prefill(x, ids, wts, w13, s13, w2, s2, 4.0, add=add, config=cfgs[0])
        assert torch.equal(again, moe_prefill(x, ids, wts, w13, s13, w2, s2, 4.0, add=add, config=cfgs[0]))
    # skewed routing at the real shape: one expert spans T / bm blocks
    ids, wts = (t.cuda() for t in skewed_routing(1000, K, E, 7, gen))
    x = torch.randn(1000, H, generator=gen).bfloat16().cuda()
    got = moe_prefill(x, ids, wts, w13, s13, w2, s2, 0.0)
    assert rel_err(got, emulate(x, ids, wts, w13, s13, w2, s2, 0.0)) < 2e-3


@pytest.mark.skipif(not GPU, reason="needs a CUDA device and triton")
def test_moe_prefill_cuda_graph_capture():
    """No host sync anywhere (grouping included): the whole call captures in a CUDA graph and replays
    on new routing."""
    from sparkchat.engine.kernels.moe_prefill import moe_prefill

    gen = torch.Generator().manual_seed(1)
    E, H, I, K, T = 64, 512, 256, 8, 200
    w13, s13, w2, s2 = (t.cuda() for t in make_experts(E, H, I, gen=gen))
    ids, wts = (t.cuda() for t in make_routing(T, K, E, 0, gen))
    x = torch.randn(T, H, generator=gen).bfloat16().cuda()
    out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
    moe_prefill(x, ids, wts, w13, s13, w2, s2, 0.0, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_prefill(x, ids, wts, w13, s13, w2, s2, 0.0, out=out)
    new_ids, new_wts = (t.cuda() for t in make_routing(T, K, E, 3, gen))
    ids.copy_(new_ids)
    wts.copy_(new_wts)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, emulate(x, ids, wts, w13, s13, w2, s2, 0.0)) < 2e-3

"""The Triton MLA decode step (kernels.mla_decode: prepare, attention, merge + unfold + gate) against its
torch twin nn.mla.absorbed_step (mla_prepare, mla_absorbed with the equivalent boolean mask, the gate):
under Triton's CPU interpreter (when triton is installed) and on CUDA (when there is a GPU). Cache rows
past each query's position are filled with huge garbage, so a leak through the mask cannot hide; the
caches' new rows must match the twin's writes.

Tolerance, in units of 2^-8 x the output's max (at most one bf16 ulp there): both sides round to bf16 at
the same points (q_latent, probs, o_latent, output), but the twin also rounds its scores to bf16 (the
kernel keeps them fp32), so the twin itself is up to ~3 units off its own fp32 run (mla_absorbed on fp32
copies of the same inputs; the kernel: ~1). The kernel must be within 3 units of that fp32 run, and
within the twin's own error of it plus 3 units of the twin.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = torch.cuda.is_available() and HAS_TRITON

# (T, heads, rank, rope, nope, v, attend, positions, splits, block_n): positions inside the bucket with
# stale rows after them, buckets that are not whole blocks, several splits (some left empty).
CASES = [
    (1, 4, 32, 16, 16, 16, 70, [40], 3, 16),
    (2, 4, 32, 16, 16, 16, 100, [57, 58], 4, 16),
    (5, 4, 64, 16, 32, 16, 93, [60, 61, 62, 63, 64], 2, 32),
    (5, 8, 32, 32, 16, 32, 50, [3, 4, 5, 6, 7], 5, 16),  # short live length: most splits see nothing
    (1, 4, 32, 16, 16, 16, 33, [32], 1, 16),  # the whole bucket, one split
    (3, 4, 32, 16, 16, 16, 64, [10, 30, 63], 4, 16),  # tokens far apart (not a contiguous span)
    (2, 4, 32, 16, 16, 24, 40, [20, 21], 2, 16),  # v_dim not a power of two (the tiny test models')
]
REAL = (2, 32, 512, 64, 128, 128, 80, [70, 71], 2, 32)  # the model's per-head dims, a short bucket


def ulp_bound(want: torch.Tensor, n: float) -> float:
    return n * want.abs().amax().item() * 2.0 ** -8


def twin(q, kv_a, g, cos, sin, pos, C, KR, norm_w, eps, w_kv, attend, scale, nope, leak=False):
    """absorbed_step's composition, spelled out so a test can hand attention a leaky mask."""
    from sparkchat.engine.nn.mla import mla_absorbed, mla_prepare

    H, _, R = w_kv.shape
    q_nope, q_rope, gate = mla_prepare(q, kv_a, g, cos, sin, pos, C, KR, norm_w, eps, H, nope, KR.shape[1], R)
    mask = torch.arange(attend, device=q.device)[None, :] <= pos[:, None]
    if leak:
        mask[0, int(pos[0]) + 1] = True
    o = mla_absorbed(q_nope, q_rope, C[:attend], KR[:attend], w_kv, mask, scale, nope)
    return (o * gate.unsqueeze(-1)).reshape(q.shape[0], -1)


def inputs(T, H, R, P, NOPE, V, attend, positions, device, seed=0):
    """Projection outputs as row-strided views of one fused output (as the model hands them over), the
    rotary tables, caches whose rows past the last position (stale, or past the bucket) hold garbage
    that would dominate any score it leaked into, and a kv_b weight."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(torch.bfloat16).to(device)

    widths = [H * (NOPE + P), R + P, H]
    fused = rnd(T, sum(widths) + 8)  # +8: the row stride is not any one projection's width
    q, kv_a, gl = fused[:, :sum(widths)].split(widths, dim=-1)
    kv_a[:, :R] *= 3.0  # the latent's norm must matter
    rows = attend + 7
    C, KR = rnd(rows, R), rnd(rows, P)
    stale = max(positions) + 1
    C[stale:], KR[stale:] = 3e4, 3e4
    w_kv = rnd(H, NOPE + V, R, s=NOPE ** -0.5)
    norm_w = (1.0 + 0.1 * torch.randn(R, generator=g)).to(torch.bfloat16).to(device)
    freqs = torch.outer(torch.arange(rows, dtype=torch.float32), 1.0 / 1e4 ** (torch.arange(0, P, 2) / P))
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    return q, kv_a, gl, freqs.cos().to(device), freqs.sin().to(device), pos, C, KR, norm_w, 1e-6, w_kv


def check(T, H, R, P, NOPE, V, attend, positions, splits, block_n, device, *, seed=0, leak=False):
    """Kernels vs twin (and vs the twin's fp32 run) on one case; raises AssertionError on a mismatch.
    leak=True hands the twin's attention a mask that lets one stale row through (the check must fail)."""
    from sparkchat.engine.kernels.mla_decode import MlaDecodeConfig, mla_decode_step
    from sparkchat.engine.nn.mla import absorbed_step

    q, kv_a, gl, cos, sin, pos, C, KR, norm_w, eps, w_kv = inputs(T, H, R, P, NOPE, V, attend, positions, device,
                                                                 seed)
    scale = (NOPE + P) ** -0.5
    Ck, KRk = C.clone(), KR.clone()
    out = mla_decode_step(q, kv_a, gl, cos, sin, pos, Ck, KRk, norm_w, eps, w_kv, attend, scale, NOPE,
                          splits=splits, config=MlaDecodeConfig(block_n=block_n))
    assert out.shape == (T, H * V) and out.dtype == torch.bfloat16

    Ct, KRt = C.clone(), KR.clone()
    tw = twin(q, kv_a, gl, cos, sin, pos, Ct, KRt, norm_w, eps, w_kv, attend, scale, NOPE, leak=leak).float()
    if not leak:  # the model's reference path is this composition
        C2, KR2 = C.clone(), KR.clone()
        ref = absorbed_step(q, kv_a, gl, cos, sin, pos, C2, KR2, norm_w, eps, w_kv, attend, scale, NOPE)
        assert torch.equal(ref.float(), tw) and torch.equal(C2, Ct) and torch.equal(KR2, KRt)
    # the caches: written at the positions only, the rope key exactly, the normed latent within an ulp
    assert torch.equal(KRk, KRt), "rope key cache differs"
    assert torch.equal(Ck[pos.max() + 1:], C[pos.max() + 1:]) and torch.equal(KRk[pos.max() + 1:], KR[pos.max() + 1:])
    lat_gap = (Ck.float() - Ct.float()).abs() - Ct.float().abs() * 2.0 ** -7
    assert lat_gap.max().item() <= 0, "latent cache off by more than one bf16 ulp"
    f32 = [x.float() if x.is_floating_point() else x for x in (q, kv_a, gl, cos, sin, pos, C.clone(), KR.clone(),
                                                                 norm_w)]
    want = twin(*f32, eps, w_kv.float(), attend, scale, NOPE, leak=leak)
    out = out.float()
    assert torch.isfinite(out).all()
    err, twin_err = (out - want).abs().max().item(), (tw - want).abs().max().item()
    case = (T, H, R, P, attend, positions, splits)
    assert err <= ulp_bound(want, 3), f"{case}: kernel off the fp32 twin by {err:.3g} (twin: {twin_err:.3g})"
    gap = (out - tw).abs().max().item()
    assert gap <= twin_err + ulp_bound(tw, 3), f"{case}: kernel off the bf16 twin by {gap:.3g}"
    return err / ulp_bound(want, 1), twin_err / ulp_bound(want, 1)


def same_in_every_combine_mode(T, H, R, P, NOPE, V, attend, positions, splits, block_n, device) -> None:
    """The merge + unfold with a window's tokens all made before any is stored (combine 1) or in a program
    each (combine 2) gives one token after another's output (combine 0) bit for bit."""
    from sparkchat.engine.kernels.mla_decode import MlaDecodeConfig, mla_decode_step

    outs = []
    for mode in (0, 1, 2):
        q, kv_a, gl, cos, sin, pos, C, KR, norm_w, eps, w_kv = inputs(T, H, R, P, NOPE, V, attend, positions,
                                                                     device, seed=1)
        outs.append(mla_decode_step(q, kv_a, gl, cos, sin, pos, C, KR, norm_w, eps, w_kv, attend, (NOPE + P) ** -0.5,
                                    NOPE, splits=splits, config=MlaDecodeConfig(block_n=block_n, combine=mode)))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), (T, positions)


def run_all(device: str) -> None:
    for case in CASES:
        check(*case, device)
    check(*REAL, device)
    for case in [*CASES, REAL]:
        if case[0] > 1:
            same_in_every_combine_mode(*case, device)
    # The check has teeth: a twin that lets one garbage row through must not match the kernel.
    try:
        check(*CASES[0], device, leak=True)
    except AssertionError:
        pass
    else:
        raise AssertionError("a leaked stale row went unnoticed")
    print("mla kernel ok")


def run_model(path: str) -> None:
    """The hook in MultiLatentAttention.forward: a tiny model's decode and verify steps hand fast_step
    absorbed_step's inputs, and the kernels' answer (and cache writes) match the twin's."""
    from sparkchat.engine.config import ModelConfig
    from sparkchat.engine.generate import Decoder
    from sparkchat.engine.kernels.mla_decode import mla_decode_step
    from sparkchat.engine.loader import load_model
    from sparkchat.engine.nn.mla import MultiLatentAttention, absorbed_step
    from sparkchat.engine.state import ConversationState

    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, "cpu", torch.bfloat16, 64)
    seen = []

    def step(q, kv_a, g, cos, sin, pos, C, KR, *rest):
        Ck, KRk = C.clone(), KR.clone()
        out = mla_decode_step(q, kv_a, g, cos, sin, pos, Ck, KRk, *rest)
        want = absorbed_step(q, kv_a, g, cos, sin, pos, C, KR, *rest).float()
        assert (out.float() - want).abs().max().item() <= ulp_bound(want, 4), pos
        assert torch.equal(KRk, KR) and ((Ck.float() - C.float()).abs() <= C.float().abs() * 2.0 ** -7).all()
        seen.append(q.shape[0])
        return out

    for m in model.modules():
        if isinstance(m, MultiLatentAttention):
            m.fast_step = step
    dec = Decoder(model, ConversationState.allocate(cfg, 64, "cpu", torch.bfloat16))
    prompt = list(range(5, 30))
    dec.forward(prompt)  # prefill (> 8 tokens): not absorbed, fast_step unused
    dec.commit(prompt)
    assert not seen
    for ids in ([7], [8, 9, 10]):  # a decode step, a verify window
        dec.forward(ids)
        dec.commit(ids)
    assert sorted(set(seen)) == [1, 3], seen
    print("mla hook ok")


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (its CPU interpreter runs these)")
def test_mla_kernel_under_triton_interpreter(tmp_path):
    from tests.interpreter import KERNEL_AND_HOOK, run_interpreted

    r = run_interpreted(KERNEL_AND_HOOK.format(module="test_mla_kernel"), str(tmp_path))
    assert r.returncode == 0 and "mla kernel ok" in r.stdout and "mla hook ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(not GPU, reason="needs a CUDA device and triton")
def test_mla_kernel_on_cuda():
    run_all("cuda")
    # the real shapes at a real bucket with the default (SM-count) splits: a decode step, a verify window
    from sparkchat.engine.kernels.mla_decode import mla_decode_step

    H, R, P, NOPE, V, attend = 32, 512, 64, 128, 128, 4096
    scale = (NOPE + P) ** -0.5
    for T, last in ((1, 3000), (5, 4000)):
        positions = list(range(last - T + 1, last + 1))
        q, kv_a, gl, cos, sin, pos, C, KR, norm_w, eps, w_kv = inputs(T, H, R, P, NOPE, V, attend, positions,
                                                                     "cuda", seed=T)
        out = mla_decode_step(q, kv_a, gl, cos, sin, pos, C.clone(), KR.clone(), norm_w, eps, w_kv, attend, scale,
                              NOPE).float()
        f32 = [x.float() if x.is_floating_point() else x for x in (q, kv_a, gl, cos, sin, pos, C, KR, norm_w)]
        want = twin(*f32, eps, w_kv.float(), attend, scale, NOPE)
        assert (out - want).abs().max().item() <= ulp_bound(want, 3), T


def test_default_config_fits_the_devices_shared_memory(monkeypatch):
    """block_n 64 where a program may use the H200's 227 KiB; halved until the estimate fits the 99 KiB
    of sm_12x parts such as the DGX Spark's GB10 (16: at 32 the compiled kernel needs 100 KiB)."""
    pytest.importorskip("triton")
    import sparkchat.engine.kernels.mla_decode as mla

    for limit, want in ((232448, 64), (101376, 16), (40000, 16)):
        monkeypatch.setattr(mla, "max_shared_memory", lambda device, limit=limit: limit)
        cfg = mla.default_config(torch.device("cuda"), 512, 64)
        assert cfg.block_n == want, (limit, cfg.block_n)


def test_mla_config_overrides_take_one_window_size_and_refuse_typos(monkeypatch):
    """SPARKCHAT_MLA_CONFIG sets MlaDecodeConfig fields for the steps of one window size (profile_step
    --switch times them in the graphed step); a field the config lacks is refused, naming the variable."""
    pytest.importorskip("triton")
    import sparkchat.engine.kernels.mla_decode as mla

    monkeypatch.setattr(mla, "max_shared_memory", lambda device: 232448)
    monkeypatch.setenv("SPARKCHAT_MLA_CONFIG", "1.block_m:16/1.warps:4/4.block_n:32")
    one = mla.default_config(torch.device("cuda"), 512, 64, 1)
    four = mla.default_config(torch.device("cuda"), 512, 64, 4)
    assert (one.block_m, one.warps, one.block_n) == (16, 4, 64)
    assert (four.block_m, four.warps, four.block_n) == (32, 8, 32)
    # on a 132-SM GPU at a 1K bucket: 2 tiles of 16 heads, 16 splits of 64 rows each (32 programs, not 16)
    assert mla.num_splits(1, 32, 1024, torch.device("cpu"), replace(one, programs=132)) == 16
    monkeypatch.setenv("SPARKCHAT_MLA_CONFIG", "1.blockm:16")
    with pytest.raises(ValueError, match="SPARKCHAT_MLA_CONFIG"):
        mla.default_config(torch.device("cuda"), 512, 64, 1)
    monkeypatch.setenv("SPARKCHAT_MLA_CONFIG", "0")
    assert mla.default_config(torch.device("cuda"), 512, 64, 1) == mla.MlaDecodeConfig()

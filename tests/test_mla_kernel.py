"""The Triton MLA decode-attention kernel (kernels.mla_decode) against its torch twin nn.mla.mla_absorbed,
fed the equivalent boolean mask: under Triton's CPU interpreter (when triton is installed) and on CUDA
(when there is a GPU). Cache rows past each query's position are filled with huge garbage, so a leak
through the mask cannot hide.

Tolerance, in units of 2^-8 x the output's max (at most one bf16 ulp there): both sides round to bf16 at
the same points (q_latent, probs, o_latent, output), but the twin also rounds its scores to bf16 (the
kernel keeps them fp32), so the twin itself is up to ~3 units off its own fp32 run (mla_absorbed on fp32
copies of the same inputs; the kernel: ~1). The kernel must be within 3 units of that fp32 run, and
within the twin's own error of it plus 3 units of the twin.
"""

from __future__ import annotations

import importlib.util

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
]
REAL = (2, 32, 512, 64, 128, 128, 80, [70, 71], 2, 32)  # the model's per-head dims, a short bucket


def ulp_bound(want: torch.Tensor, n: float) -> float:
    return n * want.abs().amax().item() * 2.0 ** -8


def check(T, H, R, P, NOPE, V, attend, positions, splits, block_n, device, *, seed=0, leak=False):
    """Kernel vs twin (and vs the twin's fp32 run) on one case; raises AssertionError on a mismatch.
    leak=True hands the twin a mask that lets one stale row through (the check must then fail)."""
    from sparkchat.engine.kernels.mla_decode import MlaDecodeConfig, mla_decode
    from sparkchat.engine.nn.mla import mla_absorbed

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(torch.bfloat16).to(device)

    rows = attend + 7  # the cache extends past the bucket: the kernel must not read there either
    C, KR = rnd(rows, R), rnd(rows, P)
    q_nope, q_rope = rnd(T, H, NOPE, s=0.5), rnd(T, H, P, s=0.5)
    w_kv = rnd(H, NOPE + V, R, s=NOPE ** -0.5)
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    stale = max(positions) + 1
    C[stale:], KR[stale:] = 3e4, 3e4  # stale rows and rows past the bucket: garbage that would dominate
    scale = (NOPE + P) ** -0.5
    cfg = MlaDecodeConfig(block_n=block_n)
    out = mla_decode(q_nope, q_rope, C, KR, w_kv, pos, attend, scale, NOPE, splits=splits, config=cfg)
    assert out.shape == (T, H, V) and out.dtype == torch.bfloat16

    mask = torch.arange(attend, device=device)[None, :] <= pos[:, None]
    if leak:
        mask[0, positions[0] + 1] = True
    Cb, KRb = C[:attend], KR[:attend]
    twin = mla_absorbed(q_nope, q_rope, Cb, KRb, w_kv, mask, scale, NOPE).float()
    want = mla_absorbed(q_nope.float(), q_rope.float(), Cb.float(), KRb.float(), w_kv.float(), mask, scale,
                        NOPE)
    out = out.float()
    assert torch.isfinite(out).all()
    err, twin_err = (out - want).abs().max().item(), (twin - want).abs().max().item()
    case = (T, H, R, P, attend, positions, splits)
    assert err <= ulp_bound(want, 3), f"{case}: kernel off the fp32 twin by {err:.3g} (twin: {twin_err:.3g})"
    gap = (out - twin).abs().max().item()
    assert gap <= twin_err + ulp_bound(twin, 3), f"{case}: kernel off the bf16 twin by {gap:.3g}"
    return err / ulp_bound(want, 1), twin_err / ulp_bound(want, 1)


def run_all(device: str) -> None:
    for case in CASES:
        check(*case, device)
    check(*REAL, device)
    # The check has teeth: a twin that lets one garbage row through must not match the kernel.
    try:
        check(*CASES[0], device, leak=True)
    except AssertionError:
        pass
    else:
        raise AssertionError("a leaked stale row went unnoticed")
    print("mla kernel ok")


def run_model(path: str) -> None:
    """The hook in MultiLatentAttention.forward: a tiny model's decode and verify steps hand fast_attend
    the twin's inputs, and the kernel's answer to them matches the twin's (fed the mask forward builds)."""
    from sparkchat.engine.config import ModelConfig
    from sparkchat.engine.generate import Decoder
    from sparkchat.engine.kernels.mla_decode import mla_decode
    from sparkchat.engine.loader import load_model
    from sparkchat.engine.nn.mla import MultiLatentAttention, mla_absorbed
    from sparkchat.engine.state import ConversationState

    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, "cpu", torch.bfloat16, 64)
    seen = []

    def attend(q_nope, q_rope, C, KR, w_kv, pos, end, scale, nope):
        out = mla_decode(q_nope, q_rope, C, KR, w_kv, pos, end, scale, nope)
        mask = torch.arange(end)[None, :] <= pos[:, None]
        want = mla_absorbed(q_nope, q_rope, C, KR, w_kv, mask, scale, nope).float()
        assert (out.float() - want).abs().max().item() <= ulp_bound(want, 4), (end, pos)
        seen.append(q_nope.shape[0])
        return out

    for m in model.modules():
        if isinstance(m, MultiLatentAttention):
            m.fast_attend = attend
    dec = Decoder(model, ConversationState.allocate(cfg, 64, "cpu", torch.bfloat16))
    prompt = list(range(5, 30))
    dec.forward(prompt)  # prefill (> 8 tokens): not absorbed, fast_attend unused
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
    from sparkchat.engine.kernels.mla_decode import mla_decode
    from sparkchat.engine.nn.mla import mla_absorbed

    g = torch.Generator(device="cuda").manual_seed(1)
    H, R, P, NOPE, V, attend = 32, 512, 64, 128, 128, 4096
    scale = (NOPE + P) ** -0.5

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * s).bfloat16()

    w_kv = rnd(H, NOPE + V, R, s=NOPE ** -0.5)
    for T, last in ((1, 3000), (5, 4000)):
        C, KR = rnd(attend, R), rnd(attend, P)
        C[last + 1:], KR[last + 1:] = 3e4, 3e4
        q_nope, q_rope = rnd(T, H, NOPE, s=0.5), rnd(T, H, P, s=0.5)
        pos = torch.arange(last - T + 1, last + 1, device="cuda")
        mask = torch.arange(attend, device="cuda")[None, :] <= pos[:, None]
        out = mla_decode(q_nope, q_rope, C, KR, w_kv, pos, attend, scale, NOPE).float()
        want = mla_absorbed(q_nope.float(), q_rope.float(), C.float(), KR.float(), w_kv.float(), mask, scale, NOPE)
        assert (out - want).abs().max().item() <= ulp_bound(want, 3), T

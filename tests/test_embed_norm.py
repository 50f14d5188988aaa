"""A step's first launches against their twins, the model's own gather, norms and projection: the
embedding gather + first norm kernel and the MTP input kernel (kernels/embed_norm.py), and the MTP
layer's eh_proj with its input norm in the add+norm launches with no residual (fp8_gemv); under Triton's
CPU interpreter, and on a GPU where there is one; then a tiny FP8 model's hidden states and MTP drafts
with all three installed, against without."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.interpreter import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = torch.cuda.is_available() and HAS_TRITON

CHECKS = r"""
import torch
from sparkchat.engine.kernels.embed_norm import embed_norm, mtp_input
from sparkchat.engine.kernels.fp8_gemv import f16_block_acts
from sparkchat.engine.nn import ops as nn_ops


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def close(got, want):  # the mean's summation order differs: one bf16 rounding on a few elements at most
    return (got == want).float().mean().item() > 0.99 and rel_err(got, want) < 1e-2


def check(device, shapes):
    gen = torch.Generator().manual_seed(7)
    for V, N, T in shapes:
        table = (torch.randn(V, N, generator=gen) * 0.05).bfloat16().to(device)
        table[3] *= 40  # rows of very different scales: a wrong row shows in the norm's output
        nw = (torch.rand(N, generator=gen) + 0.5).bfloat16().to(device)
        hw = (torch.rand(N, generator=gen) + 0.5).bfloat16().to(device)
        ids = torch.randint(0, V, (T,), generator=gen).to(device)
        ids[0] = 3
        ids[-1] = V - 1  # the table's last row
        x, h = embed_norm(ids, table, nw, 1e-6)
        assert torch.equal(x, table[ids]), (V, N, T)
        want = nn_ops.rms_norm(table[ids], nw, 1e-6)
        assert close(h, want), (V, N, T, rel_err(h, want))
        assert not close(embed_norm(ids, table, nw * 1.5, 1e-6)[1], want)  # the weight is applied
        if T >= 2 and N % 128 == 0:  # a verify window: the tensor-core GEMVs' form of h, exactly
            h16, hd = h.f16_acts
            r16, rd = f16_block_acts(h)
            assert torch.equal(h16, r16) and torch.equal(hd, rd), (V, N, T)
        else:
            assert not hasattr(h, "f16_acts")
        hidden = (torch.randn(T, N, generator=gen) * 3).bfloat16().to(device)
        got = mtp_input(ids, table, hidden, nw, hw, 1e-6)
        want = nn_ops.mtp_input(table[ids], hidden, nw, hw, 1e-6)
        assert got.shape == (T, 2 * N) and close(got, want), (V, N, T, rel_err(got, want))
        assert close(got[:, N:], nn_ops.rms_norm(hidden, hw, 1e-6))  # the halves in their places
        swapped = mtp_input(ids, table, hidden, hw, nw, 1e-6)
        assert not close(swapped, want)  # each half its own norm's weight


def check_projection_norm(device, shapes, strict):
    # the MTP layer's eh_proj and its input norm: the output projection's add+norm launches, no residual
    # (strict: the GPU's rounding; the add+norm kernels' casts truncate under the interpreter)
    from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv, fp8_block_gemv_add_norm, gemv_config
    from dataclasses import replace
    gen = torch.Generator().manual_seed(11)
    for T, N, K in shapes:
        w = (torch.randn(N, K, generator=gen) * 0.5).to(torch.float8_e4m3fn).to(device)
        si = (torch.rand((N + 127) // 128, (K + 127) // 128, generator=gen) * 0.02 + 0.01).to(device)
        x = torch.randn(T, K, generator=gen).bfloat16().to(device)
        nw = (torch.rand(N, generator=gen) + 0.5).bfloat16().to(device)
        base = gemv_config("block", T, N, K)
        for cfg in (base, replace(base, split=1), replace(base, split=2)):
            y = fp8_block_gemv(x, w, si, config=cfg)
            s, h = fp8_block_gemv_add_norm(x, w, si, None, nw, 1e-6, config=cfg)
            assert torch.equal(s, y), (T, N, K, cfg)  # the projection as the GEMV alone writes it
            want = nn_ops.rms_norm(y, nw, 1e-6)
            assert (close(h, want) if strict else rel_err(h, want) < 1e-2), (T, N, K, cfg, rel_err(h, want))
            assert not torch.equal(h, fp8_block_gemv_add_norm(x, w, si, None, nw * 1.5, 1e-6, config=cfg)[1])
            res = torch.randn(T, N, generator=gen).bfloat16().to(device)  # with one: as before
            s2, h2 = fp8_block_gemv_add_norm(x, w, si, res, nw, 1e-6, config=cfg)
            added = (res.float() + y.float()).bfloat16()
            assert (torch.equal(s2, added) if strict else rel_err(s2, added) < 1e-2), (T, N, K, cfg)
            assert not torch.equal(s2, s)
"""

INTERPRETED = CHECKS + r"""
check("cpu", [(50, 2560, 1), (50, 2560, 4), (17, 200, 3), (9, 128, 2)])
check_projection_norm("cpu", [(1, 256, 512), (3, 256, 512), (1, 384, 640)], False)

# a tiny model: the hidden states of a prompt, a decode step and a verify window, and its MTP drafts,
# with the two kernels installed against the gather and norms they replace
import pathlib, sys, tempfile
from sparkchat.engine.config import ModelConfig
from sparkchat.engine.loader import load_model
from sparkchat.engine.nn.mla import Span
from sparkchat.engine.state import ConversationState
from tests.conftest import make_model_dir

import json
from safetensors.torch import load_file
from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv_add_norm
from sparkchat.engine.release import save_release_checkpoint

root = pathlib.Path(tempfile.mkdtemp(dir=sys.argv[1]))
plain = make_model_dir(root / "tiny", seed=0)
tensors = {}
for f in sorted(plain.glob("*.safetensors")):
    tensors.update(load_file(str(f)))
path = root / "fp4"  # FP8 linears (the MTP layer's eh_proj among them) and MXFP4 experts
save_release_checkpoint(path, tensors, json.loads((plain / "config.json").read_text()))
cfg = ModelConfig.from_dir(path)
model = load_model(path, cfg, "cpu", torch.bfloat16, 64, quantize_experts=True)
assert model.mtp.eh_proj.is_fp8
calls = []
def counted(fn):
    def run(*args):
        calls.append((fn.__name__, args[0].shape[0]))
        return fn(*args)
    return run

def run_all():
    state = ConversationState.allocate(cfg, 64, "cpu", torch.bfloat16)
    outs = []
    for start, ids in ((0, list(range(5, 17))), (12, [20]), (13, [21, 22, 23, 24])):
        h, _ = model(torch.tensor(ids), start, state)
        outs.append(h)
        d = model.draft(torch.tensor(ids[1:] + [30]), h, start, state.mtp)
        outs.append(d)
    return outs

ref = run_all()
model.fast_embed_norm, model.mtp.fast_input = counted(embed_norm), counted(mtp_input)
model.mtp.eh_proj.fast_add_norm = counted(fp8_block_gemv_add_norm)
fast = run_all()
# the gather and the norms are the model's bit for bit here; eh_proj's add+norm rounds the norm's output
# by truncating under the interpreter (its casts), which moves the draft's MoE routing: a draft row may
# flip an expert at a near tie (one in the window moved 7% when last checked, the others under 1%)
for n, (r, f) in enumerate(zip(ref, fast)):
    assert r.shape == f.shape
    rows = torch.tensor([rel_err(f[i], r[i]) for i in range(r.shape[0])])
    if n % 2 == 0:  # the main model's hidden states
        assert rows.max() < 2e-2, (n, rows)
    else:  # its MTP drafts
        assert rows.median() < 1e-2 and rows.max() < 0.15, (n, rows)
# the prompt (12 tokens) takes the gather and norms; the decode step and the verify window the kernels
assert sorted(set(calls)) == [("embed_norm", 1), ("embed_norm", 4), ("fp8_block_gemv_add_norm", 1),
                              ("fp8_block_gemv_add_norm", 4), ("mtp_input", 1), ("mtp_input", 4)], calls
print("interpreter ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_embed_norm_and_mtp_input_under_triton_interpreter(tmp_path):
    proc = run_interpreted(INTERPRETED, str(tmp_path), timeout=600)
    assert proc.returncode == 0 and "interpreter ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.skipif(not GPU, reason="needs a CUDA device and triton")
def test_embed_norm_and_mtp_input_gpu():
    """The Ling shapes on the GPU (157184-row table, 2560 columns; one token and a verify window)."""
    scope: dict = {}
    exec(CHECKS, scope)
    scope["check"]("cuda", [(157184, 2560, 1), (157184, 2560, 4), (1000, 200, 3)])
    scope["check_projection_norm"]("cuda", [(1, 2560, 5120), (4, 2560, 5120)], True)  # Ling's eh_proj

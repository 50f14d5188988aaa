"""The FP8 block-scaled GEMM for prompts (kernels.fp8_gemm): its configs on the CPU, the kernel under
Triton's CPU interpreter (when triton is installed) and on CUDA (when there is a GPU).

Oracles, as ||out - ref|| / ||ref|| over the whole output:
  - `emulate`: the kernel's arithmetic in torch — the weights dequantized to bf16 exactly as
    quant.dequant_fp8_block does (the copy the prompt path made before), fp32 products and sums, one
    rounding to bf16: 1e-5 under the interpreter, 2e-4 on a GPU (the fp32 sums' order differs, and
    now and then that flips an output's bf16 rounding: ~1e-3 of them; a wrong scale or a lost k step
    is off by 1e-1 and more). Under the interpreter too a flip happens on some inputs (one in 300
    random ones at the `out=` case's shape flipped a large output: 7.5e-5), so that case, on those
    inputs, is held to one ulp an element and the GPU's bound;
  - fp8_dequant (the long prompts' one-pass copy) equals quant.dequant_fp8_block bit for bit;
  - F.linear on that bf16 copy (what Linear.forward ran for prompts before; bf16 matmul): 1e-2.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from sparkchat.engine.quant import dequant_fp8_block, quant_fp8_block

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = torch.cuda.is_available() and HAS_TRITON


def emulate(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    wb = dequant_fp8_block(w, s, dtype=torch.bfloat16)
    return (x.float() @ wb.float().T).to(torch.bfloat16)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def within_an_ulp(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every element of bf16 a within one bf16 ulp of b's (a flipped rounding, nothing more)."""
    return bool(((a.float() - b.float()).abs() <= b.float().abs() * 2.0 ** -7).all())


def make_weights(N: int, K: int, scale_fmt: str, device="cpu", seed: int = 0):
    """A quantized random weight: ue8m0 (power-of-two) scales as the release has, or float32 ones,
    whose products with the fp8 values need a rounding to bf16."""
    g = torch.Generator().manual_seed(seed)
    w, s = quant_fp8_block(torch.randn(N, K, generator=g) * 0.05, scale_fmt=scale_fmt)
    return w.to(device), s.to(device)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_configs_fit_the_sparks_shared_memory(monkeypatch):
    from sparkchat.engine.kernels import fp8_gemm

    for limit in (101376, 232448):  # sm_12x (DGX Spark), H200
        monkeypatch.setattr(fp8_gemm, "max_shared_memory", lambda device, limit=limit: limit)
        for M in (9, 16, 17, 32, 33, 64, 65, 8192):
            cfgs = fp8_gemm.sweep_configs(M, 2560, 4096)
            assert cfgs[0] == fp8_gemm.gemm_config(M, 2560, 4096)
            for c in cfgs:
                assert fp8_gemm._smem_estimate(c) <= limit, (limit, M, c)
                assert 128 % c.bk == 0 and c.bm >= 16 and c.bn >= 16
        # the token tile follows the prompt: a short prompt does not pad to 128 rows
        assert fp8_gemm.gemm_config(12, 2560, 4096).bm == 16
        assert fp8_gemm.gemm_config(4000, 2560, 4096).bm == 128


_INTERPRETER = r"""
import torch
from sparkchat.engine.kernels.fp8_gemm import GemmConfig, fp8_block_gemm
from tests.test_fp8_gemm import emulate, make_weights, rel, within_an_ulp

cases = [  # (M, N, K, scale format, config): ragged N and K, both operand orders, grouped tiles
    (20, 192, 256, "ue8m0", GemmConfig(bm=16, bn=64, bk=64, warps=4, stages=1, group=2)),
    (33, 200, 384, "float32", GemmConfig(bm=32, bn=64, bk=128, warps=4, stages=1)),
    (9, 144, 200, "float32", GemmConfig(bm=16, bn=32, bk=32, warps=4, stages=1, swap=False)),
    (40, 130, 160, "ue8m0", GemmConfig(bm=16, bn=64, bk=64, warps=4, stages=1, group=1)),
]
for i, (M, N, K, fmt, cfg) in enumerate(cases):
    w, s = make_weights(N, K, fmt, seed=i)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(i)).bfloat16()
    y = fp8_block_gemm(x, w, s, config=cfg)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    assert rel(y, emulate(x, w, s)) < 1e-5, (M, N, K, fmt, rel(y, emulate(x, w, s)))
    wb = __import__("sparkchat.engine.quant", fromlist=["x"]).dequant_fp8_block(w, s)
    assert rel(y, torch.nn.functional.linear(x, wb)) < 1e-2
out = torch.full((24, 192), 7.0, dtype=torch.bfloat16)
w, s = make_weights(192, 256, "ue8m0")
x = torch.randn(24, 256, generator=torch.Generator().manual_seed(69)).bfloat16()
assert fp8_block_gemm(x, w, s, out=out, config=GemmConfig(bm=16, bn=64, bk=64, warps=4, stages=1)) is out
# these inputs flip one large output's bf16 rounding against the emulation's (7.5e-5 of the norm): within
# an ulp everywhere, every output written
assert within_an_ulp(out, emulate(x, w, s)) and rel(out, emulate(x, w, s)) < 2e-4
from sparkchat.engine.kernels.fp8_gemm import GEMM_MAX_TOKENS, fp8_dequant, fp8_prompt_linear
from sparkchat.engine.quant import dequant_fp8_block
for N, K, fmt in ((200, 384, "float32"), (130, 160, "ue8m0"), (300, 520, "float32")):
    w, s = make_weights(N, K, fmt)
    assert torch.equal(fp8_dequant(w, s), dequant_fp8_block(w, s)), (N, K, fmt)
w, s = make_weights(144, 256, "float32")
for M in (GEMM_MAX_TOKENS, GEMM_MAX_TOKENS + 1):  # the GEMM, then dequant + matmul
    x = torch.randn(M, 256).bfloat16()
    assert rel(fp8_prompt_linear(x, w, s), torch.nn.functional.linear(x, dequant_fp8_block(w, s))) < 1e-2, M
print("interpreter ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fp8_block_gemm_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "interpreter ok" in proc.stdout, proc.stderr[-3000:]


# (N, K) of the kinds Ling-3.0-flash's FP8 linears have: fused input projections over the hidden size
# (16K and 12K rows), output projections over 4096 and 6144 inputs, MLA's kv_a (576 rows: a ragged last
# tile), the shared expert's down projection (768 inputs).
GPU_SHAPES = [(16384, 2560), (2560, 4096), (12288, 2560), (2560, 6144), (576, 2560), (2560, 768)]


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("N,K", GPU_SHAPES)
@pytest.mark.parametrize("M", [9, 24, 64, 300, 2048])
def test_fp8_block_gemm_gpu(M, N, K):
    from sparkchat.engine.kernels.fp8_gemm import fp8_block_gemm

    w, s = make_weights(N, K, "ue8m0", "cuda", seed=M)
    x = torch.randn(M, K, device="cuda").bfloat16()
    y = fp8_block_gemm(x, w, s)
    assert rel(y, emulate(x, w, s)) < 2e-4
    assert rel(y, torch.nn.functional.linear(x, dequant_fp8_block(w, s))) < 1e-2


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("N,K", GPU_SHAPES)
def test_fp8_dequant_and_prompt_linear_gpu(N, K):
    from sparkchat.engine.kernels.fp8_gemm import GEMM_MAX_TOKENS, fp8_dequant, fp8_prompt_linear

    w, s = make_weights(N, K, "float32", "cuda")
    assert torch.equal(fp8_dequant(w, s), dequant_fp8_block(w, s))
    for M in (GEMM_MAX_TOKENS, GEMM_MAX_TOKENS + 1, 1000):
        x = torch.randn(M, K, device="cuda").bfloat16()
        assert rel(fp8_prompt_linear(x, w, s), torch.nn.functional.linear(x, dequant_fp8_block(w, s))) < 1e-2


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("M", [20, 512])
def test_fp8_block_gemm_sweep_configs_gpu(M):
    from sparkchat.engine.kernels.fp8_gemm import fp8_block_gemm, sweep_configs

    N, K = 2560, 4096
    w, s = make_weights(N, K, "float32", "cuda")
    x = torch.randn(M, K, device="cuda").bfloat16()
    want = emulate(x, w, s)
    for cfg in sweep_configs(M, N, K, "cuda"):
        assert rel(fp8_block_gemm(x, w, s, config=cfg), want) < 2e-4, cfg

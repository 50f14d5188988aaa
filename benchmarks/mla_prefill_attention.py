"""MLA prefill attention at the Ling shape (32 heads, q/k 192 = 128 nope + 64 rope, v 128), bf16, on one GPU:
the 3-D boolean-mask SDPA call the engine made until session 18 (which PyTorch can only run on its fp32
math path) against 4-D forms that it can send to a fused kernel (the engine now uses `is_causal` from
position 0 and the 4-D mask otherwise: nn.mla.prefill_attention).

    python benchmarks/mla_prefill_attention.py [--tokens 8192] [--start 0 4096]

For each (start, tokens): keys 0 .. start + tokens - 1, query t at position start + t. Prints each
form's time (CUDA events, median of 5 after a warm-up), the backend SDPA picked where one is forced to
succeed, and its relative error against the masked call.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import eager_us  # noqa: E402

H, DQK, DV = 32, 192, 128


def main() -> None:
    warnings.filterwarnings("ignore", message=".*(kernel not used|runtime disabled|requires query).*")
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 2048])
    ap.add_argument("--start", type=int, nargs="+", default=[0, 4096])
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in args.tokens:
        for start in args.start:
            end = start + T
            # [1, heads, tokens, dim]: SDPA's fused kernels take 4-D inputs only (3-D goes to the math path)
            q = torch.randn(1, H, T, DQK, device="cuda", generator=g).bfloat16()
            k = torch.randn(1, H, end, DQK, device="cuda", generator=g).bfloat16()
            v = torch.randn(1, H, end, DV, device="cuda", generator=g).bfloat16()
            scale = DQK ** -0.5
            pos = torch.arange(start, end, device="cuda")
            mask = torch.arange(end, device="cuda")[None, :] <= pos[:, None]
            want = F.scaled_dot_product_attention(q[0], k[0], v[0], attn_mask=mask, scale=scale)[None]  # 3-D: math
            vp = F.pad(v, (0, DQK - DV))
            bias = causal_lower_right(T, end)
            forms = {
                "3-D, bool mask (engine before)": lambda: F.scaled_dot_product_attention(
                    q[0], k[0], v[0], attn_mask=mask, scale=scale)[None],
                "4-D, bool mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
                "lower-right causal": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale),
                "lower-right causal, v padded": lambda: F.scaled_dot_product_attention(
                    q, k, vp, attn_mask=bias, scale=scale)[..., :DV],
            }
            if start == 0:
                forms["is_causal"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
                forms["is_causal, v padded"] = lambda: F.scaled_dot_product_attention(
                    q, k, vp, is_causal=True, scale=scale)[..., :DV]
            print(f"T={T} start={start}:")
            for name, fn in forms.items():
                ms = eager_us(fn, 5) / 1e3
                err = ((fn().float() - want.float()).norm() / want.float().norm()).item()
                picked = []
                for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                    try:
                        with sdpa_kernel(be):
                            fn()
                        picked.append(be.name)
                    except RuntimeError:
                        pass
                print(f"  {name:<32} {ms:8.2f} ms  rel err {err:.1e}  runs on: {', '.join(picked) or 'math only'}",
                      flush=True)


if __name__ == "__main__":
    main()

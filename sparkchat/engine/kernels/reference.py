"""Pure-torch twins of the Triton kernels: the test oracle and the CPU fallback.

Same interfaces as the kernels in `mxfp4_moe.py` and `fp8_gemv.py`, no triton import, any device.
They compute in fp32 from exactly dequantized weights and round only the outputs.
"""

from __future__ import annotations

import torch

# E2M1 code -> value; codes 8..15 are the negated 0..7 (code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32
FP8_BLOCK = 128


_TABLES: dict = {}


def _e2m1_table(device) -> torch.Tensor:
    """Cached per device, so dequantizing inside a CUDA graph capture copies nothing from the host."""
    key = str(device)
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return _TABLES[key]


def e8m0_to_float(s_u8: torch.Tensor) -> torch.Tensor:
    """E8M0 scale byte -> 2^(s-127) in fp32 (255 = NaN)."""
    out = torch.exp2(s_u8.to(torch.float32) - 127.0)
    return torch.where(s_u8 == 255, torch.full_like(out, float("nan")), out)


def dequant_mxfp4(w_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """[..., R, C/2] packed E2M1 (low nibble = even column) + [..., R, C/32] E8M0 -> fp32 [..., R, C]."""
    table = _e2m1_table(w_u8.device)
    codes = torch.stack([w_u8 & 0xF, w_u8 >> 4], dim=-1).flatten(-2)
    vals = table[codes.long()]
    scale = e8m0_to_float(scale_u8).repeat_interleave(MXFP4_GROUP, dim=-1)
    return vals * scale


def dequant_fp8_block(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 [N, K] with one fp32 scale per block x block tile [ceil(N/b), ceil(K/b)] -> fp32 [N, K]."""
    n, k = w_fp8.shape
    s = scale_inv.to(torch.float32).repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return w_fp8.to(torch.float32) * s


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """min(silu(gate), L) * clamp(up, -L, L) for L > 0, plain silu(gate) * up for L == 0 (fp32)."""
    act = torch.nn.functional.silu(gate)
    if limit > 0:
        act = act.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return act * up


def mxfp4_moe_reference(
    x: torch.Tensor,  # [T, H] bf16
    topk_ids: torch.Tensor,  # [T, K] int
    topk_weights: torch.Tensor,  # [T, K] fp32
    w13: torch.Tensor,  # [E, 2I, H/2] uint8
    w13_scale: torch.Tensor,  # [E, 2I, H/32] uint8
    w2: torch.Tensor,  # [E, H, I/2] uint8
    w2_scale: torch.Tensor,  # [E, H, I/32] uint8
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """Routed-expert MoE: y[t] = sum_k w[t,k] * down_e(swiglu(gate_e x, up_e x)), e = ids[t,k]; bf16 [T, H]."""
    T, H = x.shape
    inter = w13.shape[1] // 2
    xf = x.to(torch.float32)
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    # Each distinct expert is dequantized once and applied to every (token, slot) that chose it.
    for e in torch.unique(ids).tolist():
        t_idx, k_idx = (ids == e).nonzero(as_tuple=True)
        w13_e = dequant_mxfp4(w13[e], w13_scale[e])  # [2I, H]
        w2_e = dequant_mxfp4(w2[e], w2_scale[e])  # [H, I]
        gu = xf[t_idx] @ w13_e.T  # [n, 2I]
        h = swiglu(gu[:, :inter], gu[:, inter:], swiglu_limit)
        out = (h @ w2_e.T) * topk_weights[t_idx, k_idx].to(torch.float32)[:, None]
        y.index_add_(0, t_idx, out)
    return y.to(torch.bfloat16)


def mxfp4_moe_baseline(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
    w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """The naive GPU baseline: gather the T*K selected experts, dequantize to bf16, batched matmuls."""
    T, K = topk_ids.shape
    inter = w13.shape[1] // 2
    ids = topk_ids.reshape(-1).long()
    w13_b = dequant_mxfp4(w13[ids], w13_scale[ids]).to(torch.bfloat16)  # [TK, 2I, H]
    w2_b = dequant_mxfp4(w2[ids], w2_scale[ids]).to(torch.bfloat16)  # [TK, H, I]
    xs = x.repeat_interleave(K, dim=0)[:, None, :]  # [TK, 1, H]
    gu = torch.bmm(xs, w13_b.transpose(1, 2)).float()  # [TK, 1, 2I]
    h = swiglu(gu[..., :inter], gu[..., inter:], swiglu_limit).to(torch.bfloat16)
    out = torch.bmm(h, w2_b.transpose(1, 2)).float()[:, 0]  # [TK, H]
    out = out * topk_weights.reshape(-1, 1).float()
    return out.view(T, K, -1).sum(1).to(torch.bfloat16)


def fp8_block_gemv_reference(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [T, K] bf16 @ (fp8 [N, K] * block scales).T -> bf16 [T, N]."""
    return (x.to(torch.float32) @ dequant_fp8_block(w, scale_inv).T).to(torch.bfloat16)


def fp8_head_gemv_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, H] bf16 @ (fp8 [V, H] * per-row scale [V]).T -> fp32 logits [T, V]."""
    return (x.to(torch.float32) @ w.to(torch.float32).T) * scale.to(torch.float32)[None, :]


def fp8_head_argmax_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Greedy token per row of x: int64 [T] (first index on ties, like torch.argmax)."""
    return fp8_head_gemv_reference(x, w, scale).argmax(dim=-1)

"""Mixture of experts: fp32 sigmoid router with group-limited top-k, routed experts, shared expert.

The routed experts' weights are stacked per layer, plain or MXFP4 (4-bit E2M1 + E8M0 group-32
scales). The reference forward dequantizes only the experts the tokens selected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sparkchat.engine.nn.linear import GEMV_MAX_TOKENS, FusedLinear, Linear, project
from sparkchat.engine.nn.norm import PendingSum, RMSNorm, SplitNormInput
from sparkchat.engine.nn.ops import ops, register
from sparkchat.engine.streams import fork


@register
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate)·up, with Ling's clamp when limit > 0: min(silu(gate), L) · clip(up, −L, L)."""
    if limit > 0:
        return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)
    return F.silu(gate) * up


class MLP(nn.Module):
    """Dense SwiGLU MLP (the first layers, and the shared expert)."""

    def __init__(self, hidden: int, inter: int, limit: float = 0.0) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = Linear(hidden, inter), Linear(hidden, inter)
        self.down_proj = Linear(inter, hidden)
        self.limit = limit
        self.fused: FusedLinear | None = None  # gate|up in one weight, set at load time
        # GPU path: callable(gate_up, up_offset, limit, w, scale_inv) -> down(swiglu(gate, up)) in one
        # launch, the SwiGLU done as the down GEMV loads its input (set by fastpath.install)
        self.swiglu_down = None

    def input_projections(self) -> list[Linear]:
        return [self.gate_proj, self.up_proj]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.down_proj
        if (self.swiglu_down is not None and self.fused is not None and x.shape[0] <= GEMV_MAX_TOKENS
                and down.is_fp8):
            return self.swiglu_down(self.fused(x), self.fused.offsets[1], self.limit, down.weight,
                                    down.weight_scale_inv)
        gate, up = project(self.fused, self.input_projections(), x)
        return self.down_proj(ops.swiglu(gate, up, self.limit))


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int, groups: int, top_groups: int,
                 scaling: float, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden), requires_grad=False)  # fp32 (BF16 when the checkpoint's is)
        self.expert_bias = nn.Parameter(torch.zeros(experts), requires_grad=False)  # fp32
        self.experts, self.top_k, self.groups, self.top_groups = experts, top_k, groups, top_groups
        self.scaling, self.renormalize = scaling, renormalize
        # set by the GPU path: a callable giving bytes of the next layer's first weight (or None) for the
        # router kernel to ask L2 for while it routes one token (kernels/router.py, route's l2_prefetch)
        self.l2_prefetch: Callable[[], torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] → (expert ids [T, k] int64, weights [T, k] fp32)."""
        ahead = self.l2_prefetch() if self.l2_prefetch is not None and x.shape[0] == 1 else None
        hint = {} if ahead is None else {"l2_prefetch": ahead}  # the torch twin takes no such argument
        return ops.route(x, self.weight, self.expert_bias, self.groups, self.top_groups, self.top_k,
                         self.scaling, self.renormalize, **hint)


@register
def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, top_groups: int, top_k: int,
          scaling: float, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 sigmoid scores; choose by score + bias within the top groups (a group's score is the sum of
    its two best); weight by the unbiased scores, renormalized, times the scaling factor."""
    scores = torch.sigmoid(x.float() @ weight.float().T)  # [T, E]
    choice = scores + bias
    T, E = scores.shape
    group_scores = choice.view(T, groups, -1).topk(2, dim=-1).values.sum(-1)  # [T, G]
    keep = group_scores.topk(top_groups, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    expert_mask = group_mask.repeat_interleave(E // groups, dim=1)
    ids = choice.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


class Experts(nn.Module):
    """Routed experts of one layer, stacked: w13 = [gate; up] rows, w2 = down.

    Plain: w13 [E, 2I, H], w2 [E, H, I]. MXFP4: w13 uint8 [E, 2I, H/2] + w13_scale uint8 [E, 2I, H/32],
    w2 uint8 [E, H, I/2] + w2_scale uint8 [E, H, I/32]. `paired`: the MXFP4 words are in the decode
    kernels' order (kernels/mxfp4_layout.py), set by use_paired_words().
    """

    def __init__(self, experts: int, hidden: int, inter: int, limit: float = 0.0) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter, self.limit = experts, hidden, inter, limit
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        self.paired = False
        self.cache_dense = False  # keep dequantized experts (CPU: small models run much faster)
        self._dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def is_mxfp4(self) -> bool:
        return self.w13_scale is not None

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's (w13 [2I, H], w2 [H, I]) as plain tensors of `dtype`."""
        cached = self._dense.get(e)
        if cached is not None and cached[0].dtype == dtype:
            return cached
        if not self.is_mxfp4:
            return self.w13[e].to(dtype), self.w2[e].to(dtype)
        from sparkchat.engine.kernels.mxfp4_layout import unpair_words
        from sparkchat.engine.quant import dequant_mxfp4

        w13, w2 = (unpair_words(self.w13[e]), unpair_words(self.w2[e])) if self.paired else (self.w13[e], self.w2[e])
        pair = (dequant_mxfp4(w13, self.w13_scale[e], dtype=dtype),
                dequant_mxfp4(w2, self.w2_scale[e], dtype=dtype))
        if self.cache_dense:
            self._dense[e] = pair
        return pair

    def use_paired_words(self, on: bool = True) -> None:
        """Put the MXFP4 words in the decode kernels' paired order (or back to the checkpoint's), in
        place; nothing to do when they already are."""
        if on == self.paired or not self.is_mxfp4:
            return
        from sparkchat.engine.kernels.mxfp4_layout import permute_words_

        for w in (self.w13, self.w2):
            permute_words_(w, inverse=not on)
        self.paired = on

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Dequantize-then-matmul over the distinct selected experts (the baseline and the oracle)."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            w13, w2 = self.expert_weights(e, x.dtype)
            gate, up = (x[tok] @ w13.T).chunk(2, dim=-1)
            y = swiglu(gate, up, self.limit) @ w2.T
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(x.dtype))
        return out


def _reading_view(x: torch.Tensor) -> torch.Tensor:
    """x for a reader beside the router: x itself, or where x is a norm's output still unwritten (its
    SplitNorm, which the router's GEMV writes), a view of it whose SplitNorm only applies the norm, so
    that the side stream neither writes x nor waits for it."""
    split = getattr(x, "split_norm", None)
    if split is None:
        return x
    view = x.view_as(x)
    view.split_norm = dataclasses.replace(split, write=False)
    return view


class MoE(nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, groups: int, top_groups: int,
                 scaling: float, renormalize: bool, shared: int, limit: float, shared_limit: float) -> None:
        super().__init__()
        self.gate = Router(hidden, experts, top_k, groups, top_groups, scaling, renormalize)
        self.experts = Experts(experts, hidden, inter, limit)
        self.shared_experts = MLP(hidden, inter * shared, shared_limit) if shared else None
        self.fast_experts = None  # set by the GPU path: a callable with Experts.forward's signature
        self.side_stream = None  # set by the GPU path: the shared expert runs there, alongside the routing
        # set by the GPU path (SPARKCHAT_SHARED_ADD_LATE): a decode window's output is a PendingSum, the
        # shared expert's part added by the next norm's add+norm instead of by the routed experts' stage 2
        self.late_shared_add = False

    def forward(self, x: torch.Tensor, add_norm: tuple[torch.Tensor, RMSNorm] | None = None):
        """The layer's output [T, H] (or, with late_shared_add, a PendingSum for the next norm's
        add_norm); with add_norm = (residual, norm): (residual + output, norm of that) instead, the add
        and the norm done in the routed experts' last launch where the GPU path can
        (ExpertsKernel.fuses_norm), else by norm.add_norm; where the norm's reader can finish it
        (ExpertsKernel.splits_norm): (residual + output, SplitNormInput)."""
        fast = self.fast_experts
        in_kernel = add_norm is not None and getattr(fast, "fuses_norm", None) is not None and fast.fuses_norm(x)
        split = in_kernel and fast.splits_norm(x, add_norm[1])  # half the norm here, half in the next GEMV
        extra = {"norm": (add_norm[0], add_norm[1].weight, add_norm[1].eps, split)} if in_kernel else {}
        out = self._forward(x, extra)
        if split:
            return out[0], SplitNormInput(out[1], add_norm[1])
        if add_norm is None or in_kernel:
            return out
        return add_norm[1].add_norm(add_norm[0], out)

    def _forward(self, x: torch.Tensor, extra: dict):
        """The routed and shared experts, wherever each runs; `extra` goes to the fast experts (their
        `norm`, when forward has them do the add and norm after the layer)."""
        fuses = getattr(self.fast_experts, "fuses_shared", None)
        mode = fuses(x) if fuses is not None and self.shared_experts is not None else 0
        if mode == 2:  # both of the shared expert's projections inside the routed experts' launches
            ids, weights = self.gate(x)
            return self.fast_experts(x, ids, weights, shared=True, **extra)
        if mode == 1 and self.side_stream is not None:  # its gate|up beside the routing, its down in stage 2
            gate_up, join = fork(self.side_stream, self.shared_experts.fused, _reading_view(x))
            ids, weights = self.gate(x)
            return self.fast_experts(x, ids, weights, shared=True, shared_gate_up=gate_up, join=join, **extra)
        # the shared part left to the next norm's add+norm: stage 2 then need not wait for the side stream
        late = self.late_shared_add and not extra and x.shape[0] <= GEMV_MAX_TOKENS
        if self.fast_experts is not None and self.shared_experts is not None and self.side_stream is not None:
            shared, join = fork(self.side_stream, self.shared_experts, _reading_view(x))  # overlaps the routing
            ids, weights = self.gate(x)
            if late:
                return PendingSum(self.fast_experts(x, ids, weights), shared, join)
            return self.fast_experts(x, ids, weights, add=shared, join=join, **extra)  # the add fuses in
        ids, weights = self.gate(x)
        if self.fast_experts is not None and self.shared_experts is not None:
            if late:
                return PendingSum(self.fast_experts(x, ids, weights), self.shared_experts(x))
            return self.fast_experts(x, ids, weights, add=self.shared_experts(x), **extra)
        if self.fast_experts is not None:
            return self.fast_experts(x, ids, weights, **extra)
        routed = self.experts(x, ids, weights)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)

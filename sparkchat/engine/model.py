"""Ling-3.0-flash: embedding → 42 decoder layers (KDA or gated MLA, then dense MLP or MoE) → norm →
lm_head, plus the MTP (NextN) layer that drafts tokens for speculative decoding.

Batch size is always 1: activations are [T, H] for T new tokens at positions start..start+T-1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sparkchat.engine.config import ModelConfig
from sparkchat.engine.nn.kda import KDASteps, KimiDeltaAttention
from sparkchat.engine.nn.linear import GEMV_MAX_TOKENS, FusedLinear, Linear, project_add_norm, project_norm
from sparkchat.engine.nn.mla import MLACache, MultiLatentAttention, Span
from sparkchat.engine.nn.moe import MLP, MoE
from sparkchat.engine.nn.norm import NormedInput, RMSNorm, SplitNormInput
from sparkchat.engine.nn.ops import ops
from sparkchat.engine.nn.rope import RotaryEmbedding
from sparkchat.engine.state import ConversationState

# Prompts at least this long prefill KDA in chunked form; shorter steps run the recurrence.
CHUNKED_PREFILL_MIN_TOKENS = 16


def _mla(cfg: ModelConfig) -> MultiLatentAttention:
    return MultiLatentAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim,
                                cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.rms_norm_eps)


def _moe(cfg: ModelConfig, limit: float, shared_limit: float) -> MoE:
    return MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
               cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob,
               cfg.num_shared_experts, limit, shared_limit)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int) -> None:
        super().__init__()
        self.idx = idx
        self.is_mla = cfg.layer_types[idx] == "full_attention"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_mla:
            self.attention = _mla(cfg)
        else:
            self.attention = KimiDeltaAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim,
                                                cfg.short_conv_kernel_size, cfg.kda_safe_gate,
                                                cfg.kda_lower_bound, cfg.rms_norm_eps)
        if cfg.mlp_layer_types[idx] == "dense":
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        else:
            self.mlp = _moe(cfg, cfg.expert_swiglu_limit_list[idx], cfg.share_expert_swiglu_limit_list[idx])
        # the norm after this layer (the next one's input norm, or the final norm), when this layer's MoE
        # runs the residual add and that norm in its last launch (set by fastpath.install)
        self.next_norm: RMSNorm | None = None

    def forward(self, x: torch.Tensor, pending: torch.Tensor | NormedInput | None, span: Span,
                state: ConversationState, rotary: RotaryEmbedding,
                keep_steps: bool) -> tuple[torch.Tensor, torch.Tensor | NormedInput, KDASteps | None]:
        """x: the residual stream; pending: the previous layer's MLP output, not yet added (the add
        fuses with this layer's input norm; a PendingSum: its two parts), or that add and norm already
        done (NormedInput). Returns (residual, this layer's MLP output or NormedInput, KDA steps)."""
        norm_in = self.input_layernorm
        if pending is None:
            h = norm_in(x)
        else:
            x, h = norm_in.add_norm(x, pending)
        steps = None
        if self.is_mla:
            o = self.attention(h, span, state.mla[self.idx], rotary, absorbed=x.shape[0] <= 8, project_out=False)
        else:
            chunked = x.shape[0] >= CHUNKED_PREFILL_MIN_TOKENS
            o, steps = self.attention(h, state.kda[self.idx], keep_steps=keep_steps, chunked=chunked,
                                      project_out=False)
        post = self.post_attention_layernorm
        x, h = project_add_norm(self.attention.out_proj, o, x, post.weight, post.eps, split=post.splits(x))
        if self.next_norm is not None:  # the MoE's last launch adds its output and runs the next norm
            x, h_next = self.mlp(h, add_norm=(x, self.next_norm))  # (or its first half: SplitNormInput)
            return x, h_next if isinstance(h_next, SplitNormInput) else NormedInput(h_next, self.next_norm), steps
        return x, self.mlp(h), steps


class MTPLayer(nn.Module):
    """The NextN layer: h' = eh_proj([enorm(embed(next token)); hnorm(h)]) → MLA → MoE → final_layernorm.

    It has no embedding or head of its own: the caller passes the main model's embedding and head.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.enorm, self.hnorm = RMSNorm(H, cfg.rms_norm_eps), RMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * H, H)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.attention = _mla(cfg)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = _moe(cfg, 0.0, 0.0)  # the limit lists cover the main layers only
        self.final_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.fuse_final_norm = False  # set by fastpath.install (SPARKCHAT_MOE_ADD_NORM)
        assert self.enorm.eps == self.hnorm.eps  # ops.mtp_input takes one eps for both
        # GPU path for eh_proj's input, the gather and both norms in one PDL launch (fastpath.install:
        # kernels.embed_norm.mtp_input, same arguments as input_of)
        self.fast_input: Callable[..., torch.Tensor] | None = None

    def input_of(self, ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """eh_proj's input [enorm(embed[ids]) | hnorm(hidden)]."""
        args = (self.enorm.weight, self.hnorm.weight, self.enorm.eps)
        if self.fast_input is not None and ids.shape[0] <= GEMV_MAX_TOKENS:
            return self.fast_input(ids, embed, hidden, *args)
        return ops.mtp_input(embed[ids], hidden, *args)

    def forward(self, ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, span: Span, cache: MLACache,
                rotary: RotaryEmbedding) -> torch.Tensor:
        """ids [T]: the next tokens, embedded from `embed` (the main model's table); hidden [T, H]."""
        norm = self.input_layernorm
        x, h = project_norm(self.eh_proj, self.input_of(ids, embed, hidden), norm.weight, norm.eps)
        o = self.attention(h, span, cache, rotary, absorbed=x.shape[0] <= 8, project_out=False)
        # the residual adds fuse with the norms after them, as in DecoderLayer (the same roundings):
        # on the GPU path the output projection's GEMV and the final add+norm are PDL kernels
        post = self.post_attention_layernorm
        x, h = project_add_norm(self.attention.out_proj, o, x, post.weight, post.eps)
        if self.fuse_final_norm:  # the MoE's last launch adds its output and runs the final norm
            return self.mlp(h, add_norm=(x, self.final_layernorm))[1]
        return self.final_layernorm.add_norm(x, self.mlp(h))[1]


class LMHead(nn.Module):
    """The output projection, shared by the target and the MTP draft (one module object, always).

    Holds the BF16 (or checkpoint-dtype) weight, and optionally an FP8 e4m3 copy with per-row scales
    quantized online; `use_fp8` picks which one runs.

    The draft may run a truncated head: `set_draft_rows(ids)` keeps a row-gathered copy of the N rows
    `ids` (the most frequent tokens) of whichever weight runs — the FP8 bytes and their scales when
    `use_fp8`, else the BF16 rows — and `head(h, draft=True)` then returns logits over those N tokens
    only, through the same numerics and, on CUDA, the same `fast_fp8` GEMV as the full head. Row i of
    the draft's logits is the full head's row `draft_ids[i]`. The verify always calls the full head.
    """

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.hidden, self.vocab = hidden, vocab
        self.weight: torch.Tensor | None = None  # [V, H]
        self.fp8_weight: torch.Tensor | None = None  # [V, H] float8_e4m3fn
        self.fp8_scale: torch.Tensor | None = None  # [V] fp32
        self.use_fp8 = False
        self.cache_dense = False  # CPU: keep the dequantized FP8 head instead of rebuilding it every step
        self._dense_fp8: torch.Tensor | None = None
        self.fast_fp8 = None  # set by the GPU path: callable(h, fp8_weight, fp8_scale) -> fp32 logits
        self.fast_fp8_argmax = None  # set by the GPU path: callable(h, fp8_weight, fp8_scale) -> int64 rows
        # the truncated draft head: ids [N] (sorted, full-vocabulary ids) and the rows of the weight in use
        self.draft_ids: torch.Tensor | None = None
        self._draft: dict[str, torch.Tensor | None] = {}

    def build_fp8(self) -> None:
        from sparkchat.engine.quant import quant_fp8_rows

        self.fp8_weight, self.fp8_scale = quant_fp8_rows(self.weight)
        self._dense_fp8 = None
        self._draft = {}  # rebuilt from the new FP8 rows on next use

    # -- the truncated draft head --------------------------------------------------------------
    def set_draft_rows(self, ids: torch.Tensor | None) -> None:
        """Give the draft a head over the rows `ids` only (full-vocabulary token ids, any order; kept
        sorted, so ties break toward the lower id as the full head's argmax does); None: the draft
        uses the full head. The row copies are built at once for the numerics in use."""
        if ids is None:
            self.draft_ids, self._draft = None, {}
            return
        dev = (self.weight if self.weight is not None else self.fp8_weight).device
        ids = torch.unique(torch.as_tensor(ids, dtype=torch.long)).to(dev)  # sorted, no repeats
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self.vocab:
            raise ValueError(f"draft rows must be token ids in [0, {self.vocab})")
        if self.draft_ids is not None and torch.equal(ids, self.draft_ids):
            self.prepare_draft()
            return
        self.draft_ids, self._draft = ids, {}
        self.prepare_draft()

    def prepare_draft(self) -> None:
        """Build the draft's row copy for the numerics in use (FP8 rows + scales, or BF16 rows) and drop
        the other one, so at most one N-row copy is held. Call after changing `use_fp8` (the engine
        does), before capturing a graph; `head(h, draft=True)` also builds it on first use."""
        ids = self.draft_ids
        if ids is None:
            self._draft = {}
            return
        if self.use_fp8:
            if self._draft.get("fp8_weight") is None:
                w8 = self.fp8_weight
                # index_select has no float8 kernels everywhere: gather the bytes
                rows = w8.view(torch.uint8).index_select(0, ids).view(w8.dtype)
                self._draft = {"fp8_weight": rows.contiguous(),
                               "fp8_scale": self.fp8_scale.index_select(0, ids).contiguous()}
        elif self._draft.get("weight") is None:
            self._draft = {"weight": self.weight.index_select(0, ids).contiguous()}

    def draft_bytes(self) -> int:
        """Bytes one draft step's head reads: the N-row copy in use, or the full head without rows."""
        def size(*ts: torch.Tensor | None) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        if self.draft_ids is None:
            return size(self.fp8_weight, self.fp8_scale) if self.use_fp8 else size(self.weight)
        n = self.draft_ids.numel()
        if self.use_fp8:
            return n * self.hidden * self.fp8_weight.element_size() + n * self.fp8_scale.element_size()
        return n * self.hidden * self.weight.element_size()

    # -- logits ----------------------------------------------------------------------------------
    def forward(self, h: torch.Tensor, draft: bool = False) -> torch.Tensor:
        """h: [T, H] → fp32 logits [T, V]; with `draft` and draft rows set, [T, N] over `draft_ids`."""
        if draft and self.draft_ids is not None:
            self.prepare_draft()
            d = self._draft
            if self.use_fp8:
                return self._fp8_logits(h, d["fp8_weight"], d["fp8_scale"], "draft_dense_fp8")
            return (h @ d["weight"].to(h.dtype).T).float()
        if self.use_fp8:
            return self._fp8_logits(h, self.fp8_weight, self.fp8_scale, None)
        return (h @ self.weight.to(h.dtype).T).float()

    def argmax(self, h: torch.Tensor, draft: bool = False) -> torch.Tensor:
        """The row of each h's largest logit [T] (int64; with `draft` and draft rows set, an index into
        `draft_ids`), as forward(h, draft).argmax(-1) picks it (the first of equal maxima). On the GPU
        with the FP8 head the GEMV picks it as it goes, never writing the logits (fp8_head_argmax)."""
        if self.use_fp8 and self.fast_fp8_argmax is not None and h.shape[0] <= 8:
            if draft and self.draft_ids is not None:
                self.prepare_draft()
                return self.fast_fp8_argmax(h, self._draft["fp8_weight"], self._draft["fp8_scale"])
            return self.fast_fp8_argmax(h, self.fp8_weight, self.fp8_scale)
        return self(h, draft).argmax(-1)

    def _fp8_logits(self, h: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                    draft_key: str | None) -> torch.Tensor:
        if self.fast_fp8 is not None:
            return self.fast_fp8(h, w8, scale)
        w = self._dense_fp8 if draft_key is None else self._draft.get(draft_key)
        if w is None or w.dtype != h.dtype:
            from sparkchat.engine.quant import dequant_fp8_rows

            w = dequant_fp8_rows(w8, scale, dtype=h.dtype)
            if self.cache_dense:
                if draft_key is None:
                    self._dense_fp8 = w
                else:
                    self._draft[draft_key] = w
        return (h @ w.T).float()


class LingModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_context: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.embed: torch.Tensor | None = None  # [V, H]
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size)
        self.mtp = MTPLayer(cfg) if cfg.has_mtp else None
        self.rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, max_context, cfg.rope_scaling, device)
        # GPU path for the embedding and the first layer's input norm in one PDL launch (fastpath.install:
        # kernels.embed_norm.embed_norm(ids, embed, norm weight, eps) -> (x, h))
        self.fast_embed_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def fuse_projections(self) -> None:
        """Fuse projections that read the same input (KDA q|k|v|f|g, MLA q|kv_a|g, MLP gate|up) into one
        weight each, so a decode step streams them in one launch."""
        for m in self.modules():
            if hasattr(m, "input_projections") and m.fused is None:
                parts = m.input_projections()
                if FusedLinear.can_fuse(parts):
                    m.fused = FusedLinear(parts)

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed[ids]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, state: ConversationState, keep_steps: bool = False,
                span: Span | None = None) -> tuple[torch.Tensor, dict[int, KDASteps]]:
        """Run T new tokens at positions start.. through the layers, updating `state`.

        Returns the final hidden states after `model.norm` [T, H] (what the head and the MTP layer read)
        and, with keep_steps, each KDA layer's kept inputs (its recurrent state left for commit_kda).
        """
        span = span or Span.contiguous(start, ids.shape[0], ids.device)
        pending = None
        if self.fast_embed_norm is not None and ids.shape[0] <= GEMV_MAX_TOKENS:
            norm = self.layers[0].input_layernorm  # x and its norm at once: the first layer takes both
            x, h = self.fast_embed_norm(ids, self.embed, norm.weight, norm.eps)
            pending = NormedInput(h, norm)
        else:
            x = self.embed_tokens(ids)
        kept: dict[int, KDASteps] = {}
        for layer in self.layers:
            x, pending, steps = layer(x, pending, span, state, self.rotary, keep_steps)
            if steps is not None:
                kept[layer.idx] = steps
        _, normed = self.norm.add_norm(x, pending)
        return normed, kept

    def draft_logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """The draft's logits: through the target's own head module, whatever its precision — over the
        whole vocabulary [T, V], or over `lm_head.draft_ids` [T, N] when the head has draft rows."""
        return self.lm_head(mtp_hidden, draft=True)

    @torch.inference_mode()
    def draft(self, next_ids: torch.Tensor, hidden: torch.Tensor, start: int, cache: MLACache,
              span: Span | None = None) -> torch.Tensor:
        """One MTP step over T slots: slot t combines the main hidden at position start+t with the token
        at start+t+1. Returns the MTP hidden after its final_layernorm [T, H]."""
        span = span or Span.contiguous(start, next_ids.shape[0], next_ids.device)
        return self.mtp(next_ids, self.embed, hidden, span, cache, self.rotary)

"""The state of one conversation, preallocated to the maximum context: MLA latent caches, KDA
recurrent and conv states, the MTP layer's own cache, and the tokens they hold."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from sparkchat.engine.config import ModelConfig
from sparkchat.engine.nn.kda import KDAState, KDASteps, commit_steps
from sparkchat.engine.nn.mla import MLACache


@dataclass
class StateCheckpoint:
    token_ids: list[int]
    kda: dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ConversationState:
    max_context: int
    kda: dict[int, KDAState]
    mla: dict[int, MLACache]
    mtp: MLACache | None
    hidden: torch.Tensor  # [max_ctx, H]: the main model's normed hidden per position (MTP input)
    token_ids: list[int] = field(default_factory=list)  # tokens whose effect the state holds
    mtp_length: int = 0  # positions the MTP layer's cache holds, computed from true hidden states

    @staticmethod
    def bytes_needed(cfg: ModelConfig, max_context: int, dtype: torch.dtype) -> int:
        """What allocate() will take: the MLA latent caches (and the MTP layer's) and its hidden rows grow
        with max_context; the KDA states do not."""
        size = torch.empty(0, dtype=dtype).element_size()
        D, K = cfg.kda_dim, cfg.short_conv_kernel_size
        kda = len(cfg.kda_layers) * ((K - 1) * 3 * D * size + cfg.num_attention_heads * cfg.head_dim ** 2 * 4)
        caches = len(cfg.mla_layers) + (1 if cfg.has_mtp else 0)
        per_position = caches * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + (cfg.hidden_size if cfg.has_mtp else 0)
        return kda + max_context * per_position * size

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_context: int, device: torch.device | str,
                 dtype: torch.dtype) -> "ConversationState":
        D = cfg.kda_dim
        kda = {
            i: KDAState(
                conv=torch.zeros(cfg.short_conv_kernel_size - 1, 3 * D, device=device, dtype=dtype),
                recurrent=torch.zeros(cfg.num_attention_heads, cfg.head_dim, cfg.head_dim, device=device,
                                      dtype=torch.float32),
            )
            for i in cfg.kda_layers
        }

        def mla_cache() -> MLACache:
            return MLACache(
                latent=torch.zeros(max_context, cfg.kv_lora_rank, device=device, dtype=dtype),
                rope_key=torch.zeros(max_context, cfg.qk_rope_head_dim, device=device, dtype=dtype),
            )

        mla = {i: mla_cache() for i in cfg.mla_layers}
        hidden = torch.zeros(max_context if cfg.has_mtp else 0, cfg.hidden_size, device=device, dtype=dtype)
        return cls(max_context, kda, mla, mla_cache() if cfg.has_mtp else None, hidden)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def reset(self) -> None:
        """Forget the conversation. MLA caches need no clearing: positions past `length` are never read."""
        for s in self.kda.values():
            s.conv.zero_()
            s.recurrent.zero_()
        self.token_ids = []
        self.mtp_length = 0

    def commit_kda(self, kept: dict[int, KDASteps], last: int | torch.Tensor) -> None:
        """Right after a multi-token step with kept steps (which left every recurrent state as it found
        it), set every KDA layer to its state right after new position `last` (0-based within the step):
        the delta rule run from the untouched state over the kept inputs of positions 0 … last, and the
        conv state made of the K-1 inputs that end there. On CUDA one kernel commits every layer
        (kernels/kda_commit.py; the loop below is its twin; SPARKCHAT_COMMIT_KERNEL=0 keeps the loop).
        `last` may be a one-element int64 tensor the GPU's acceptance wrote: the kernel reads it there.
        last = -1 undoes the step: the conv states as it found them (it left the recurrent ones alone)."""
        if not kept:
            return
        if next(iter(self.kda.values())).recurrent.is_cuda and os.environ.get("SPARKCHAT_COMMIT_KERNEL", "1") != "0":
            from sparkchat.engine.kernels.kda_commit import kda_commit

            kda_commit([(self.kda[i].recurrent, s.inputs, self.kda[i].conv, s.window) for i, s in kept.items()], last)
            return
        last = int(last)  # the loop's twin needs it on the host
        for i, steps in kept.items():
            s = self.kda[i]
            k_1 = s.conv.shape[0]
            commit_steps(s.recurrent, steps.inputs, last)
            s.conv.copy_(steps.window[last + 1: last + 1 + k_1])

    def checkpoint(self) -> "StateCheckpoint":
        """Copies of what rolling back to this point needs: the KDA states (MLA rows past the point are
        simply rewritten later) and the token count."""
        return StateCheckpoint(list(self.token_ids),
                               {i: (s.conv.clone(), s.recurrent.clone()) for i, s in self.kda.items()})

    def restore(self, cp: "StateCheckpoint") -> None:
        for i, (conv, rec) in cp.kda.items():
            self.kda[i].conv.copy_(conv)
            self.kda[i].recurrent.copy_(rec)
        self.token_ids = list(cp.token_ids)
        self.mtp_length = min(self.mtp_length, max(len(cp.token_ids) - 1, 0))

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of every live tensor (for tests and debugging: compare two states exactly)."""
        n = self.length
        out: dict[str, torch.Tensor] = {}
        for i, s in self.kda.items():
            out[f"kda.{i}.conv"] = s.conv.clone()
            out[f"kda.{i}.recurrent"] = s.recurrent.clone()
        for i, c in self.mla.items():
            out[f"mla.{i}.latent"] = c.latent[:n].clone()
            out[f"mla.{i}.rope_key"] = c.rope_key[:n].clone()
        return out

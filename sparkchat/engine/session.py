"""The Engine: a loaded model, its tokenizer, one conversation's state, and the runtime switches."""

from __future__ import annotations

import resource

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from threading import Event
from typing import Any

import torch

from sparkchat.engine.config import ModelConfig
from sparkchat.engine.errors import ContextOverflowError, ModelError
from sparkchat.engine.events import GenerationStats, ResponseEvent, SamplingParams, Switches, SwitchState
from sparkchat.engine.generate import generate_tokens
from sparkchat.engine.loader import load_model
from sparkchat.engine.model import LingModel
from sparkchat.engine.state import ConversationState
from sparkchat.engine.tokenizer import ChatTokenizer
from sparkchat.engine.traffic import decode_bytes, read_bandwidth

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelError(f"unknown device {device!r} (use auto, cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for, but no CUDA device is available here")
    if dev.type not in ("cpu", "cuda"):
        raise ModelError(f"unsupported device {device!r} (use auto, cpu or cuda)")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ModelError(f"unsupported dtype {dtype!r} (use auto, float32, bfloat16 or float16)")
    return _DTYPES[dtype]


def cache_dequantized(model: LingModel) -> None:
    """On the CPU, dequantize each FP8 linear and MXFP4 expert once, on first use, and keep it: the
    reference path then costs a plain matmul per step (the small demo model runs fast this way)."""
    from sparkchat.engine.model import LMHead
    from sparkchat.engine.nn.linear import Linear
    from sparkchat.engine.nn.moe import Experts

    for m in model.modules():
        if isinstance(m, (Experts, Linear, LMHead)):
            m.cache_dense = True


class Engine:
    def __init__(self, model: LingModel, tokenizer: ChatTokenizer, max_context: int, name: str,
                 model_dir: Path) -> None:
        self.model, self.tokenizer, self.name, self.model_dir = model, tokenizer, name, model_dir
        self.config: ModelConfig = model.cfg
        self.device = model.embed.device
        self.dtype = model.embed.dtype
        self.max_context = max_context
        self.state = ConversationState.allocate(self.config, max_context, self.device, self.dtype)
        cuda = self.device.type == "cuda"
        # the truncated draft head pays where the head's bytes dominate a draft step: on the GPU
        self.switches = Switches(mtp=model.mtp is not None, fp8_head=cuda, mxfp4_kernels=cuda, cuda_graphs=cuda,
                                 truncated_draft_head=cuda)
        self._graphs = None  # StepGraphs, built on first use
        self._token_ranking: tuple[list[int], str] | None = None  # the draft vocabulary's ranking, on first use
        self._chat_ids: set[int] | None = None
        self._draft_rows: dict[int, list[int] | None] = {}  # by draft vocabulary size
        self._prompt_checkpoint = None  # the state right after the last prompt, before its answer
        self._graph_key: tuple | None = None

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "auto", dtype: str = "auto", max_context: int = 8192,
             quantize_experts: bool | None = None,
             progress: Callable[[int, int], None] | None = None,
             stage: Callable[[str], None] | None = None) -> "Engine":
        """Load a model directory (config.json, safetensors, tokenizer.json, chat template). `progress`
        hears (bytes read, bytes to read) as the layers load; `stage`, a line for each slow step after
        them (compiling kernels)."""
        path = Path(model_dir).expanduser()
        cfg = ModelConfig.from_dir(path)
        tokenizer = ChatTokenizer.from_dir(path)
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        if max_context < 16:
            raise ModelError(f"max context {max_context} is too small (at least 16 tokens)")
        max_context = min(max_context, cfg.max_position_embeddings)
        if quantize_experts is None:
            quantize_experts = dev.type == "cuda"
        model = load_model(path, cfg, dev, dt, max_context, quantize_experts=quantize_experts, progress=progress)
        if dev.type == "cpu":
            cache_dequantized(model)
        elif _triton_builds_here(dev):  # else the torch path, uncompiled: it still answers
            from sparkchat.engine.kernels.kda_prefill import warm_up
            from sparkchat.engine.nn.ops import enable_compile

            enable_compile()
            warm_up(cfg.num_attention_heads, cfg.head_dim, dev, dt, stage)  # fla-core's prompt kernels
        if stage is not None:
            stage("measuring the memory's read bandwidth")
        read_bandwidth(dev)  # once a process, for the live stats (the first answer need not wait for it)
        return cls(model, tokenizer, max_context, path.name, path)

    # -- switches -----------------------------------------------------------------------------
    def switch_states(self) -> dict[str, SwitchState]:
        cuda = self.device.type == "cuda"
        has_mtp = self.model.mtp is not None
        kernels_ok, kernels_why = self._kernels_available()
        return {
            "mtp": SwitchState(self.switches.mtp and has_mtp, has_mtp,
                               None if has_mtp else "the checkpoint has no MTP (NextN) layer"),
            "fp8_head": SwitchState(self.switches.fp8_head, True,
                                    None if cuda else "runs through the reference dequantization on CPU"),
            "mxfp4_kernels": SwitchState(self.switches.mxfp4_kernels and kernels_ok, kernels_ok, kernels_why),
            "cuda_graphs": self._graphs_state(kernels_ok, kernels_why),
            "truncated_draft_head": self._draft_head_state(has_mtp),
        }

    def _draft_head_state(self, has_mtp: bool) -> SwitchState:
        V, n = self.config.vocab_size, self.switches.draft_vocab
        if not has_mtp:
            return SwitchState(False, False, "the checkpoint has no MTP (NextN) layer to draft with")
        if n >= V:
            return SwitchState(False, False, f"the vocabulary ({V:,} tokens) fits in the draft vocabulary "
                                             f"({n:,}): the draft runs the full head")
        if not self.switches.mtp:
            return SwitchState(False, True, "off while MTP is off")
        return SwitchState(self.switches.truncated_draft_head, True, f"top {n:,} of {V:,} tokens")

    def _graphs_state(self, kernels_ok: bool, kernels_why: str | None) -> SwitchState:
        if not kernels_ok:
            return SwitchState(False, False, f"CUDA graphs need the GPU kernels: {kernels_why}")
        if not self.switches.mxfp4_kernels:
            return SwitchState(False, True, "off while the MXFP4 kernels are off (the reference experts "
                                            "path synchronizes with the host)")
        return SwitchState(self.switches.cuda_graphs, True, None)

    def _kernels_available(self) -> tuple[bool, str | None]:
        from sparkchat.engine.fastpath import kernels_unavailable_reason

        why = kernels_unavailable_reason(self.device, self.dtype)
        return why is None, why

    def set_switches(self, switches: Switches) -> None:
        """Takes effect at the next answer; weights are never reloaded."""
        if not 1 <= switches.draft_steps <= 4:
            raise ValueError("draft_steps must be between 1 and 4")
        if switches.draft_vocab < 1:
            raise ValueError("draft_vocab must be at least 1")
        self.switches = replace(switches)

    def _apply_switches(self) -> dict[str, Any]:
        states = self.switch_states()
        head = self.model.lm_head
        if states["fp8_head"].on and head.fp8_weight is None:
            head.build_fp8()  # the BF16 weight stays, so the switch can go back
        head.use_fp8 = states["fp8_head"].on
        head.set_draft_rows(self.draft_rows(self.switches.draft_vocab) if states["truncated_draft_head"].on else None)
        if self._kernels_available()[0]:
            from sparkchat.engine import fastpath

            # FP8 linears always stream through the GEMV kernel on the GPU; experts and head per switch
            fastpath.install(self.model, linears=True, experts=states["mxfp4_kernels"].on,
                             head=states["fp8_head"].on)
        self._update_graphs(states["cuda_graphs"].on, states)
        effective = {name: s.on for name, s in states.items()}
        effective["draft_steps"] = self.switches.draft_steps
        effective["draft_vocab"] = len(head.draft_ids) if head.draft_ids is not None else self.config.vocab_size
        return effective

    def draft_rows(self, n: int) -> list[int] | None:
        """The truncated draft head's token ids: the chat format's tokens, then the best-ranked ids up to
        `n` (engine/draft_vocab.py: a ranked-id file, else the tokenizer's BPE merge order); None when
        `n` covers the vocabulary."""
        from sparkchat.engine import draft_vocab

        V = self.config.vocab_size
        if self._token_ranking is None:
            self._token_ranking = draft_vocab.token_ranking(self.model_dir, V)
            self._chat_ids = draft_vocab.chat_token_ids(self.tokenizer)
        if n not in self._draft_rows:
            self._draft_rows[n] = draft_vocab.draft_rows(self._token_ranking[0], n, self._chat_ids or (), V)
        return self._draft_rows[n]

    @property
    def draft_ranking_source(self) -> str | None:
        """Where the draft vocabulary's ranking came from (once it was built)."""
        return self._token_ranking[1] if self._token_ranking else None

    def _update_graphs(self, on: bool, states: dict[str, SwitchState]) -> None:
        if not on:
            self._graphs = None
            return
        head = self.model.lm_head
        key = (states["fp8_head"].on, states["mxfp4_kernels"].on,
               None if head.draft_ids is None else (head.draft_ids.numel(), int(head.draft_ids.sum())))
        if self._graphs is None:
            from sparkchat.engine.graphs import StepGraphs

            self._graphs = StepGraphs(self.model, self.state)
        elif key != self._graph_key:
            self._graphs.clear()  # the kernels inside the graphs changed
        self._graph_key = key

    # -- generation ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new chat: forget the kept conversation state."""
        self.state.reset()
        self._prompt_checkpoint = None

    def generate(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
                 enable_thinking: bool = True, cancel: Event | None = None) -> Iterator[ResponseEvent]:
        ids = self.tokenizer.encode_chat(messages, enable_thinking=enable_thinking)
        return self.generate_ids(ids, params, cancel=cancel)

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
                     cancel: Event | None = None) -> Iterator[ResponseEvent]:
        """Stream an answer to a whole prompt. If the kept state holds a prefix of it (the earlier turns
        of this chat), only the new tokens are prefilled."""
        params = params or SamplingParams()
        if not prompt_ids:
            raise ModelError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ContextOverflowError(f"the prompt is {len(prompt_ids)} tokens but the context holds "
                                       f"{self.max_context}; start a new chat or raise --max-context")
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ModelError(f"token id {bad[0]} is outside the model's vocabulary of {self.config.vocab_size}")
        self._reuse_state_for(prompt_ids)
        new_ids = prompt_ids[self.state.length:]
        return self._stream(prompt_ids, new_ids, params, cancel)

    def _reuse_state_for(self, prompt_ids: list[int]) -> None:
        """Keep as much computed state as the new prompt allows: all of it when the prompt extends what
        the state holds (the answer was given back as generated); else the state as it was right after
        the previous prompt (the template rewrote the answer, e.g. dropped its reasoning); else none."""
        def extends(ids: list[int]) -> bool:
            return len(ids) < len(prompt_ids) and prompt_ids[: len(ids)] == ids

        if extends(self.state.token_ids):
            return
        cp = self._prompt_checkpoint
        if cp is not None and extends(cp.token_ids):
            self.state.restore(cp)
            return
        self.state.reset()

    def _stream(self, prompt_ids: list[int], new_ids: list[int], params: SamplingParams,
                cancel: Event | None) -> Iterator[ResponseEvent]:
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        stats.switches = self._apply_switches()
        stats.bytes_per_token = decode_bytes(self.model, len(prompt_ids), self.model.lm_head.use_fp8)
        stats.read_bw_bytes_s = read_bandwidth(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        decoder = self.tokenizer.stream_decoder()
        stop_ids = set() if params.ignore_eos else self.tokenizer.stop_token_ids
        steps = generate_tokens(self.model, self.state, new_ids, params, stop_ids,
                                mtp=stats.switches["mtp"], draft_steps=self.switches.draft_steps,
                                cancel=cancel, stats=stats, graphs=self._graphs)
        try:
            for i, step in enumerate(steps):
                if i == 0:  # the prompt is in: remember this point for the next turn
                    self._prompt_checkpoint = self.state.checkpoint()
                text = "".join(decoder.push(t) for t in step.tokens)
                if step.finish_reason:
                    text += decoder.flush()
                    stats.peak_memory_bytes = self._peak_memory()
                if text or step.tokens or step.finish_reason:
                    yield ResponseEvent(text, step.tokens, step.finish_reason, stats)
        except BaseException:
            # interrupted inside a forward pass: the state may be half-updated, so drop it
            self.reset()
            raise

    def _peak_memory(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _triton_builds_here(device: torch.device) -> bool:
    from sparkchat.engine.fastpath import triton_unavailable_reason

    return triton_unavailable_reason(device) is None

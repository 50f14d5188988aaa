"""The GPU fast path: swap Triton kernels into a loaded model's hot spots, and back out again.

- FP8 block-scaled linears → `fp8_block_gemv` for decode and verify windows, `fp8_prompt_linear` for
  prompts (an FP8 GEMM for short ones, a one-pass dequant + bf16 matmul for long ones); an MLP's down
  projection computes the SwiGLU of its gate|up input as it loads it (`fp8_block_gemv_swiglu`); an attention
  layer's output projection does the residual add and RMSNorm after it (`fp8_block_gemv_add_norm`);
- a layer input's residual add + RMSNorm (decode and verify windows) → `add_rms_norm`, a PDL kernel;
- routed MXFP4 experts → `mxfp4_moe` (reads only the selected experts' 4-bit weights);
- the FP8 LM head → `fp8_head_gemv`;
- the router's group-limited top-k → `route` (one program per token);
- a KDA layer's core for decode/verify (conv, norms, gate, recurrence, output norm) → `kda_decode`;
- an MLA layer's decode/verify step after its input projections → `mla_decode_step` (prepare with the
  query fold, attention reading the latent cache once per block for all heads, merge + unfold + gate).
Each kernel has a pure-torch twin (the modules' own forward), which is what runs when a switch is off.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from sparkchat.engine.kernels.device import is_sm90
from sparkchat.engine.nn.moe import MLP, Experts, MoE
from sparkchat.engine.nn.norm import RMSNorm


def kernels_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the Triton kernels can run here, else why not (one line)."""
    if device.type != "cuda":
        return "needs a CUDA device (Triton kernels); the CPU runs the dequantize-then-matmul path"
    if dtype != torch.bfloat16:
        return f"the kernels run bfloat16 activations; this engine runs {str(dtype).removeprefix('torch.')}"
    try:
        from sparkchat.engine.kernels import fp8_gemv, kda_decode, mla_decode, mxfp4_moe  # noqa: F401
    except ImportError as e:
        return f"Triton is not importable: {e}"
    return triton_unavailable_reason(device)


def triton_unavailable_reason(device: torch.device) -> str | None:
    """None when Triton can build kernels for this CUDA device (ours, Inductor's, fla-core's), else why
    not in one line: not installed, or its ptxas does not know the GPU (kernels.compile_check)."""
    try:
        from sparkchat.engine.kernels.compile_check import compile_failure
    except ImportError as e:
        return f"Triton is not importable: {e}"
    major, minor = torch.cuda.get_device_capability(device)
    return compile_failure(10 * major + minor)


class ExpertsKernel:
    """Experts.forward's signature, through the MXFP4 MoE kernel for decode/verify windows.

    `shared` (the layer's shared expert, FP8) with `shared_mode` 1 or 2: the routed stages run it too
    (mxfp4_moe's `shared`), its down projection (1, any decode window) or at one token both its
    projections (2); see shared_in_stages_mode. `add_norm`: the last launch may also do the residual add
    and the norm after the layer (fuses_norm)."""

    MAX_TOKENS = 8
    # the shared expert and the next norm inside the stages: one token only. In verify windows (4 tokens)
    # both cost more than they save on the H200 (2026-12-05: verify of 4 +0.47 ms with the shared down in
    # stage 2, +0.65 ms with the norm; docs/benchmarks.md session 23)
    FUSED_MAX_TOKENS = 1

    def __init__(self, experts: Experts, shared: MLP | None = None, shared_mode: int = 0,
                 add_norm: bool = False) -> None:
        self.experts = experts
        self.shared_mlp = shared if shared_mode else None
        self.shared_mode = shared_mode
        self.add_norm = add_norm
        self._shared = None

    def fuses_norm(self, x: torch.Tensor) -> bool:
        """True when this call's last launch can also do the residual add and the RMSNorm after the layer
        (`norm`; SPARKCHAT_MOE_ADD_NORM=1): one token (FUSED_MAX_TOKENS), on the GPU (or the interpreter)."""
        return (self.add_norm and x.shape[0] <= self.FUSED_MAX_TOKENS and x.dtype == torch.bfloat16
                and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"))

    def splits_norm(self, x: torch.Tensor, norm: RMSNorm) -> bool:
        """True when, the norm fused (fuses_norm), the last launch does only its first half — the add and
        the sums of squares (SPARKCHAT_MOE_ADD_NORM=2) — for a norm whose reader finishes it (split_ok)."""
        return self.add_norm == 2 and norm.split_ok and self.fuses_norm(x)

    def fuses_shared(self, x: torch.Tensor) -> int:
        """0, or how the stages take the shared expert for this input (one token, FUSED_MAX_TOKENS): 1 its
        down rows (the gate|up GEMV still runs on a side stream, its output passed as `shared_gate_up`),
        2 both."""
        T = x.shape[0]
        on_device = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
        if self.shared_mlp is None or T > self.FUSED_MAX_TOKENS or not on_device:
            return 0
        from sparkchat.engine.kernels.mxfp4_moe import shared_fusable

        spec = self._shared_expert()
        ex = self.experts
        if spec is None:
            return 0
        if self.shared_mode == 2 and shared_fusable(spec, T, ex.hidden, ex.inter):
            return 2
        return 1 if shared_fusable(spec, T, ex.hidden, ex.inter, stage1=False) else 0

    def _shared_expert(self):
        """The shared MLP's tensors as mxfp4_moe.SharedExpert (None when it is not in the FP8 form)."""
        from sparkchat.engine.kernels.mxfp4_moe import SharedExpert

        mlp = self.shared_mlp
        fused, down = mlp.fused, mlp.down_proj
        if fused is None or not (fused.is_fp8 and down.is_fp8) or (fused.block, down.block) != ((128, 128),) * 2:
            return None
        if self._shared is None or self._shared.gate_up is not fused.weight or self._shared.down is not down.weight:
            self._shared = SharedExpert(fused.weight, fused.weight_scale_inv, fused.offsets[1], down.weight,
                                        down.weight_scale_inv, mlp.limit)
        return self._shared

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 add: torch.Tensor | None = None, join: Callable[[], None] | None = None,
                 shared_gate_up: torch.Tensor | None = None, shared: bool = False,
                 norm: tuple[torch.Tensor, torch.Tensor, float] | None = None):
        """The routed experts' output, plus `add` (the shared expert's) when given: the kernel adds it
        in its final sum, saving a launch. `join`: call before reading `add` or `shared_gate_up` (made
        on a side stream). `shared` (where fuses_shared says so): the stages compute the shared expert
        and add it, from `shared_gate_up` (its gate|up output) when given. `norm` (residual, norm
        weight, eps, split; where fuses_norm says so): returns (residual + output, RMSNorm of it) instead,
        with `split` (splits_norm) (residual + output, its sums of squares in parts)."""
        if x.shape[0] > self.MAX_TOKENS:  # prefill: the grouped MXFP4 GEMM (kernels/moe_prefill.py)
            if join is not None:
                join()
            ex = self.experts
            if x.dtype == torch.bfloat16 and (x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"):
                from sparkchat.engine.kernels.moe_prefill import moe_prefill

                return moe_prefill(x.contiguous(), ids.contiguous(), weights.float().contiguous(), ex.w13,
                                   ex.w13_scale, ex.w2, ex.w2_scale, ex.limit,
                                   add=None if add is None else add.contiguous(), paired=ex.paired)
            out = ex(x, ids, weights)  # the reference path
            return out if add is None else out + add
        from sparkchat.engine.kernels.mxfp4_moe import mxfp4_moe, mxfp4_moe_add_norm, mxfp4_moe_add_sumsq

        ex = self.experts
        args = (x.contiguous(), ids.contiguous(), weights.float().contiguous(), ex.w13, ex.w13_scale, ex.w2,
                ex.w2_scale, ex.limit)
        kwargs = dict(add=add, join=join, paired=ex.paired,
                      x_packed=getattr(x, "moe_x", None),  # written by the norm before (install)
                      shared=self._shared_expert() if shared else None, shared_gate_up=shared_gate_up)
        if norm is not None:
            residual, weight, eps, split = norm
            if split:
                return mxfp4_moe_add_sumsq(*args, residual.contiguous(), **kwargs)
            return mxfp4_moe_add_norm(*args, residual.contiguous(), weight, eps, **kwargs)
        return mxfp4_moe(*args, **kwargs)


def l2_prefetch_bytes(device: torch.device | None = None) -> int:
    """How much of the next layer's first weight a one-token MoE layer's top-k launch asks L2 for
    (Router.l2_prefetch), read when a step is launched or captured: SPARKCHAT_L2_PREFETCH_MB (MB; 0 off),
    by default 8 MB on sm_90 GPUs (the H100 and H200) and none elsewhere. On the H100 it made the graphed
    step 1% faster in three runs (2.440 -> 2.416, 2.445 -> 2.417 ms; docs/benchmarks.md session 34); the
    Spark (sm_121) stays off until measured: the lines would have to outlive ~30 MB of expert streaming
    in its smaller L2, and if they do not, each prefetched byte is read twice on a bandwidth-bound
    machine. SPARKCHAT_L2_PREFETCH_PACE paces it (kernels/router.py)."""
    value = os.environ.get("SPARKCHAT_L2_PREFETCH_MB")
    if value is None:
        return DEFAULT_L2_PREFETCH if device is not None and is_sm90(device) else 0
    try:
        return max(0, int(float(value) * 1e6))
    except ValueError:
        return 0


DEFAULT_L2_PREFETCH = 8_000_000


def _weight_ahead(attention, head) -> torch.Tensor | None:
    """The last l2_prefetch_bytes() of what the layer after a MoE layer streams first — `attention`'s
    fused input projection, or with no layer after it the head in the precision it runs — as bytes, or
    None (off, or nothing contiguous on the GPU to ask for). The last: that GEMV's first programs load
    their rows before their PDL wait, while the MoE's stage 2 runs; its last ones, once stage 2's
    programs have left the SMs, are the ones the step waits for (asking for its first bytes instead made
    the H100's step 0.01-0.17 ms slower for 8-24 MB)."""
    if attention is not None:
        fused = getattr(attention, "fused", None)
        weight = fused.weight if fused is not None else None
    else:
        weight = head.fp8_weight if head.use_fp8 else head.weight
    if weight is None or not weight.is_cuda or not weight.is_contiguous():
        return None
    n = l2_prefetch_bytes(weight.device)
    if n < 128:
        return None
    flat = weight.view(-1).view(torch.uint8)
    return flat[max(0, flat.numel() - n):]


def side_stream_enabled() -> bool:
    """The shared expert runs on a side stream alongside the routing unless SPARKCHAT_SIDE_STREAM=0."""
    return os.environ.get("SPARKCHAT_SIDE_STREAM", "1") != "0"


def shared_in_stages_mode() -> int:
    """How a MoE layer runs its shared expert in decode windows, from SPARKCHAT_MOE_SHARED: 0 as two
    GEMVs on a side stream (verify windows always do); at one token (ExpertsKernel.FUSED_MAX_TOKENS) 1
    its gate|up GEMV on the side stream, its down rows inside stage 2, 2 (the default) both inside the
    routed stages, no side stream. Mode 2, session 28, on top of session 27's defaults: the graphed step
    2.552 -> 2.479 ms on an H100, 2.143 -> 2.080 on an H200 (mode 1 left it as it was on the H200). Its
    answers differ from mode 0's only by roundings: where one is far, as from some saved states, a
    routing choice was a near tie (MoE layer 17 of 40 first chose other experts, its 8th and 9th scores
    8.4e-5 apart, far below a bf16 ulp), and the same with PDL off (docs/benchmarks.md session 28,
    benchmarks/race_check.py --routes)."""
    value = os.environ.get("SPARKCHAT_MOE_SHARED", "2")
    return int(value) if value in ("0", "1", "2") else 0


def moe_add_norm_mode() -> int:
    """SPARKCHAT_MOE_ADD_NORM: 1, a MoE layer's stage 2 also does the residual add and the next RMSNorm
    (the next layer's input norm, or the final norm), saving that add+norm's launch (one token; H200,
    2026-12-05: the one-token step -0.01 ms, within the runs' spread: the last row block's serial norm
    costs about what the launch did); 2, as 1 but stage 2 does only the add and the sums of squares, and
    the next layer's input projection GEMV finishes the norm as it loads its input (no serial tail; the
    final norm as 1); 0, the add+norm kernel. Default 2: H100, session 27, the graphed one-token step
    2.632 -> 2.571 ms alone, logits as mode 0's (docs/benchmarks.md)."""
    value = os.environ.get("SPARKCHAT_MOE_ADD_NORM", "2")
    return int(value) if value in ("1", "2") else 0


def shared_add_late_enabled() -> bool:
    """SPARKCHAT_SHARED_ADD_LATE=1: a MoE layer's shared expert output (side stream) is added by the next
    norm's add+norm kernel instead of by the routed experts' stage 2, so stage 2 (launched early by PDL,
    its weights loaded during stage 1) does not wait for the side stream: since stage 1 took 16-byte loads
    the shared expert's down GEMV often ends after it (docs/benchmarks.md session 23). On unless set to 0:
    H100, session 27, step 2.633 -> 2.588 ms, verify of 4 4.647 -> 4.562 ms, logits as off's."""
    return os.environ.get("SPARKCHAT_SHARED_ADD_LATE", "1") == "1"


def split_moe_input_norm_enabled() -> bool:
    """SPARKCHAT_SPLIT_MOE_INPUT_NORM=1: at one token a MoE layer's input norm is split between the
    attention's output projection (its GEMV writes the residual sum and its sums of squares) and the
    MoE's readers: the router's GEMV applies the norm as it loads the sum and writes the norm's output
    (and stage 1's packed planes), the shared expert's gate|up GEMV applies it too; no program runs the
    norm alone and no launch is spent on it. On unless set to 0: H100, session 27, step 2.633 -> 2.616 ms
    alone, and with SPARKCHAT_MOE_ADD_NORM=2 and SPARKCHAT_SHARED_ADD_LATE=1 2.634 -> 2.549 ms."""
    return os.environ.get("SPARKCHAT_SPLIT_MOE_INPUT_NORM", "1") == "1"


SPLIT_NORM_WINDOW = 5  # every verify window the settings allow (k + 1 <= 5 tokens)


def split_norm_window() -> int:
    """SPARKCHAT_SPLIT_NORM_WINDOW=T: the MoE input norm is split (split_moe_input_norm_enabled) for
    windows of up to T tokens (default SPLIT_NORM_WINDOW; 1: one-token steps only). In a verify window
    the output projection's add+norm then ends without its last row block's serial norm over every
    token; the router's GEMV finishes the norm as at one token, and the shared expert's tensor-core
    gate|up (on the side stream) has the norm written for itself first. H100, the graphed 4-token
    verify: 4.341 -> 4.123 ms (medians of 3 rounds), the output projection 15.9 -> 10.8 µs exposed a call
    (docs/benchmarks.md session 31)."""
    return max(1, int(os.environ.get("SPARKCHAT_SPLIT_NORM_WINDOW", str(SPLIT_NORM_WINDOW))))


def paired_words_enabled() -> bool:
    """The MXFP4 experts are reordered into the kernels' paired word layout when the MoE kernels are
    installed, unless SPARKCHAT_MOE_PAIRED=0 (then the kernels decode the checkpoint's order)."""
    return os.environ.get("SPARKCHAT_MOE_PAIRED", "1") != "0"


def mla_step_enabled() -> bool:
    """An MLA layer's decode/verify step runs as the three Triton kernels of `mla_decode_step`, unless
    SPARKCHAT_MLA_STEP=0 (then the compiled twin, nn.mla.absorbed_step). H200: the one-token step
    0.08 ms faster, docs/benchmarks.md session 11."""
    return os.environ.get("SPARKCHAT_MLA_STEP", "1") != "0"


def moe_x_packed_enabled() -> bool:
    """A MoE layer's input norm (its attention's output projection + add + norm) also writes the
    activations as the packed stage 1 multiplies them, unless SPARKCHAT_MOE_X_PACKED=0 (H200: the
    one-token step 0.008-0.017 ms faster, docs/benchmarks.md session 10)."""
    return os.environ.get("SPARKCHAT_MOE_X_PACKED", "1") != "0"


def add_norm_kernel_enabled() -> bool:
    """A layer input's residual add + RMSNorm runs as a PDL kernel unless SPARKCHAT_ADD_NORM=0
    (then Inductor's fused kernel, outside the PDL chain)."""
    return os.environ.get("SPARKCHAT_ADD_NORM", "1") != "0"


def embed_norm_enabled() -> bool:
    """A step's embedding and first norm run as one PDL kernel (kernels.embed_norm) unless
    SPARKCHAT_EMBED_NORM=0."""
    return os.environ.get("SPARKCHAT_EMBED_NORM", "1") != "0"


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device, shared by every MoE layer (they run one after another)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _fp8_gemv() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv, take_split_norm

    def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # a norm's output may carry its fp16 form for the tensor-core kernel (fp8_gemv._f16_outputs), or
        # be still unwritten, its norm left for this GEMV to finish (h.split_norm, SPARKCHAT_MOE_ADD_NORM=2)
        split = take_split_norm(x)
        return fp8_block_gemv(x.contiguous(), w, scale, x_f16=getattr(x, "f16_acts", None), split_norm=split)

    return gemv


def prompt_gemm_enabled() -> bool:
    """A prompt's FP8 linears run through kernels/fp8_gemm.py unless SPARKCHAT_FP8_GEMM=0 (then each
    weight is dequantized to bf16 in torch for a torch matmul on every prompt, the reference path)."""
    return os.environ.get("SPARKCHAT_FP8_GEMM", "1") != "0"


def _fp8_gemm() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    from sparkchat.engine.kernels.fp8_gemm import fp8_prompt_linear

    def gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return fp8_prompt_linear(x.reshape(-1, x.shape[-1]).contiguous(), w, scale).view(*lead, w.shape[0])

    return gemm


def _fp8_head() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    from sparkchat.engine.kernels.fp8_gemv import fp8_head_gemv

    def head(h: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if h.shape[0] <= 8:
            return fp8_head_gemv(h.contiguous(), w, scale, x_f16=getattr(h, "f16_acts", None))
        h = h.contiguous()
        # a prompt's logits: windows of 8 rows, never a dequantized copy of the 157K-row head
        return torch.cat([fp8_head_gemv(h[i:i + 8], w, scale) for i in range(0, h.shape[0], 8)])

    return head


def _fp8_head_argmax() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    from sparkchat.engine.kernels.fp8_gemv import fp8_head_argmax, fp8_head_gemv, gemv_config

    def head_argmax(h: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        cfg = gemv_config("head", h.shape[0], w.shape[0], w.shape[1])
        if cfg.mma or cfg.split > 1:  # the logits kernel sums in another order there: pick from its logits
            return fp8_head_gemv(h.contiguous(), w, scale, x_f16=getattr(h, "f16_acts", None)).argmax(-1)
        return fp8_head_argmax(h.contiguous(), w, scale, config=cfg)  # the logits' very sums

    return head_argmax


def _mla_step() -> Callable[..., torch.Tensor]:
    from sparkchat.engine.kernels.mla_decode import mla_decode_step

    return mla_decode_step  # nn.mla.absorbed_step's arguments -> out_proj's input [T, heads * v_dim]


def install(model, *, linears: bool, experts: bool, head: bool) -> None:
    """Turn each kernel family on or off on `model` (a LingModel on CUDA, bf16). `linears` also
    routes with the Triton router kernel."""
    from sparkchat.engine.nn import moe
    from sparkchat.engine.nn.ops import ops

    if linears:
        from sparkchat.engine.kernels.router import route

        ops.route = route
    elif ops.route is not moe.route and getattr(ops.route, "__module__", "").endswith("kernels.router"):
        ops.route = moe.route
    gemv = _fp8_gemv() if linears else None
    gemm = _fp8_gemm() if linears and prompt_gemm_enabled() else None
    for lin in model.linears():
        on_gpu = lin.is_fp8 and lin.weight.is_cuda
        lin.fast = gemv if on_gpu else None
        # the kernel takes fp32 block scales [ceil(N/128), ceil(K/128)] (what the loader makes)
        blocks = on_gpu and lin.block == (128, 128) and lin.weight_scale_inv.dtype == torch.float32
        lin.fast_prompt = gemm if blocks and lin.weight.is_contiguous() else None
    from sparkchat.engine.nn.kda import KimiDeltaAttention
    from sparkchat.engine.nn.mla import MultiLatentAttention

    mla_step = _mla_step() if linears and mla_step_enabled() else None
    kda_core = None
    if linears:
        from sparkchat.engine.kernels.kda_decode import kda_decode as kda_core
    swiglu_down = add_norm = add_rms_norm = None
    if linears:
        from sparkchat.engine.kernels.fp8_gemv import add_rms_norm
        from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv_add_norm as add_norm
        from sparkchat.engine.kernels.fp8_gemv import fp8_block_gemv_swiglu as swiglu_down
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.fast_add = add_rms_norm if m.weight.is_cuda and add_norm_kernel_enabled() else None
        if isinstance(m, MLP):
            m.swiglu_down = swiglu_down if m.down_proj.is_fp8 and m.down_proj.weight.is_cuda else None
        if isinstance(m, (KimiDeltaAttention, MultiLatentAttention)):
            out = m.out_proj
            out.fast_add_norm = add_norm if out.is_fp8 and out.weight.is_cuda else None
        if isinstance(m, KimiDeltaAttention):
            m.fast_core = kda_core if m.A_log.is_cuda else None
        if isinstance(m, MoE):
            m.fast_experts = (ExpertsKernel(m.experts, m.shared_experts, shared_in_stages_mode(),
                                            moe_add_norm_mode()) if experts and m.experts.is_mxfp4 else None)
            if m.fast_experts is not None and m.experts.w13.is_cuda:
                m.experts.use_paired_words(paired_words_enabled())  # the reference path unpairs what it reads
            overlap = m.fast_experts is not None and m.experts.w13.is_cuda and side_stream_enabled()
            m.side_stream = side_stream(m.experts.w13.device) if overlap else None
            m.late_shared_add = m.fast_experts is not None and shared_add_late_enabled()
        elif isinstance(m, MultiLatentAttention):
            m.fast_step = mla_step if m.kv_b_proj.weight.is_cuda else None
    if add_norm is not None and experts and moe_x_packed_enabled():
        mtp = [model.mtp] if getattr(model, "mtp", None) is not None else []
        for layer in [*getattr(model, "layers", ()), *mtp]:  # the norm before a MoE also packs its activations
            out = layer.attention.out_proj
            if isinstance(layer.mlp, MoE) and layer.mlp.fast_experts is not None and out.fast_add_norm is not None:
                out.fast_add_norm = functools.partial(add_norm, moe_x=True)
    layers = list(getattr(model, "layers", ()))
    for layer in layers:  # the MoE input norm split between the output projection and the MoE's readers
        post, m = layer.post_attention_layernorm, layer.mlp
        shared = getattr(m, "shared_experts", None)
        post.split_ok = (split_moe_input_norm_enabled() and linears and isinstance(m, MoE)
                         and m.fast_experts is not None and layer.attention.out_proj.fast_add_norm is not None
                         and (shared is None or (shared.fused is not None and shared.fused.fast is not None)))
        post.split_window = split_norm_window()
    # a MoE layer hands the next layer its input already added and normed (the next norm passed to it)
    for i, layer in enumerate(layers):
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else getattr(model, "norm", None)
        fast = layer.mlp.fast_experts if isinstance(layer.mlp, MoE) else None
        layer.next_norm = nxt if fast is not None and fast.add_norm else None
        if i + 1 < len(layers):  # the next layer's input projection can finish the norm (mode 2)
            proj = getattr(layers[i + 1].attention, "fused", None)
            nxt.split_ok = (fast is not None and fast.add_norm == 2 and proj is not None and proj.is_fp8
                            and proj.fast is not None)
    # each one-token MoE layer's top-k launch asks L2 for the end of what the next layer reads first (its
    # fused input projection; after the last layer, the head) while HBM idles (SPARKCHAT_L2_PREFETCH_MB)
    for i, layer in enumerate(layers):
        if isinstance(layer.mlp, MoE):
            nxt = layers[i + 1].attention if i + 1 < len(layers) else None
            on = linears and layer.mlp.gate.weight.is_cuda
            layer.mlp.gate.l2_prefetch = functools.partial(_weight_ahead, nxt, model.lm_head) if on else None
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        mtp.fuse_final_norm = mtp.mlp.fast_experts is not None and mtp.mlp.fast_experts.add_norm
    # a step's first launch: the embedding gathered and normed (the MTP draft's: both its norms) in one
    # PDL kernel instead of torch's gather and Inductor's norm (SPARKCHAT_EMBED_NORM=0: those)
    table = getattr(model, "embed", None)
    first = linears and embed_norm_enabled() and table is not None and table.is_cuda and table.dtype == torch.bfloat16
    if first:
        from sparkchat.engine.kernels.embed_norm import embed_norm, mtp_input
    if hasattr(model, "fast_embed_norm"):
        model.fast_embed_norm = embed_norm if first else None
    if mtp is not None:
        mtp.fast_input = mtp_input if first else None
        # eh_proj and the norm after it in the output projections' add+norm launches, with no residual
        # (SPARKCHAT_EMBED_NORM=0: the GEMV, then Inductor's norm outside the PDL chain)
        eh = mtp.eh_proj
        eh.fast_add_norm = add_norm if first and add_norm is not None and eh.is_fp8 and eh.weight.is_cuda else None
    model.lm_head.fast_fp8 = _fp8_head() if head else None
    model.lm_head.fast_fp8_argmax = _fp8_head_argmax() if head else None

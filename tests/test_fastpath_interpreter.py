"""The engine's Triton fast path (FP8 GEMV and prompt GEMM, MXFP4 MoE, router, KDA and MLA decode kernels) against its reference path, run
through Triton's CPU interpreter: the same kernels the GPU runs, checked without a GPU. Skipped where
Triton is not installed (CPU-only CI)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import os, sys, torch
from sparkchat.engine.config import ModelConfig
from sparkchat.engine.generate import Decoder
from sparkchat.engine.loader import load_model
from sparkchat.engine.state import ConversationState
from sparkchat.engine import fastpath
from sparkchat.engine.nn import moe
from sparkchat.engine.nn.ops import ops

path, together = sys.argv[1], sys.argv[2] == "together"  # together: every candidate on every MoE layer
cfg = ModelConfig.from_dir(path)
model = load_model(path, cfg, "cpu", torch.bfloat16, 128, quantize_experts=True)
prompt, follow, window = list(range(5, 30)), [7, 8, 9, 10, 11], [12, 13, 14, 15]

def logits():
    state = ConversationState.allocate(cfg, 128, "cpu", torch.bfloat16)
    dec = Decoder(model, state)
    _, l, _ = dec.forward(prompt); dec.commit(prompt)
    out = [l[-1]]
    for t in follow:
        _, l, _ = dec.forward([t]); dec.commit([t]); out.append(l[-1])
    _, l, _ = dec.forward(window)  # a verify's window
    return torch.cat([torch.stack(out), l])

ref = logits()
gemv, gemm = fastpath._fp8_gemv(), fastpath._fp8_gemm()
prompt_rows = []
def counted_gemm(x, w, s):
    prompt_rows.append(x.shape[0])
    return gemm(x, w, s)
split_reads = []
def counted_gemv(x, w, s):
    split_reads.append(hasattr(x, "split_norm"))
    return gemv(x, w, s)
for lin in model.linears():
    lin.fast = counted_gemv if lin.is_fp8 else None
    lin.fast_prompt = counted_gemm if lin.is_fp8 else None
from sparkchat.engine.kernels.kda_decode import kda_decode
from sparkchat.engine.kernels.mla_decode import mla_decode_step
from sparkchat.engine.nn.kda import KimiDeltaAttention
from sparkchat.engine.nn.mla import MultiLatentAttention
from sparkchat.engine.kernels.fp8_gemv import add_rms_norm, fp8_block_gemv_add_norm, fp8_block_gemv_swiglu
from sparkchat.engine.nn.norm import RMSNorm
calls, packed_x, in_stages, normed, late_adds = [], [], [], [], []
class CountingExperts(fastpath.ExpertsKernel):
    def __call__(self, x, *args, **kw):
        packed_x.append(hasattr(x, "moe_x"))
        in_stages.append(kw.get("shared", False))
        normed.append(kw.get("norm") is not None)
        return super().__call__(x, *args, **kw)
def counted_add_norm(*args, **kw):
    calls.append(args[0].shape[0])
    late_adds.append(kw.get("add") is not None)
    return add_rms_norm(*args, **kw)
for m in model.modules():
    if isinstance(m, RMSNorm):
        m.fast_add = counted_add_norm
    if isinstance(m, moe.MLP) and m.down_proj.is_fp8:
        m.swiglu_down = fp8_block_gemv_swiglu
    if isinstance(m, (KimiDeltaAttention, MultiLatentAttention)) and m.out_proj.is_fp8:
        m.out_proj.fast_add_norm = fp8_block_gemv_add_norm
    if isinstance(m, moe.MoE):
        # every other MoE layer runs its shared expert inside the routed stages (SPARKCHAT_MOE_SHARED=2)
        moe_layers = getattr(model, "_moe_seen", 0)
        model._moe_seen = moe_layers + 1
        # every third one adds its output and runs the next norm in stage 2 (SPARKCHAT_MOE_ADD_NORM=1)
        # (the first leaves the norm's second half to the next layer's input projection: mode 2)
        m.fast_experts = CountingExperts(m.experts, m.shared_experts, 2 if moe_layers % 2 or together else 0,
                                         add_norm=(2 if moe_layers == 0 or together else 1)
                                         if moe_layers % 3 == 0 or together else 0)
        # the third leaves its shared expert's output to the next norm's add (SPARKCHAT_SHARED_ADD_LATE=1)
        m.late_shared_add = moe_layers == 2 or together
        m.experts.use_paired_words()  # as install() does on a GPU: the kernels read the paired word order
    elif isinstance(m, KimiDeltaAttention):
        m.fast_core = kda_decode
    elif isinstance(m, MultiLatentAttention):
        m.fast_step = mla_decode_step
for i, layer in enumerate(model.layers):  # as install() does with SPARKCHAT_MOE_ADD_NORM=1
    nxt = model.layers[i + 1].input_layernorm if i + 1 < len(model.layers) else model.norm
    fe = getattr(layer.mlp, "fast_experts", None)
    layer.next_norm = nxt if fe is not None and fe.add_norm else None
    nxt.split_ok = fe is not None and fe.add_norm == 2 and i + 1 < len(model.layers)
import functools
split_inputs, split_windows = [], []
def split_add_norm(*args, **kw):
    split_inputs.append(kw.get("split_norm", False))
    if kw.get("split_norm", False):
        split_windows.append(args[0].shape[0])
    return fp8_block_gemv_add_norm(*args, moe_x=True, **kw)
for i, layer in enumerate(model.layers):  # as install() does with SPARKCHAT_MOE_X_PACKED=1
    if isinstance(layer.mlp, moe.MoE):
        layer.attention.out_proj.fast_add_norm = split_add_norm
        # the MoE input norm split between the output projection and the router (SPARKCHAT_SPLIT_MOE_INPUT_NORM=1)
        layer.post_attention_layernorm.split_ok = i >= 2 or together
        layer.post_attention_layernorm.split_window = 4 if together else 1  # SPARKCHAT_SPLIT_NORM_WINDOW
from sparkchat.engine.kernels.router import route
ops.route = route
from sparkchat.engine.kernels.embed_norm import embed_norm
first_norms = []
def counted_embed_norm(*args):
    first_norms.append(args[0].shape[0])
    return embed_norm(*args)
model.fast_embed_norm = counted_embed_norm  # as install() does: the embedding and first norm in one kernel
fast = logits()
# bf16 summation order differs between the paths; on tiny random models a router score can sit within
# that noise of its neighbour, and one flipped expert moves that step's logits far. Every step but one
# (prompt, five decode steps, a verify's four) must agree within 4% of the logits' scale, their median
# within 2.5%, and no step may be wildly off (a broken kernel: tens of percent).
per_step = ((fast - ref).abs().amax(-1) / ref.abs().amax(-1))
rel = per_step.sort().values[-2].item()
assert rel < 0.04 and per_step.median().item() < 0.025 and per_step.max().item() < 0.5, per_step.tolist()
# the same greedy token, unless the reference itself is within bf16 noise of a tie there
pick = fast.argmax(-1)
gap = ref.amax(-1) - ref.gather(-1, pick[:, None]).squeeze(-1)
assert bool((gap <= 0.02 * ref.abs().amax(-1)).all()), gap
assert any(l.fast is not None for l in model.linears())
assert any(l.fast_add_norm is not None for l in model.linears())
assert calls and max(calls) <= 8, calls
assert prompt_rows and set(prompt_rows) == {len(prompt)}, prompt_rows  # the prompt's FP8 linears: the GEMM  # the residual add + input norm of every layer after the first
assert all(m.experts.paired for m in model.modules() if isinstance(m, moe.MoE))
assert sorted(set(first_norms)) == [1, 4], first_norms  # decode steps and the verify window; not the prompt
assert any(packed_x), packed_x  # decode steps' MoE layers got their input packed by the norm before
if together:  # one-token steps take every candidate; longer windows what applies to them
    assert any(in_stages) and any(normed) and any(split_reads) and any(split_inputs), (in_stages, normed, split_inputs)
    assert any(late_adds), late_adds  # the verify's window: the next norm is not stage 2's there
    assert 4 in split_windows, split_windows  # the verify's window: its MoE input norms split too
else:
    assert set(split_windows) == {1}, split_windows  # SPARKCHAT_SPLIT_NORM_WINDOW's default: one token
    assert any(in_stages) and not all(in_stages), in_stages  # decode steps: shared experts in the stages and beside
    assert any(normed) and not all(normed), normed  # decode steps: the next norm in stage 2 and in its own kernel
    assert any(late_adds), late_adds  # a shared expert's output added by the next layer's add+norm
    assert any(split_reads), split_reads  # a layer's input projection finishing its input norm
    assert any(split_inputs) and not all(split_inputs), split_inputs  # the router finishing the MoE's input norm
print("ok", rel)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CPU-only CI)")
@pytest.mark.parametrize("mode", ["mixed", "together"])
def test_fast_path_matches_reference_under_the_interpreter(tmp_path, mode):
    """mixed: each MoE layer a different combination of the fused and split forms; together: all of them
    on every MoE layer (shared expert in the stages, next norm split by stage 2, input norm split by the
    router, shared output added late), as the profile_step A/Bs set them together."""
    import json

    from safetensors.torch import load_file

    from sparkchat.engine.release import save_release_checkpoint
    from tests.conftest import make_model_dir

    plain = make_model_dir(tmp_path / "plain", seed=0)
    tensors = {}
    for f in sorted(plain.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    path = tmp_path / "fp4"  # FP8 block linears + MXFP4 experts: every kernel gets exercised
    save_release_checkpoint(path, tensors, json.loads((plain / "config.json").read_text()))
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(path), mode], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]

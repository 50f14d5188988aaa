"""The fp4 release format: FP8 e4m3 block-scaled linears + MXFP4 routed experts, loaded and checked
against an independent dequantization written here; greedy output equals the dequantized model's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparkchat.engine.config import ModelConfig
from sparkchat.engine.loader import load_model
from sparkchat.engine.release import save_release_checkpoint
from sparkchat.engine.state import ConversationState
from tests.tiny import add_mtp_layer, build_reference, save_reference

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def indep_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Byte by byte: low nibble = even input, high nibble = odd input; value × 2^(scale − 127)."""
    out = torch.empty(blocks.shape[0], blocks.shape[1] * 2)
    for r in range(blocks.shape[0]):
        for c in range(blocks.shape[1]):
            b = int(blocks[r, c])
            for j, code in enumerate((b & 0xF, b >> 4)):
                v = E2M1[code & 7] * (-1 if code & 8 else 1)
                col = 2 * c + j
                out[r, col] = v * 2.0 ** (int(scales[r, col // 32]) - 127)
    return out


def indep_fp8_block(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:
        scale = torch.tensor([[2.0 ** (int(s) - 127) for s in row] for row in scale])
    out = w.float().clone()
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            out[i, j] *= scale[i // 128, j // 128]
    return out


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    ref = build_reference(seed=21, num_hidden_layers=3, vocab_size=256)
    path = save_reference(ref, tmp_path_factory.mktemp("plain") / "m")
    add_mtp_layer(path, seed=4)
    return path


def _plain_tensors(path):
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def _write_release(plain_dir, dst, **kw):
    config = json.loads((plain_dir / "config.json").read_text())
    save_release_checkpoint(dst, _plain_tensors(plain_dir), config, shard_max_bytes=200_000, **kw)
    return dst


@pytest.mark.parametrize("scale_fmt,expert_scale", [("ue8m0", "weight_scale_inv"), ("e8m0_uint8", "weight_scale")])
def test_loaded_weights_match_independent_dequantization(plain_dir, tmp_path, scale_fmt, expert_scale):
    rel = _write_release(plain_dir, tmp_path / "fp4", scale_fmt=scale_fmt, expert_scale_name=expert_scale)
    raw = {}
    for f in sorted(rel.glob("*.safetensors")):
        raw.update(load_file(str(f)))
    cfg = ModelConfig.from_dir(rel)
    assert cfg.quantization is not None and cfg.quantization.routed_experts_quant_method == "mxfp4"
    model = load_model(rel, cfg, "cpu", torch.float32, 64)
    # an FP8 linear: KDA q_proj of layer 0, and the MLA kv_b_proj of layer 1
    for lin, name in ((model.layers[0].attention.q_proj, "model.layers.0.attention.q_proj"),
                      (model.layers[1].attention.kv_b_proj, "model.layers.1.attention.kv_b_proj")):
        assert lin.is_fp8 and raw[f"{name}.weight"].dtype == torch.float8_e4m3fn
        expected = indep_fp8_block(raw[f"{name}.weight"], raw[f"{name}.weight_scale_inv"])
        assert torch.equal(lin.dense_weight(torch.float32), expected)
    # MXFP4 experts: gate rows then up rows of w13, down in w2
    ex = model.layers[2].mlp.experts
    assert ex.is_mxfp4
    for e in (0, 7):
        p = f"model.layers.2.mlp.experts.{e}"
        gate = indep_mxfp4(raw[f"{p}.gate_proj.weight"], raw[f"{p}.gate_proj.{expert_scale}"])
        up = indep_mxfp4(raw[f"{p}.up_proj.weight"], raw[f"{p}.up_proj.{expert_scale}"])
        down = indep_mxfp4(raw[f"{p}.down_proj.weight"], raw[f"{p}.down_proj.{expert_scale}"])
        w13, w2 = ex.expert_weights(e, torch.float32)
        assert torch.equal(w13, torch.cat([gate, up])) and torch.equal(w2, down)
        # and the quantization is faithful: close to the plain weights it came from
        plain = _plain_tensors(plain_dir)[f"{p}.gate_proj.weight"]
        assert (gate - plain).abs().max() <= plain.abs().max() * 0.25


def test_greedy_output_equals_dequantized_model(plain_dir, tmp_path):
    rel = _write_release(plain_dir, tmp_path / "fp4")
    raw = {}
    for f in sorted(rel.glob("*.safetensors")):
        raw.update(load_file(str(f)))
    # a plain checkpoint holding exactly the dequantized release weights
    deq = {}
    for name, t in raw.items():
        if name.endswith(("weight_scale_inv", "weight_scale")):
            continue
        stem = name[: -len("weight")]
        if t.dtype == torch.float8_e4m3fn:
            deq[name] = indep_fp8_block(t, raw[stem + "weight_scale_inv"])
        elif t.dtype == torch.uint8:
            from sparkchat.engine.quant import dequant_mxfp4

            deq[name] = dequant_mxfp4(t, raw[stem + "weight_scale_inv"], torch.float32)
        else:
            deq[name] = t
    plain = tmp_path / "deq"
    plain.mkdir()
    save_file(deq, str(plain / "model.safetensors"))
    config = json.loads((rel / "config.json").read_text())
    config.pop("quantization_config")
    (plain / "config.json").write_text(json.dumps(config))

    def greedy(path, n=32):
        cfg = ModelConfig.from_dir(path)
        model = load_model(path, cfg, "cpu", torch.float32, 128)
        st = ConversationState.allocate(cfg, 128, "cpu", torch.float32)
        ids = torch.arange(3, 40)
        out, first_logits = [], None
        logits = model.lm_head(model(ids, 0, st)[0])[-1]
        first_logits = logits
        for i in range(n):
            tok = int(logits.argmax())
            out.append(tok)
            logits = model.lm_head(model(torch.tensor([tok]), len(ids) + i, st)[0])[0]
        return out, first_logits

    a, la = greedy(rel)
    b, lb = greedy(plain)
    assert a == b
    assert torch.allclose(la, lb, atol=1e-4)


def test_online_mxfp4_quantization_of_plain_experts(plain_dir):
    cfg = ModelConfig.from_dir(plain_dir)
    model = load_model(plain_dir, cfg, "cpu", torch.float32, 64, quantize_experts=True)
    ex = model.layers[1].mlp.experts
    assert ex.is_mxfp4 and ex.w13.dtype == torch.uint8 and ex.w13.shape[-1] == cfg.hidden_size // 2
    plain = _plain_tensors(plain_dir)["model.layers.1.mlp.experts.3.up_proj.weight"]
    w13, _ = ex.expert_weights(3, torch.float32)
    up = w13[cfg.moe_intermediate_size:]
    assert (up - plain).abs().max() <= plain.abs().max() * 0.25
    assert (up - plain).abs().max() > 0  # really quantized


def test_fused_projections_equal_the_separate_ones(plain_dir, tmp_path):
    rel = _write_release(plain_dir, tmp_path / "fp4")
    raw = {}
    for f in sorted(rel.glob("*.safetensors")):
        raw.update(load_file(str(f)))
    model = load_model(rel, ModelConfig.from_dir(rel), "cpu", torch.float32, 64)
    mla = model.layers[1].attention  # q_proj 8·32 rows, kv_a 48, g_proj 4: padded to 128-row blocks
    assert mla.fused is not None and mla.fused.is_fp8 and mla.fused.out_features % 128 == 0
    x = torch.randn(3, 64)
    fused_out = mla.fused.split(mla.fused(x))
    for part, out, name in zip(mla.input_projections(), fused_out,
                               ("q_proj", "kv_a_proj_with_mqa", "g_proj")):
        p = f"model.layers.1.attention.{name}"
        w = indep_fp8_block(raw[f"{p}.weight"], raw[f"{p}.weight_scale_inv"])
        assert torch.allclose(out, x @ w.T, atol=1e-5)
        assert part.weight.untyped_storage().data_ptr() == mla.fused.weight.untyped_storage().data_ptr()
    kda = model.layers[0].attention
    assert kda.fused is not None and len(kda.fused.sizes) == 5

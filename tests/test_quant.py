"""MXFP4 / FP8 packing (sparkchat.engine.quant) and the fp4 release export (sparkchat.engine.release)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from sparkchat.engine.quant import (
    E2M1_VALUES, dequant_fp8_block, dequant_fp8_rows, dequant_mxfp4, e8m0_to_float, float_to_e8m0,
    quant_fp8_block, quant_fp8_rows, quant_mxfp4,
)
from sparkchat.engine.release import save_release_checkpoint, tensor_kind, to_release_format


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------- E2M1

def test_e2m1_table():
    assert len(E2M1_VALUES) == 16
    assert E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert E2M1_VALUES[8:] == tuple(-v for v in E2M1_VALUES[:8])
    assert math.copysign(1.0, E2M1_VALUES[8]) == -1.0  # code 8 is -0


# ---------------------------------------------------------------------------------------------- E8M0

def test_e8m0_to_float_known_codes():
    codes = torch.tensor([127, 128, 126, 0, 1, 254, 255, 130], dtype=torch.uint8)
    got = e8m0_to_float(codes)
    assert got.dtype == torch.float32
    want = [1.0, 2.0, 0.5, 2.0**-127, 2.0**-126, 2.0**127, float("nan"), 8.0]
    for g, w in zip(got.tolist(), want):
        assert (math.isnan(g) and math.isnan(w)) or g == w


def test_e8m0_to_float_all_codes_match_pow():
    codes = torch.arange(255, dtype=torch.uint8)
    want = torch.tensor([2.0 ** (s - 127) for s in range(255)], dtype=torch.float64)
    assert torch.equal(e8m0_to_float(codes).double(), want)


def test_e8m0_rejects_non_uint8():
    with pytest.raises(TypeError):
        e8m0_to_float(torch.tensor([127], dtype=torch.int32))


def test_float_to_e8m0_round_trip_and_rounding():
    codes = torch.arange(255, dtype=torch.uint8)
    assert torch.equal(float_to_e8m0(e8m0_to_float(codes)), codes)  # powers of two are exact
    x = torch.tensor([3.0, 1.0001, 0.75, 0.0, -2.0, float("inf"), float("nan"), 1e-45, 2.0**128 * 0.75])
    got = float_to_e8m0(x).tolist()
    # round UP: 3 -> 4 (129), 1.0001 -> 2 (128), 0.75 -> 1 (127); <=0 -> 0; non-finite -> 255;
    # a subnormal below 2^-127 -> 0; 2^127.58 -> saturates at 254.
    assert got == [129, 128, 127, 0, 0, 255, 255, 0, 254]


# --------------------------------------------------------------------------------------------- MXFP4

def test_mxfp4_nibble_order_low_nibble_is_even_index():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x21  # low nibble 1 (0.5) -> input 0, high nibble 2 (1.0) -> input 1
    blocks[0, 1] = 0xF9  # low 9 (-0.5) -> input 2, high 15 (-6) -> input 3
    scales = torch.full((1, 1), 127, dtype=torch.uint8)  # scale 1.0
    w = dequant_mxfp4(blocks, scales, dtype=torch.float32)
    assert w.shape == (1, 32)
    assert w[0, :4].tolist() == [0.5, 1.0, -0.5, -6.0]
    assert torch.all(w[0, 4:] == 0)


def test_mxfp4_dequant_all_codes_and_scales():
    # every code pair in every byte value, with a different scale per 32-group
    blocks = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # [out=16, in/2=16] -> in 32
    scales = torch.arange(120, 136, dtype=torch.uint8).reshape(16, 1)
    got = dequant_mxfp4(blocks, scales, dtype=torch.float32)
    for r in range(16):
        for c in range(16):
            byte = int(blocks[r, c])
            s = 2.0 ** (int(scales[r, 0]) - 127)
            assert got[r, 2 * c].item() == E2M1_VALUES[byte & 0xF] * s
            assert got[r, 2 * c + 1].item() == E2M1_VALUES[byte >> 4] * s


def test_mxfp4_dequant_int8_blocks_and_nan_scale():
    blocks = torch.tensor([[0x21] * 16], dtype=torch.uint8)
    scales = torch.tensor([[128]], dtype=torch.uint8)
    as_int8 = dequant_mxfp4(blocks.view(torch.int8), scales, dtype=torch.float32)
    assert torch.equal(as_int8, dequant_mxfp4(blocks, scales, dtype=torch.float32))
    assert as_int8[0, :2].tolist() == [1.0, 2.0]
    nan = dequant_mxfp4(blocks, torch.tensor([[255]], dtype=torch.uint8), dtype=torch.float32)
    assert torch.isnan(nan).all()


def test_mxfp4_dequant_shape_checks():
    with pytest.raises(ValueError):
        dequant_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))


def test_mxfp4_exact_round_trip_on_representable_values():
    # per group: random E2M1 values that include a +-6 or +-4 (so OCP picks exactly this scale), times
    # a random power of two; stacked experts as a leading dim.
    g = _gen(1)
    n_exp, n_out, n_in = 3, 5, 64
    idx = torch.randint(0, 16, (n_exp, n_out, n_in), generator=g)
    vals = torch.tensor(E2M1_VALUES)[idx]
    vals[..., ::32] = torch.where(torch.rand(n_exp, n_out, n_in // 32, generator=g) < 0.5, 6.0, -4.0)
    exps = torch.randint(-20, 20, (n_exp, n_out, n_in // 32), generator=g).float()
    w = (vals.reshape(n_exp, n_out, n_in // 32, 32) * torch.exp2(exps)[..., None]).reshape(n_exp, n_out, n_in)
    w = w.to(torch.bfloat16)
    blocks, scales = quant_mxfp4(w)
    assert blocks.shape == (n_exp, n_out, n_in // 2) and blocks.dtype == torch.uint8
    assert scales.shape == (n_exp, n_out, n_in // 32) and scales.dtype == torch.uint8
    assert torch.equal(scales.int() - 127, exps.int())
    back = dequant_mxfp4(blocks, scales, dtype=torch.bfloat16)
    assert torch.equal(back.float(), w.float())  # -0 and +0 compare equal


def test_mxfp4_quant_codes_exact_on_a_hand_built_group():
    # scale 1 (amax 6 -> floor(log2 6) - 2 = 0); check each element's code
    x = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, -0.0] + [0.0] * 16])
    blocks, scales = quant_mxfp4(x)
    assert scales.tolist() == [[127]]
    assert blocks[0, :8].tolist() == [0x10, 0x32, 0x54, 0x76, 0xA9, 0xCB, 0xED, 0x0F]


def test_mxfp4_rounding_ties_to_even_and_clamp():
    # amax 7.5 -> shared exponent floor(log2 7.5) - 2 = 0, scale 1; 7.5 clamps to 6.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    tie_to = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # the neighbour with the even code
    near = [0.26, 0.74, 1.3, 1.7, 2.6, 3.4, 5.1, -0.24, 7.5, -7.9]
    near_to = [0.5, 0.5, 1.5, 1.5, 3.0, 3.0, 6.0, 0.0, 6.0, -6.0]
    row = ties + [-t for t in ties] + near
    want = tie_to + [-t for t in tie_to] + near_to
    row, want = row + [0.0] * (32 - len(row)), want + [0.0] * (32 - len(want))
    blocks, scales = quant_mxfp4(torch.tensor([row]))
    assert scales.item() == 127
    assert dequant_mxfp4(blocks, scales, dtype=torch.float32)[0].tolist() == want
    # zeros (incl. values rounding to zero from below) are code 0, never -0 (code 8)
    codes = torch.stack((blocks & 0xF, blocks >> 4), -1).flatten()
    assert not (codes == 8).any()


def test_mxfp4_shared_exponent_is_ocp():
    # amax in [2^k, 2^(k+1)) -> scale 2^(k-2)
    amaxes = [1.0, 1.99, 2.0, 6.0, 7.99, 8.0, 0.001, 300.0]
    x = torch.zeros(len(amaxes), 32)
    x[:, 7] = torch.tensor(amaxes)
    _, scales = quant_mxfp4(x)
    assert (scales[:, 0].int() - 127).tolist() == [math.floor(math.log2(a)) - 2 for a in amaxes]
    _, zero_scale = quant_mxfp4(torch.zeros(1, 32))
    assert zero_scale.item() == 0


def test_mxfp4_error_bound_on_random_data():
    g = _gen(2)
    w = (torch.randn(4, 64, 256, generator=g) * torch.exp2(torch.randint(-8, 8, (4, 64, 1), generator=g))).to(
        torch.bfloat16)
    blocks, scales = quant_mxfp4(w)
    back = dequant_mxfp4(blocks, scales, dtype=torch.float32)
    wf = w.float().reshape(4, 64, 8, 32)
    err = (back.reshape(4, 64, 8, 32) - wf).abs()
    scale = e8m0_to_float(scales).unsqueeze(-1)  # [4, 64, 8, 1]
    # per element: half a step of the grid (<= 1 * scale above magnitude 4), and clamping 6..8 costs <= 2
    mag = wf.abs() / scale
    bound = torch.where(mag < 2, 0.25, torch.where(mag < 4, 0.5, torch.where(mag <= 6, 1.0, mag - 6))) * scale
    assert torch.all(err <= bound)
    rel = (back - w.float()).norm() / w.float().norm()
    assert rel < 0.13  # OCP scaling on Gaussian data gives ~0.11


def test_mxfp4_quant_rejects_bad_in_dim():
    with pytest.raises(ValueError):
        quant_mxfp4(torch.zeros(4, 48))


def test_mxfp4_chunking_matches_single_pass(monkeypatch):
    import sparkchat.engine.quant as q

    w = torch.randn(7, 96, generator=_gen(3))
    whole = quant_mxfp4(w)
    monkeypatch.setattr(q, "_MXFP4_CHUNK_GROUPS", 5)  # 21 groups -> 5 chunks, the last partial
    chunked = quant_mxfp4(w)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


# ----------------------------------------------------------------------------------------- block FP8

def _dequant_fp8_block_per_element(w, scale_vals, block):
    """Independent oracle: plain Python floats, one element at a time, then one rounding to fp32."""
    wl = w.float().tolist()
    out = [[wl[r][c] * scale_vals[r // block[0]][c // block[1]] for c in range(len(wl[0]))]
           for r in range(len(wl))]
    return torch.tensor(out, dtype=torch.float64).float()


@pytest.mark.parametrize("shape,block", [((48, 96), (128, 128)), ((130, 200), (128, 128)),
                                         ((20, 37), (8, 16)), ((32, 64), (16, 32))])
@pytest.mark.parametrize("scale_kind", ["float32", "e8m0"])
def test_dequant_fp8_block_matches_per_element(shape, block, scale_kind):
    g = _gen(4)
    w = (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn)
    nb = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    codes = torch.randint(110, 140, nb, generator=g).to(torch.uint8)
    if scale_kind == "e8m0":
        scale, scale_vals = codes, [[2.0 ** (int(c) - 127) for c in row] for row in codes]
    else:
        scale = torch.rand(nb, generator=g) * 3 + 0.01
        scale_vals = scale.tolist()
    want = _dequant_fp8_block_per_element(w, scale_vals, block)
    got = dequant_fp8_block(w, scale, block=block, dtype=torch.float32)
    assert got.shape == shape and got.dtype == torch.float32
    assert torch.equal(got, want)


def test_dequant_fp8_block_shape_mismatch():
    w = torch.zeros(48, 96, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError):
        dequant_fp8_block(w, torch.ones(2, 1))


@pytest.mark.parametrize("shape", [(48, 96), (300, 257), (128, 128)])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float32"])
def test_quant_fp8_block_round_trip(shape, scale_fmt):
    g = _gen(5)
    w = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-10, 10, (shape[0], 1), generator=g))
    q, scale = quant_fp8_block(w, scale_fmt=scale_fmt)
    nb = (-(-shape[0] // 128), -(-shape[1] // 128))
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape
    assert scale.dtype == torch.float32 and scale.shape == nb
    assert torch.isfinite(q.float()).all() and q.float().abs().max() <= 448
    back = dequant_fp8_block(q, scale, dtype=torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values, plus the subnormal floor
    floor = scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]] * 2.0**-10
    assert torch.all((back - w).abs() <= w.abs() * (2.0**-4 + 1e-6) + floor)
    if scale_fmt == "ue8m0":
        m, _ = torch.frexp(scale)
        assert torch.all(m == 0.5)  # exact powers of two
        assert torch.equal(e8m0_to_float(float_to_e8m0(scale)), scale)
        # rounded up, but by less than 2x: each block's amax lands in (224, 448]
        amax = torch.nn.functional.pad(w.abs(), (0, -shape[1] % 128, 0, -shape[0] % 128))
        amax = amax.reshape(nb[0], 128, nb[1], 128).amax(dim=(1, 3))
        assert torch.all(amax / scale <= 448) and torch.all(amax / scale > 224)
    else:
        assert q.float().abs().max() == 448  # the block amax maps to exactly 448


def test_quant_fp8_block_zero_block_and_bad_fmt():
    w = torch.zeros(128, 256)
    w[:, 128:] = 1.0
    q, scale = quant_fp8_block(w)
    assert scale.tolist() == [[1.0, 2.0**-8]]  # zero block -> 1; 1/448 rounded up to 2^-8
    assert torch.all(q.float()[:, :128] == 0) and torch.all(q.float()[:, 128:] == 256)
    with pytest.raises(ValueError):
        quant_fp8_block(w, scale_fmt="e5m2")


# ------------------------------------------------------------------------------------------- row FP8

def test_fp8_rows_round_trip():
    g = _gen(6)
    w = torch.randn(40, 72, generator=g) * torch.exp2(torch.randint(-6, 6, (40, 1), generator=g))
    w[3] = 0
    q, scale = quant_fp8_rows(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (40, 72)
    assert scale.dtype == torch.float32 and scale.shape == (40,)
    assert scale[3] == 1.0
    assert torch.allclose(scale, torch.where(w.abs().amax(1) > 0, w.abs().amax(1) / 448, 1.0))
    back = dequant_fp8_rows(q, scale, dtype=torch.float32)
    assert back.dtype == torch.float32
    assert torch.all((back - w).abs() <= w.abs() * 2.0**-4 + scale[:, None] * 2.0**-10)
    # dequant is exactly fp8 * scale per row
    assert torch.equal(back, q.float() * scale[:, None])
    assert dequant_fp8_rows(q, scale).dtype == torch.bfloat16
    with pytest.raises(ValueError):
        dequant_fp8_rows(q, scale[:-1])


# ---------------------------------------------------------------------------------- release export

H, I_DENSE, I_MOE, E, HEADS, D = 64, 96, 32, 4, 2, 16


def _fake_ling_state_dict() -> dict[str, torch.Tensor]:
    """Two layers (0: KDA + dense MLP, 1: MLA + MoE) plus an MTP layer (2), tiny dims."""
    g = _gen(7)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    sd = {"model.word_embeddings.weight": r(100, H), "model.norm.weight": r(H), "lm_head.weight": r(100, H)}
    a = "model.layers.0.attention."
    sd.update({f"{a}{p}_proj.weight": r(HEADS * D, H) for p in "qkvfg"})
    sd.update({f"{a}b_proj.weight": r(HEADS, H), f"{a}o_proj.weight": r(H, HEADS * D),
               f"{a}o_norm.weight": r(D), f"{a}A_log": torch.randn(HEADS), f"{a}dt_bias": torch.randn(HEADS * D)})
    sd.update({f"{a}{p}_conv1d.weight": r(HEADS * D, 1, 4) for p in "qkv"})
    m = "model.layers.0.mlp."
    sd.update({f"{m}gate_proj.weight": r(I_DENSE, H), f"{m}up_proj.weight": r(I_DENSE, H),
               f"{m}down_proj.weight": r(H, I_DENSE)})
    for i in (1, 2):
        a, m = f"model.layers.{i}.attention.", f"model.layers.{i}.mlp."
        sd.update({f"{a}q_proj.weight": r(HEADS * 24, H), f"{a}kv_a_proj_with_mqa.weight": r(32 + 8, H),
                   f"{a}kv_a_layernorm.weight": r(32), f"{a}kv_b_proj.weight": r(HEADS * 32, 32),
                   f"{a}dense.weight": r(H, HEADS * D), f"{a}g_proj.weight": r(HEADS, H)})
        sd.update({f"{m}gate.weight": torch.randn(E, H), f"{m}gate.expert_bias": torch.randn(E)})
        for e in range(E):
            sd.update({f"{m}experts.{e}.gate_proj.weight": r(I_MOE, H), f"{m}experts.{e}.up_proj.weight": r(I_MOE, H),
                       f"{m}experts.{e}.down_proj.weight": r(H, I_MOE)})
        sd.update({f"{m}shared_experts.{p}_proj.weight": r(I_MOE, H) for p in ("gate", "up")})
        sd[f"{m}shared_experts.down_proj.weight"] = r(H, I_MOE)
        sd.update({f"model.layers.{i}.input_layernorm.weight": r(H),
                   f"model.layers.{i}.post_attention_layernorm.weight": r(H)})
    sd.update({"model.layers.2.enorm.weight": r(H), "model.layers.2.hnorm.weight": r(H),
               "model.layers.2.eh_proj.weight": r(H, 2 * H), "model.layers.2.final_layernorm.weight": r(H)})
    return sd


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _expected_kind(name: str) -> str:
    if ".mlp.experts." in name:
        return "mxfp4"
    keep = ("word_embeddings", "lm_head", "norm", "A_log", "dt_bias", "conv1d", ".b_proj.", "mlp.gate.")
    return "keep" if any(k in name for k in keep) else "fp8"  # ".b_proj." so kv_b_proj stays fp8


def test_tensor_kind_on_fake_ling():
    sd = _fake_ling_state_dict()
    kinds = {n: tensor_kind(n, t.shape) for n, t in sd.items()}
    assert kinds == {n: _expected_kind(n) for n in sd}
    assert kinds["model.layers.1.attention.kv_a_proj_with_mqa.weight"] == "fp8"
    assert kinds["model.layers.1.attention.kv_b_proj.weight"] == "fp8"
    assert kinds["model.layers.1.attention.dense.weight"] == "fp8"
    assert kinds["model.layers.2.eh_proj.weight"] == "fp8"
    assert kinds["model.layers.1.mlp.shared_experts.down_proj.weight"] == "fp8"


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "e8m0_uint8", "float32"])
@pytest.mark.parametrize("expert_scale_name", ["weight_scale_inv", "weight_scale"])
def test_to_release_format(scale_fmt, expert_scale_name):
    sd = _fake_ling_state_dict()
    snapshot = {n: t.clone() for n, t in sd.items()}
    out, qcfg = to_release_format(sd, scale_fmt=scale_fmt, expert_scale_name=expert_scale_name)
    assert all(torch.equal(sd[n], snapshot[n]) for n in sd) and sd.keys() == snapshot.keys()  # input untouched

    want_names = set()
    for name, w in sd.items():
        kind = _expected_kind(name)
        want_names.add(name)
        if kind == "keep":
            assert out[name] is w  # passed through untouched
            continue
        scale_name = name[: -len("weight")] + (expert_scale_name if kind == "mxfp4" else "weight_scale_inv")
        want_names.add(scale_name)
        q, s = out[name], out[scale_name]
        n_out, n_in = w.shape
        if kind == "mxfp4":
            assert q.dtype == torch.uint8 and q.shape == (n_out, n_in // 2)
            assert s.dtype == torch.uint8 and s.shape == (n_out, n_in // 32)
            back = dequant_mxfp4(q, s, dtype=torch.float32)
            assert (back - w.float()).norm() / w.float().norm() < 0.15
        else:
            assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
            assert s.shape == (-(-n_out // 128), -(-n_in // 128))
            assert s.dtype == (torch.uint8 if scale_fmt == "e8m0_uint8" else torch.float32)
            if scale_fmt == "ue8m0":
                assert torch.all(torch.frexp(s).mantissa == 0.5)
            assert _same_bytes(q, quant_fp8_block(w, scale_fmt="float32" if scale_fmt == "float32" else "ue8m0")[0])
            back = dequant_fp8_block(q, s, dtype=torch.float32)
            assert (back - w.float()).norm() / w.float().norm() < 0.04
    assert set(out) == want_names
    other = "weight_scale" if expert_scale_name == "weight_scale_inv" else "weight_scale_inv"
    assert f"model.layers.1.mlp.experts.0.up_proj.{other}" not in out

    assert qcfg["quant_method"] == "fp8" and qcfg["fmt"] == "e4m3"
    assert qcfg["activation_scheme"] == "dynamic" and qcfg["weight_block_size"] == [128, 128]
    assert qcfg["routed_experts_quant_method"] == "mxfp4" and qcfg["routed_experts_group_size"] == 32
    assert qcfg.get("scale_fmt") == (None if scale_fmt == "float32" else "ue8m0")
    not_conv = set(qcfg["modules_to_not_convert"])
    assert {"lm_head", "model.word_embeddings", "model.layers.0.attention.b_proj",
            "model.layers.1.mlp.gate", "model.layers.2.mlp.gate"} == not_conv
    json.dumps(qcfg)  # must be JSON-serialisable


def test_to_release_format_rejects_bad_expert_in_dim():
    sd = {"model.layers.3.mlp.experts.0.down_proj.weight": torch.randn(64, 48)}
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj.*multiple of 32"):
        to_release_format(sd)


def test_save_release_checkpoint_single_file(tmp_path):
    sd = _fake_ling_state_dict()
    cfg = save_release_checkpoint(tmp_path, sd, {"model_type": "bailing_hybrid", "hidden_size": H})
    assert not (tmp_path / "model.safetensors.index.json").exists()
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert on_disk == cfg and on_disk["hidden_size"] == H
    assert on_disk["quantization_config"]["routed_experts_quant_method"] == "mxfp4"
    loaded = load_file(str(tmp_path / "model.safetensors"))
    want, _ = to_release_format(sd)
    assert loaded.keys() == want.keys()
    assert all(_same_bytes(loaded[n], want[n]) for n in want)


def test_save_release_checkpoint_sharded_index(tmp_path):
    sd = _fake_ling_state_dict()
    release, qcfg = to_release_format(sd)
    shard_max = 20_000
    save_release_checkpoint(tmp_path, release, {"model_type": "bailing_hybrid"}, shard_max,
                            quantization_config=qcfg)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    assert files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == files
    assert index["weight_map"].keys() == release.keys()
    total = 0
    for fname in files:
        shard = load_file(str(tmp_path / fname))
        size = sum(t.numel() * t.element_size() for t in shard.values())
        assert size <= shard_max or len({n.rsplit(".", 1)[0] for n in shard}) == 1  # oversize = one module
        total += size
        for n, t in shard.items():
            assert index["weight_map"][n] == fname
            assert _same_bytes(t, release[n])
    assert index["metadata"]["total_size"] == total
    # a quantized weight and its scale share a shard
    w = "model.layers.0.attention.q_proj."
    assert index["weight_map"][w + "weight"] == index["weight_map"][w + "weight_scale_inv"]
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"] == qcfg

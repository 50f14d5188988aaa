"""`sparkchat bench` on the CPU at a small config: the four rows, the byte accounting, the JSON."""

from __future__ import annotations

import json

import pytest
import torch

from sparkchat.cli import main
from sparkchat.engine.bench import SPARK_READ_BW, decode_bytes, project_spark
from sparkchat.engine.synthetic import LING3_FLASH, build_synthetic, synthetic_config

SMALL = dict(LING3_FLASH, hidden_size=256, num_attention_heads=4, head_dim=32, vocab_size=1000, num_experts=32,
             n_group=4, topk_group=2, moe_intermediate_size=64, intermediate_size=512, kv_lora_rank=64,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_hidden_layers=6, layer_group_size=3,
             first_k_dense_replace=1, num_experts_per_tok=4)


def test_decode_bytes_counts_each_weight_once():
    cfg = synthetic_config(base=SMALL)
    model = build_synthetic(cfg, "cpu", torch.float32, max_context=64)
    H, D, E, I, K = 256, 4 * 32, 32, 64, 4
    fp8_block = lambda out, inp: out * inp + 4 * -(-out // 128) * -(-inp // 128)  # fp8 bytes + fp32 scales
    padded = lambda n: -(-n // 128) * 128
    kda = fp8_block(5 * padded(D), H) + H * 4 * 4 + fp8_block(H, D) + 2 * 4 * 32 * 32 * 4  # b_proj fp32 here
    # kv_b_proj is read as a dense copy (absorbed decode); gate|up rows pad to whole 128-row blocks
    mla = (fp8_block(padded(4 * 48) + padded(64 + 16) + padded(4), H) + 4 * 64 * 64 * 4
           + fp8_block(H, 4 * 32))
    moe = K * (2 * I * H // 2 + 2 * I * H // 32 + H * I // 2 + H * I // 32) + E * H * 4 + fp8_block(2 * padded(I), H) + fp8_block(H, I)
    dense = fp8_block(2 * 512, H) + fp8_block(H, 512)
    kda_layers, mla_layers = len(cfg.kda_layers), len(cfg.mla_layers)
    expected = kda_layers * kda + mla_layers * mla + 5 * moe + dense + 1000 * H * 4 + mla_layers * 10 * 80 * 4
    assert decode_bytes(model, context=10, fp8_head=False) == expected
    model.lm_head.build_fp8()
    assert decode_bytes(model, context=10, fp8_head=True) == expected - 1000 * H * 4 + 1000 * H + 1000 * 4


def test_the_spark_projection_counts_launch_and_chain_time_once_not_scaled_with_bandwidth():
    gb, h200 = 4.42e9, 4335e9
    # session 23's graphed step: 2.26 ms for 4.42 GB; its head streams at the full read bandwidth
    latency = 2.26e-3 - gb / h200
    assert project_spark(2.26e-3, gb, h200, 1.0) == pytest.approx(gb / SPARK_READ_BW + latency)
    assert 1 / project_spark(2.26e-3, gb, h200, 1.0) == pytest.approx(49.7, abs=0.1)
    # a kernel that only streams (no time beyond its bytes) projects to its bytes at the Spark's bandwidth
    assert project_spark(gb / (h200 * 0.8), gb, h200, 0.8) == pytest.approx(gb / (SPARK_READ_BW * 0.8))
    # faster than streaming at the measured efficiency (a step's L2 hits): no negative latency
    assert project_spark(0.5 * gb / h200, gb, h200, 1.0) == pytest.approx(gb / SPARK_READ_BW)
    # every bit of time here shows up there, one for one
    assert project_spark(3e-3, gb, h200, 1.0) - project_spark(2e-3, gb, h200, 1.0) == pytest.approx(1e-3)


def test_bench_command_prints_the_table_as_json(tmp_path, capsys):
    cfg_path = tmp_path / "small.json"
    cfg_path.write_text(json.dumps(SMALL))
    assert main(["bench", "--config", str(cfg_path), "--device", "cpu", "--context", "16", "--iters", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in out["rows"]]
    assert len(names) == 4 and names[0].startswith("baseline") and "MTP" in names[3]
    assert all(r["tok_s"] > 0 and r["projected_spark_tok_s"] > 0 for r in out["rows"])
    # each decode row's projection from its own time and bytes and the head's streaming efficiency
    eff = out["stream_efficiency_pct"] / 100
    assert 0 < eff <= 1 and out["spark_latency_ms"] >= 0 and out["spark_scaled_tok_s"] > 0
    for r in out["rows"][:3]:
        seconds = r["tpot_ms"] / 1000
        want = 1 / project_spark(seconds, r["bytes_per_token"], out["read_bw_gb_s"] * 1e9, eff)
        assert r["projected_spark_tok_s"] == pytest.approx(want)
    assert out["rows"][2]["bytes_per_token"] < out["rows"][1]["bytes_per_token"]  # the FP8 head reads less
    assert out["verify_decode_ratio"] > 0 and out["accept_length_source"].startswith("assumed")
    assert out["verify_correlated_decode_ratio"] > 0 and out["verify_correlated_pct_read_bw"] > 0
    assert out["verify_routing_wrapper_ms"] >= 0
    assert out["loop_cycle_ms"] > 0 and out["loop_tokens_per_cycle"] >= 1
    assert out["loop_tpot_ms"] == pytest.approx(out["loop_cycle_ms"] / out["accept_length"])
    assert out["loop_gap_ms"] is None  # a GPU's measure: between a verify's end and the next chain's start
    assert out["decode_loop_ms"] > 0  # plain decoding as it runs, a token at a time
    assert main(["bench", "--config", str(cfg_path), "--device", "cpu", "--context", "16", "--iters", "2"]) == 0
    text = capsys.readouterr().out
    assert "projection, not a measurement" in text and "half the experts repeated" in text
    assert "% of read BW, eager calls)" in text  # how the efficiency was timed (on a GPU: in a CUDA graph)
    assert "the MTP loop as it runs" in text and "the decode loop as it runs, without MTP" in text
    # a prompt longer than the context: the model is built with room for it
    assert main(["bench", "--config", str(cfg_path), "--device", "cpu", "--context", "16", "--iters", "1",
                 "--prefill", "80", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prefill_ms_per_token"] > 0


def test_bench_reports_the_kernel_cache_as_found_at_launch(tmp_path, capsys, monkeypatch):
    """Building the model compiles a few kernels of its own; 'cold' must still say the run began cold."""
    import sparkchat.engine.synthetic as synthetic

    cache = tmp_path / "triton"
    cache.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    build = synthetic.build_synthetic

    def build_and_compile(*args, **kwargs):
        (cache / "quantizer").mkdir(exist_ok=True)  # what a kernel compiled during the load leaves behind
        return build(*args, **kwargs)

    monkeypatch.setattr(synthetic, "build_synthetic", build_and_compile)
    cfg_path = tmp_path / "small.json"
    cfg_path.write_text(json.dumps(dict(SMALL, num_hidden_layers=3)))
    assert main(["bench", "--config", str(cfg_path), "--device", "cpu", "--context", "8", "--iters", "1",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["triton_cache"] == "cold"
    assert main(["bench", "--config", str(cfg_path), "--device", "cpu", "--context", "8", "--iters", "1",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["triton_cache"] == "warm"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA graphs")
def test_graph_timing_replays_the_captured_calls_and_nothing_else():
    from sparkchat.engine.traffic import median_graph_time

    counter = torch.zeros(1, device="cuda")
    x = torch.randn(2048, 2048, device="cuda")

    def work():
        counter.add_(1)
        x @ x

    seconds = median_graph_time(work, iters=5)
    torch.cuda.synchronize()
    # one warm-up call, one on the side stream, none while capturing, then a queued and a timed replay per iteration
    assert counter.item() == 2 + 2 * 5
    assert 0 < seconds < 0.1

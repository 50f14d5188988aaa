from types import SimpleNamespace

import pytest

from sparkchat.engine.events import GenerationStats, Switches, SwitchState
from sparkchat.ui.format import (accept_text, bandwidth_text, code_blocks, format_bytes, split_thinking, summary_line,
                                 switches_line, title_from)


@pytest.mark.parametrize("raw, expected", [
    ("plain answer", ("", "plain answer", False)),
    ("<think>why</think>answer", ("why", "answer", False)),
    ("\n<think>\nwhy\n</think>\n\nanswer", ("why", "answer", False)),
    ("<think>still thinking", ("still thinking", "", True)),
    ("template opened it</think>answer", ("template opened it", "answer", False)),
    ("", ("", "", False)),
])
def test_split_thinking(raw, expected):
    assert split_thinking(raw) == expected


def test_split_thinking_holds_back_half_tags_while_streaming():
    assert split_thinking("<thi", final=False) == ("", "", False)
    assert split_thinking("<thi", final=True) == ("", "<thi", False)
    assert split_thinking("<think>abc</th", final=False) == ("abc", "", True)
    assert split_thinking("answer </thin", final=False) == ("", "answer ", False)
    assert split_thinking("a < b", final=False) == ("", "a < b", False)


def test_split_thinking_streamed_piecewise_matches_final():
    raw = "<think>step one, step two</think>The answer is **42**."
    shown_think, shown_answer = "", ""
    for end in range(1, len(raw) + 1):
        think, answer, _ = split_thinking(raw[:end], final=False)
        assert "<" not in think + answer  # never a half tag on screen
        assert think.startswith(shown_think) and answer.startswith(shown_answer)  # only grows: no flicker
        shown_think, shown_answer = think, answer
    assert split_thinking(raw) == ("step one, step two", "The answer is **42**.", False)


def test_code_blocks():
    md = "text\n```python\nprint(1)\n```\nmore\n~~~\nraw ~~~ here\n~~~\n````md\n```inner```\n````\n"
    assert code_blocks(md) == ["print(1)", "raw ~~~ here", "```inner```"]
    assert code_blocks("no code") == []
    assert code_blocks("```\nunclosed") == []


def test_summary_line_and_accept():
    stats = GenerationStats(generated_tokens=120, decode_tok_s=212.34, ttft_s=0.123, prefill_tok_s=1840.0,
                            accept_length_mean=3.214, accept_length_last=4,
                            accept_rate_per_position=[0.92, 0.81, 0.66], peak_memory_bytes=41 << 30)
    line = summary_line(stats, "length")
    assert line == ("212.3 tok/s · 120 tok · TTFT 123 ms · prefill 1,840 tok/s · accept 3.21 · peak 41.0 GiB · "
                    "max tokens")
    assert accept_text(stats) == "accept 3.21 (last 4) · per draft 92% 81% 66%"
    assert summary_line(stats.to_dict(), "stop").endswith("done")  # stats as saved in the history
    plain = GenerationStats(generated_tokens=3, decode_tok_s=50.0)
    assert accept_text(plain) is None
    assert "accept" not in summary_line(plain, "cancelled")
    assert summary_line(plain, "cancelled").endswith("stopped")


def test_bandwidth_text_says_how_close_to_the_memory_limit_the_answer_runs():
    # Ling-3.0-flash-fp4 with the FP8 head on the DGX Spark: 4.42 GB a token at 234 GB/s
    stats = GenerationStats(decode_tok_s=45.0, bytes_per_token=4_420_000_000, read_bw_bytes_s=234e9)
    assert bandwidth_text(stats) == "85% of limit 52.9 tok/s · 4.42 GB/tok"
    # speculation reads the weights once for several tokens: past the plain decoding limit
    assert bandwidth_text(GenerationStats(decode_tok_s=75.0, bytes_per_token=4_420_000_000,
                                          read_bw_bytes_s=234e9)).startswith("142% of limit")
    small = {"bytes_per_token": 22_900_000, "read_bw_bytes_s": 28e9}  # as the history saves stats; no rate yet
    assert bandwidth_text(small) == "limit 1,222.7 tok/s · 22.9 MB/tok"
    assert bandwidth_text(GenerationStats(decode_tok_s=9.0)) is None  # a remote engine: no figures


def test_switches_line():
    assert switches_line(Switches()) == "MXFP4 · FP8 head · MTP×3 · draft top-32K · graphs"
    assert switches_line(Switches(truncated_draft_head=False)) == "MXFP4 · FP8 head · MTP×3 · graphs"
    assert switches_line(Switches(draft_vocab=50000)) == "MXFP4 · FP8 head · MTP×3 · draft top-50,000 · graphs"
    assert switches_line(Switches(mtp=False, draft_steps=2)) == "MXFP4 · FP8 head · graphs"
    states = {"mxfp4_kernels": SwitchState(False, False, "no GPU"), "fp8_head": SwitchState(True, True),
              "mtp": SwitchState(True, True), "cuda_graphs": SwitchState(False, True, "off while MXFP4 is off"),
              "truncated_draft_head": SwitchState(False, False, "the vocabulary fits in the draft vocabulary")}
    assert switches_line(Switches(), states) == "FP8 head · MTP×3"
    states["truncated_draft_head"] = SwitchState(True, True, "top 4,096 of 157,184 tokens")
    assert switches_line(Switches(draft_vocab=4096), states) == "FP8 head · MTP×3 · draft top-4K"
    # a remote engine offers none of them: its states, not the local choice, say what is in effect
    remote = {name: SwitchState(False, False, "remote endpoint") for name in states}
    assert switches_line(Switches(), remote) == "baseline (all optimizations off)"
    off = SimpleNamespace(mtp=False, fp8_head=False, mxfp4_kernels=False, cuda_graphs=False, draft_steps=1)
    assert switches_line(off) == "baseline (all optimizations off)"


def test_format_bytes_and_title():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 << 20) == "3.0 MiB"
    assert title_from("\n  How do I sort?\nmore") == "How do I sort?"
    assert title_from("x" * 100, width=10) == "x" * 9 + "…"
    assert title_from("   ") == "New chat"


def test_the_bench_footnote_gives_the_loop_gap_where_a_gpu_measured_it():
    from dataclasses import replace

    from sparkchat.engine.bench import BenchResult
    from sparkchat.ui.screens.bench import BenchScreen

    r = BenchResult("NVIDIA H200", 1024, 4350.0, True, [], accept_length=2.68, loop_cycle_ms=4.85,
                    loop_tpot_ms=1.81)
    assert "verify end → next draft" not in BenchScreen._footnote(None, r)  # off a GPU: not measured
    assert "verify end → next draft on the GPU 0.31 ms" in BenchScreen._footnote(None, replace(r, loop_gap_ms=0.31))
    assert "without MTP" not in BenchScreen._footnote(None, r)
    assert "the decode loop as it runs, without MTP: 2.41 ms a token" in BenchScreen._footnote(
        None, replace(r, decode_loop_ms=2.41))

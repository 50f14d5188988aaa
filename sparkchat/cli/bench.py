"""`sparkchat bench`: NVIDIA's published table (baseline → +MXFP4 → +FP8 head → +MTP), measured here."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ACCEPT_PROMPTS = [
    "Explain how a hash table works, step by step.",
    "Write a short Python function that checks whether a number is prime, and explain it.",
    "What are the main causes of the seasons on Earth?",
]


# Positions the model is built with beyond --context / --prefill, for the timed steps that follow them.
SYNTHETIC_ROOM = 128
MODEL_ROOM = 256


def _count(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `least`, else argparse's usage error naming the flag."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    parse.__name__ = "integer"  # what argparse's fallback message calls the type
    return parse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure decode speed: baseline → +MXFP4 → +FP8 head → +MTP",
                       description="Measure the engine's optimizations side by side. Without --model it "
                                   "builds synthetic weights at Ling-3.0-flash-fp4's full shapes on the device.")
    p.add_argument("--model", "-m", help="a real model directory (measures accept length too)")
    p.add_argument("--config", help="a config.json for synthetic weights (default: Ling-3.0-flash-fp4)")
    p.add_argument("--layers", type=_count(1), help="synthetic: number of decoder layers (default: the config's)")
    p.add_argument("--device", default="auto", help="auto (default), cuda or cpu")
    p.add_argument("--context", type=_count(1), default=1024, help="tokens already in the context (default 1024)")
    p.add_argument("--iters", type=_count(1), default=20, help="timed steps per configuration (median)")
    p.add_argument("--draft-steps", type=int, default=3, help="MTP draft steps (1-4, default 3)")
    p.add_argument("--truncated-draft-head", action=argparse.BooleanOptionalAction, default=True,
                   help="the MTP row drafts through a head over the most frequent tokens only; the draft step "
                        "with the full head is timed beside it (default on)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="rows of the truncated draft head (default 32768)")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay decode/draft/verify steps as CUDA graphs (default on)")
    p.add_argument("--prefill", type=_count(0), default=0, metavar="N",
                   help="also time the prefill of an N-token prompt (per token, to compare with decode)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sparkchat.cli import EXIT_USAGE, fail

    _persistent_compile_cache()
    # Read before loading: building the model already compiles a few Triton kernels (quantizers).
    triton_cache_warm = _triton_cache_warm()
    from sparkchat.engine.draft_vocab import DEFAULT_DRAFT_VOCAB
    from sparkchat.settings import MIN_DRAFT_VOCAB

    if not 1 <= args.draft_steps <= 4:
        return fail("--draft-steps must be between 1 and 4", EXIT_USAGE)
    if args.draft_vocab is not None and args.draft_vocab < MIN_DRAFT_VOCAB:
        return fail(f"--draft-vocab must be at least {MIN_DRAFT_VOCAB}", EXIT_USAGE)
    draft_vocab = (args.draft_vocab or DEFAULT_DRAFT_VOCAB) if args.truncated_draft_head else None
    t0 = time.perf_counter()
    import torch

    from sparkchat.engine.bench import run_bench
    from sparkchat.engine.session import resolve_device

    device = resolve_device(args.device)
    if device.type == "cuda":
        from sparkchat.engine.nn.ops import enable_compile

        enable_compile()
    accept = accept_full = rows = coverage = None
    if args.model:
        from sparkchat.cli.resolve import resolve_model
        from sparkchat.engine.config import ModelConfig
        from sparkchat.engine.session import Engine

        model_dir = resolve_model(args.model)
        problem = _positions_problem(args, ModelConfig.from_dir(model_dir).max_position_embeddings, MODEL_ROOM)
        if problem:
            return fail(problem, EXIT_USAGE)
        room = max(args.context, args.prefill) + MODEL_ROOM
        engine = Engine.load(model_dir, device=str(device), max_context=room)
        model, source = engine.model, f"model {engine.name}"
        accept = accept_full = measure_accept_length(engine, args.draft_steps, truncated=False)
        if draft_vocab and model.mtp is not None and (rows := engine.draft_rows(draft_vocab)) is not None:
            emitted: list[int] = []
            accept = measure_accept_length(engine, args.draft_steps, truncated=True, draft_vocab=draft_vocab,
                                           tokens_out=emitted)
            kept = set(rows)
            coverage = sum(t in kept for t in emitted) / len(emitted) if emitted else None
            source += f" (draft vocabulary ranked by {engine.draft_ranking_source})"
    else:
        from sparkchat.engine.synthetic import build_synthetic, synthetic_config

        base = None
        if args.config:
            from sparkchat.engine.errors import ModelError

            try:
                base = json.loads(Path(args.config).read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ModelError(f"cannot read --config {args.config}: {e}") from None
            if not isinstance(base, dict):
                raise ModelError(f"--config {args.config} must hold a JSON object (a model's config.json), "
                                 f"not a JSON {type(base).__name__}")
        cfg = synthetic_config(args.layers, base)
        problem = _positions_problem(args, cfg.max_position_embeddings, SYNTHETIC_ROOM)
        if problem:
            return fail(problem, EXIT_USAGE)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = build_synthetic(cfg, device, dtype, max_context=max(args.context, args.prefill) + SYNTHETIC_ROOM)
        source = f"synthetic weights, {cfg.num_hidden_layers} layers"
    if device.type == "cuda":
        torch.cuda.synchronize()
    loaded_s = time.perf_counter() - t0
    progress = None if args.json else (lambda name: print(f"  measuring {name} …", file=sys.stderr))
    result = run_bench(model, context=args.context, iters=args.iters, draft_steps=args.draft_steps,
                       graphs=args.graphs, accept_length=accept, prefill=args.prefill, progress=progress,
                       draft_vocab=draft_vocab, draft_rows=rows, accept_length_full_head=accept_full)
    out = result.to_dict()
    out.update(source=source, load_s=loaded_s, total_s=time.perf_counter() - t0,
               triton_cache="warm" if triton_cache_warm else "cold", draft_vocab_coverage=coverage)
    if args.json:
        print(json.dumps(out))
    else:
        print(format_table(out))
    return 0


def _positions_problem(args: argparse.Namespace, max_positions: int, room: int) -> str | None:
    """--context and --prefill past the model's positions (less the room the timed steps take)."""
    most = max_positions - room
    for flag, n in (("--context", args.context), ("--prefill", args.prefill)):
        if n > most:
            return (f"{flag} {n} is more than the model's {max_positions} positions allow (at most {most}: "
                    f"the timed steps take {room} more)")
    return None


def _persistent_compile_cache() -> None:
    from sparkchat.engine.nn.ops import use_persistent_cache

    use_persistent_cache()


def _triton_cache_warm() -> bool:
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    return cache.is_dir() and any(cache.iterdir())


def measure_accept_length(engine, draft_steps: int, *, truncated: bool | None = None,
                          draft_vocab: int | None = None, tokens_out: list[int] | None = None) -> float | None:
    """Mean MTP accept length at temperature 0 over a few prompts (real weights only); `truncated` and
    `draft_vocab` set the truncated draft head (None: as the engine has it); the answers' token ids
    are appended to `tokens_out` when given."""
    from dataclasses import replace

    from sparkchat.engine.events import SamplingParams

    if engine.model.mtp is None:
        return None
    sw = replace(engine.switches, mtp=True, draft_steps=draft_steps)
    if truncated is not None:
        sw.truncated_draft_head = truncated
    if draft_vocab is not None:
        sw.draft_vocab = draft_vocab
    engine.set_switches(sw)
    lengths = []
    for prompt in ACCEPT_PROMPTS:
        engine.reset()
        stats = None
        for event in engine.generate([{"role": "user", "content": prompt}], SamplingParams(max_tokens=128)):
            stats = event.stats
            if tokens_out is not None:
                tokens_out.extend(event.token_ids)
        if stats is not None and stats.accept_length_mean is not None:
            lengths.append(stats.accept_length_mean)
    engine.reset()
    return sum(lengths) / len(lengths) if lengths else None


def spark_projection_note(r: dict) -> list[str]:
    """How the Spark column was made, with its parts from this run (lines for the table's foot)."""
    lines = ["* Spark: a projection, not a measurement — each row's bytes at the DGX Spark's 234 GB/s read "
             "bandwidth, streamed at the efficiency of the FP8 head's GEMV alone here"]
    if r.get("stream_efficiency_pct") is not None:
        # on a GPU the head's calls replay in a CUDA graph, as the step runs them (no host launch gaps)
        how = "eager calls" if r.get("device") == "cpu" else "in a CUDA graph"
        lines[0] += f" ({r['stream_efficiency_pct']:.0f}% of read BW, {how})"
        lines.append(f"  plus the time each row spent here beyond streaming its bytes (launches, dependency chains: "
                      f"{r['spark_latency_ms']:.2f} ms in the fastest decode row), taken to cost the same there; "
                      f"+ MTP with half the experts repeated between neighbours, as a real model routes. "
                      f"Had all of that row's time scaled with bandwidth: {r['spark_scaled_tok_s']:.1f} tok/s.")
    return lines


def format_table(r: dict) -> str:
    lines = [f"sparkchat bench — {r['source']} on {r['device']}, context {r['context']} tokens, "
             f"read bandwidth {r['read_bw_gb_s']:.0f} GB/s (measured)", ""]
    head = f"{'configuration':58} {'TPOT ms':>8} {'tok/s':>8} {'MB/tok':>8} {'GB/s':>7} {'% BW':>6} {'Spark*':>7}"
    lines += [head, "-" * len(head)]
    for row in r["rows"]:
        mb = f"{row['bytes_per_token'] / 1e6:8.0f}" if row["bytes_per_token"] else f"{'—':>8}"
        gbs = f"{row['gb_s']:7.0f}" if row["gb_s"] else f"{'—':>7}"
        pct = f"{row['pct_read_bw']:6.1f}" if row["pct_read_bw"] else f"{'—':>6}"
        lines.append(f"{row['name'][:58]:58} {row['tpot_ms']:8.2f} {row['tok_s']:8.1f} {mb} {gbs} {pct} "
                     f"{row['projected_spark_tok_s']:7.1f}")
        if row["note"]:
            lines.append(f"    {row['note']}")
    lines.append("")
    if r["verify_decode_ratio"] is not None:
        lines.append(f"verify ({r['verify_ms']:.2f} ms) ÷ decode step: {r['verify_decode_ratio']:.2f}×; "
                     f"draft step {r['draft_step_ms']:.2f} ms; accept length {r['accept_length']:.2f} "
                     f"({r['accept_length_source']})")
        lines.append(f"verify of {r['draft_steps'] + 1} tokens: {r['verify_pct_read_bw']:.1f}% of read BW with random routing; "
                     f"with half the experts repeated between neighbours {r['verify_correlated_ms']:.2f} ms = "
                     f"{r['verify_correlated_decode_ratio']:.2f}× decode, {r['verify_correlated_pct_read_bw']:.1f}% of read BW "
                     f"(the routing wrapper's own {r['verify_routing_wrapper_ms']:.2f} ms left out)")
    if r.get("loop_cycle_ms") is not None:
        parts = r["verify_ms"] + r["draft_steps"] * r["draft_step_ms"]
        lines.append(f"the MTP loop as it runs (draft, verify, accept, commit, stream): "
                     f"{r['loop_cycle_ms']:.2f} ms a cycle, {r['loop_tokens_per_cycle']:.2f} tokens a cycle "
                     f"(the parts above: {parts:.2f} ms{_gap(r)}); at "
                     f"accept length {r['accept_length']:.2f}: {r['loop_tpot_ms']:.2f} ms a token = "
                     f"{1000 / r['loop_tpot_ms']:.1f} tok/s")
    if r.get("decode_loop_ms") is not None:
        head = next((row for row in r["rows"] if row["name"].startswith("+ FP8 LM head")), None)
        beside = "" if head is None else \
            f" (the FP8 head row, its step replayed back to back: {head['tpot_ms']:.2f} ms)"
        lines.append(f"the decode loop as it runs, without MTP (step, pick, stream): {r['decode_loop_ms']:.2f} ms a "
                     f"token = {1000 / r['decode_loop_ms']:.1f} tok/s{beside}")
    if r.get("draft_vocab") is not None:
        lines.append(f"draft head top {r['draft_vocab']:,} tokens: {r['draft_head_bytes'] / 1e6:.1f} MB per draft "
                     f"step, draft step {r['draft_step_ms']:.2f} ms; full head {r['draft_head_full_bytes'] / 1e6:.1f} MB, "
                     f"draft step {r['draft_step_full_head_ms']:.2f} ms; MTP per token "
                     f"{r['mtp_full_head_tpot_ms']:.2f} ms with the full head at accept length "
                     f"{r['accept_length_full_head']:.2f}")
        if r.get("draft_vocab_coverage") is not None:
            lines.append(f"the draft vocabulary holds {100 * r['draft_vocab_coverage']:.1f}% of the tokens the model "
                         f"emitted while its accept length was measured")
    lines += spark_projection_note(r)
    if r["prefill_ms_per_token"] is not None:
        lines.append(f"prefill of {r['prefill_tokens']} tokens: {r['prefill_ms_per_token']:.3f} ms per token")
    lines.append(f"start-up: load {r['load_s']:.1f} s + first fast step {r['first_step_s']:.1f} s "
                 f"(kernel compilation, graph capture; caches {r['triton_cache']}) = launch to first token "
                 f"{r['load_s'] + r['first_step_s']:.1f} s; whole run {r['total_s']:.1f} s")
    return "\n".join(lines)


def _gap(r: dict) -> str:
    """The MTP loop's GPU gap a cycle, where it was measured (CUDA graphs)."""
    gap = r.get("loop_gap_ms")
    return "" if gap is None else f"; between a verify's end and the next draft's start on the GPU: {gap:.2f} ms"

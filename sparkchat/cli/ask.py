"""`sparkchat ask`: one prompt in, the answer streamed out (or one JSON object with --json)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparkchat.engine.events import GenerationStats
    from sparkchat.engine.session import Engine

THINK_END = "</think>"


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Model, device and optimization flags shared by commands that load the engine."""
    p.add_argument("--model", "-m", help="model directory (or a Hub repo id already downloaded)")
    p.add_argument("--device", default=None, help="auto (default), cpu or cuda")
    p.add_argument("--dtype", default=None, help="auto (default: bfloat16 on CUDA, float32 on CPU), "
                                                  "float32, bfloat16 or float16")
    p.add_argument("--max-context", type=int, default=None, metavar="N", help="context length to allocate")
    p.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=None,
                   help="MTP speculative decoding (default: on when the model has an MTP layer)")
    p.add_argument("--draft-steps", type=int, default=None, metavar="N", help="MTP draft tokens per step, 1-4")
    p.add_argument("--fp8-head", action=argparse.BooleanOptionalAction, default=None,
                   help="FP8 LM head quantized online (default: on with CUDA)")
    p.add_argument("--truncated-draft-head", action=argparse.BooleanOptionalAction, default=None,
                   help="MTP drafts over the most frequent tokens only; the verify keeps the full head "
                        "(default: on with CUDA)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="tokens the truncated draft head covers (default 32768)")
    p.add_argument("--mxfp4-kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="Triton MXFP4 expert kernels (default: on with CUDA)")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None, metavar="N", help="answer length limit (512)")
    p.add_argument("--temperature", "-t", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens (0 = all)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="let the model think before answering (default: on)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ask", help="answer one prompt and exit",
                       description="Answer one prompt. Piped stdin is appended to the prompt.")
    p.add_argument("prompt", nargs="*", help="the prompt (joined with spaces)")
    add_engine_flags(p)
    add_sampling_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with the answer and stats")
    p.add_argument("--stats", action="store_true", help="print speed figures to stderr after the answer")
    p.add_argument("--endpoint", metavar="URL", default=None,
                   help="ask an OpenAI-compatible server (sparkchat serve, SGLang, vLLM) instead of loading the "
                        "model; --model then names the served model; API key from $SPARKCHAT_API_KEY")
    p.set_defaults(func=run)


def read_prompt(args: argparse.Namespace) -> str:
    prompt = " ".join(args.prompt)
    if not sys.stdin.isatty():
        piped = sys.stdin.read()
        if piped.strip():
            prompt = f"{prompt}\n\n{piped}" if prompt else piped
    return prompt.strip()


def sampling_from(args: argparse.Namespace):
    """The sampling flags as SamplingParams; ValueError (one line) for a flag out of range, checked
    before any model loads (the draft-steps flag too)."""
    from sparkchat.engine.events import SamplingParams
    from sparkchat.settings import MAX_DRAFT_STEPS, MIN_DRAFT_VOCAB

    steps = getattr(args, "draft_steps", None)
    if steps is not None and not 1 <= steps <= MAX_DRAFT_STEPS:
        raise ValueError(f"--draft-steps must be between 1 and {MAX_DRAFT_STEPS}, got {steps}")
    vocab = getattr(args, "draft_vocab", None)
    if vocab is not None and vocab < MIN_DRAFT_VOCAB:
        raise ValueError(f"--draft-vocab must be at least {MIN_DRAFT_VOCAB}, got {vocab}")
    p = SamplingParams()
    for name in ("temperature", "top_p", "top_k", "seed", "max_tokens"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(p, name, value)
    p.validate(flags=True)
    return p


@contextmanager
def terminal_load_progress(label: str) -> Iterator[Callable[[int, int], None] | None]:
    """A byte bar on stderr while a model loads (tens of seconds for the real one), gone when it is done;
    nothing when stderr is not a terminal, so scripts see only their output."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console

    from sparkchat.cli.progress import byte_bar

    bar, task = byte_bar(Console(stderr=True), f"loading {label}")
    with bar:
        yield lambda done, total: bar.update(task, completed=done, total=total or None)


def load_engine(args: argparse.Namespace) -> Engine:
    """The engine for --model (or the configured default), with the switch flags applied."""
    from sparkchat.cli.resolve import resolve_model
    from sparkchat.engine.session import Engine

    model_dir = resolve_model(args.model)
    with terminal_load_progress(model_dir.name) as progress:
        engine = Engine.load(model_dir, device=args.device or "auto", dtype=args.dtype or "auto",
                             max_context=args.max_context or 8192, progress=progress)
    sw = engine.switches
    for name in ("mtp", "draft_steps", "fp8_head", "mxfp4_kernels", "truncated_draft_head", "draft_vocab"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(sw, name, value)
    engine.set_switches(sw)
    return engine


def split_thinking(text: str) -> tuple[str | None, str]:
    """(reasoning, answer): the generation prompt opens <think>, so reasoning ends at </think>."""
    if THINK_END in text:
        reasoning, answer = text.split(THINK_END, 1)
        return reasoning.strip(), answer.strip()
    return None, text.strip()


def run(args: argparse.Namespace) -> int:
    from sparkchat.cli import EXIT_USAGE, fail

    prompt = read_prompt(args)
    if not prompt:
        return fail("no prompt given: pass it as an argument or pipe it on stdin", EXIT_USAGE)
    try:
        params = sampling_from(args)
    except ValueError as e:
        return fail(str(e), EXIT_USAGE)
    if not args.endpoint and not args.model:
        from sparkchat.settings import load_settings

        args.endpoint = load_settings().endpoint or None  # a configured server, unless a model is named
    if args.endpoint:
        from sparkchat.remote import connect_endpoint

        engine = connect_endpoint(args.endpoint, model=args.model)
    else:
        engine = load_engine(args)
    messages: list[dict[str, Any]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": prompt})
    think = True if args.think is None else args.think
    if args.endpoint:  # the server renders the prompt: its token ids stay unknown here
        prompt_ids: list[int] = []
        events = engine.generate(messages, params, enable_thinking=think)
    else:
        prompt_ids = engine.tokenizer.encode_chat(messages, enable_thinking=think)
        check_model_limit(engine, prompt_ids)
        events = engine.generate_ids(prompt_ids, params)
    pieces: list[str] = []
    token_ids: list[int] = []
    finish, stats = None, None
    try:
        for event in events:
            pieces.append(event.text)
            token_ids.extend(event.token_ids)
            finish, stats = event.finish_reason, event.stats
            if not args.json and event.text:
                sys.stdout.write(event.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        if args.json:  # the text so far, as an answer cancelled mid-way; main then says "interrupted"
            print_json(engine, "".join(pieces), think, token_ids, prompt_ids, "cancelled", stats)
        raise
    text = "".join(pieces)
    if args.json:
        print_json(engine, text, think, token_ids, prompt_ids, finish, stats)
    else:
        if not text.endswith("\n"):
            sys.stdout.write("\n")
    if args.stats and stats is not None:
        print(format_stats(stats), file=sys.stderr)
    return 0


def check_model_limit(engine: Engine, prompt_ids: list[int]) -> None:
    """A prompt past the model's own positions: --max-context cannot help, so say so (the engine's
    message suggests raising it)."""
    from sparkchat.engine.errors import ContextOverflowError

    limit = engine.config.max_position_embeddings
    if len(prompt_ids) >= engine.max_context >= limit:
        raise ContextOverflowError(f"the prompt is {len(prompt_ids)} tokens but the model takes at most {limit} "
                                   "positions; shorten the prompt")


def print_json(engine: Any, text: str, think: bool, token_ids: list[int], prompt_ids: list[int],
               finish: str | None, stats: GenerationStats | None) -> None:
    """The --json answer: one object, the same keys whether the answer ended or was interrupted."""
    from sparkchat.engine.events import GenerationStats

    reasoning, answer = split_thinking(text) if think else (None, text)
    stats = stats or GenerationStats(prompt_tokens=len(prompt_ids))  # interrupted before the first token
    out = {
        "model": engine.name, "text": text, "answer": answer, "reasoning": reasoning,
        "token_ids": token_ids, "prompt_token_ids": prompt_ids, "finish_reason": finish,
        "stats": stats.to_dict(),
        "switches": {k: vars(v) for k, v in engine.switch_states().items()},
    }
    print(json.dumps(out, ensure_ascii=False))


def format_stats(s) -> str:
    from sparkchat.ui.format import bandwidth_text  # text only, no Textual

    parts = [f"{s.generated_tokens} tokens", f"{s.decode_tok_s:.1f} tok/s", f"TTFT {s.ttft_s * 1000:.0f} ms",
             f"prefill {s.prefilled_tokens} tok at {s.prefill_tok_s:.0f} tok/s"]
    if s.accept_length_mean is not None:
        parts.append(f"accept length {s.accept_length_mean:.2f}")
    memory = bandwidth_text(s)
    if memory:
        parts.append(memory)
    return " · ".join(parts)

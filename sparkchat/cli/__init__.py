"""The `sparkchat` command: with no subcommand it opens the terminal app; subcommands live in modules
of this package, each with a `register(subparsers)` that adds its parser and sets `func`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sparkchat.cli import ask, bench, models, serve

# Exit codes, distinct so scripts can tell failures apart.
EXIT_OK = 0
EXIT_FAILURE = 1  # the output cannot be written, memory runs out
EXIT_USAGE = 2
EXIT_MODEL = 3
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away

_COMMAND_MODULES = [ask, models, bench, serve]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparkchat", description="Fast local chat with Ling-3.0-flash. "
                                     "With no command, opens the terminal app.")
    parser.add_argument("--model", "-m", help="model for the terminal app (default: the configured one)")
    parser.add_argument("--device", default=None, help="auto (default), cpu or cuda")
    parser.add_argument("--max-context", type=int, default=8192, metavar="N", help="context length (8192)")
    parser.add_argument("--endpoint", metavar="URL", help="talk to an OpenAI-compatible server instead")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _COMMAND_MODULES:
        module.register(sub)
    return parser


def fail(message: str, code: int) -> int:
    print(f"sparkchat: error: {message}", file=sys.stderr)
    return code


def open_app(args: argparse.Namespace) -> int:
    """The terminal app, with the model loading in the background (or a hint when there is none)."""
    from sparkchat.cli.resolve import resolve_model
    from sparkchat.engine.errors import ModelError
    from sparkchat.settings import load_settings
    from sparkchat.ui.app import run_app

    settings = load_settings()
    endpoint = args.endpoint or (None if args.model else settings.endpoint or None)
    if endpoint:
        from sparkchat.remote import connect_endpoint

        return run_app(engine=connect_endpoint(endpoint, model=args.model))
    try:
        model_dir = resolve_model(args.model, announce_demo=False)  # the app says it on screen
    except ModelError as e:
        if args.model:
            raise
        return run_app(None, no_model_reason=str(e))
    return run_app(model_dir, device=args.device or settings.device or "auto", dtype=settings.dtype or "auto",
                   max_context=args.max_context)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from sparkchat.cli.output import OutputError, marked_stdout, out_of_memory_message, silence_stdout
    from sparkchat.engine.errors import SparkchatError

    try:
        if args.command is None:
            return open_app(args)
        with marked_stdout():
            try:
                return int(args.func(args) or 0)
            finally:
                sys.stdout.flush()  # here, not at exit, so a full disk is reported like any failure
    except OutputError as e:
        silence_stdout()
        if isinstance(e.error, BrokenPipeError):  # the reader has what it wanted (`| head`): quiet
            return EXIT_BROKEN_PIPE
        print(f"sparkchat: error: cannot write the output: {e.error.strerror or e.error}", file=sys.stderr)
        return EXIT_FAILURE
    except SparkchatError as e:
        return fail(str(e), EXIT_MODEL)
    except KeyboardInterrupt:
        print("sparkchat: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RuntimeError as e:  # torch.OutOfMemoryError is one too
        message = out_of_memory_message(e)
        if message is None:
            raise
        return fail(message, EXIT_FAILURE)


if __name__ == "__main__":
    sys.exit(main())

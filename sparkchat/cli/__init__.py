"""The `sparkchat` command: with no subcommand it opens the terminal app; subcommands live in modules
of this package, each with a `register(subparsers)` that adds its parser and sets `func`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sparkchat.cli import ask, bench, models

# Exit codes, distinct so scripts can tell failures apart.
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_MODEL = 3
EXIT_INTERRUPTED = 130

_COMMAND_MODULES = [ask, models, bench]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparkchat", description="Fast local chat with Ling-3.0-flash.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _COMMAND_MODULES:
        module.register(sub)
    return parser


def fail(message: str, code: int) -> int:
    print(f"sparkchat: error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    from sparkchat.engine.errors import SparkchatError

    try:
        return int(args.func(args) or 0)
    except SparkchatError as e:
        return fail(str(e), EXIT_MODEL)
    except KeyboardInterrupt:
        print("sparkchat: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

"""`sparkchat serve`: the embedded engine behind an OpenAI-compatible HTTP API (see sparkchat/server.py)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

API_KEY_ENV = "SPARKCHAT_API_KEY"


def register(sub: argparse._SubParsersAction) -> None:
    from sparkchat.cli.ask import add_engine_flags, add_sampling_flags

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="Serve the model over an OpenAI-compatible HTTP API: POST /v1/chat/completions "
                                   "(streaming or not), GET /v1/models, GET /health. One answer is decoded at a "
                                   "time; the sampling flags set defaults for requests that leave them out.")
    add_engine_flags(p)
    add_sampling_flags(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for the network)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} when set, else no key)")
    p.add_argument("--queue", type=int, default=8, metavar="N",
                   help="requests that may wait while one is decoded (default 8); more get 503")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the model directory's name)")
    p.add_argument("--quiet", "-q", action="store_true", help="do not log each request to stderr")
    p.set_defaults(func=run)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    from sparkchat.cli import EXIT_USAGE, fail
    from sparkchat.cli.ask import load_engine, sampling_from

    if args.queue < 0:
        return fail("--queue must be 0 or more", EXIT_USAGE)
    if not 0 <= args.port <= 65535:
        return fail("--port must be between 0 and 65535", EXIT_USAGE)
    try:
        defaults = sampling_from(args)
    except ValueError as e:
        return fail(str(e), EXIT_USAGE)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    engine = load_engine(args)

    from sparkchat.engine.errors import SparkchatError
    from sparkchat.server import ChatServer

    log = None if args.quiet else (lambda line: print(f"sparkchat: {line}", file=sys.stderr, flush=True))
    try:
        server = ChatServer(engine, host=args.host, port=args.port, api_key=api_key, queue=args.queue,
                            model_name=args.served_model_name, defaults=defaults, system=args.system,
                            enable_thinking=True if args.think is None else args.think, log=log)
    except OSError as e:
        raise SparkchatError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    print(f"sparkchat: serving {server.model_name} at {server.url}/v1 "
          f"(one answer at a time, {args.queue} may wait{', API key required' if api_key else ''}); "
          "Ctrl-C stops", file=sys.stderr, flush=True)
    if not _is_loopback(args.host) and not api_key:
        print(f"sparkchat: warning: listening on {args.host} without an API key: anyone who can reach this "
              f"port can use the model (set --api-key or ${API_KEY_ENV})", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0

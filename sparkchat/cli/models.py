"""Model and machine commands: `download`, `models`, `rm`, `info`, `config`.

Every user-facing failure is one line on stderr (`sparkchat: ...`) and a non-zero exit code."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from sparkchat.engine.errors import SparkchatError


def register(sub: Any) -> None:
    """Add the model/machine subcommands to `sub` (an argparse subparsers object)."""
    p = sub.add_parser("download", help="download a model from the Hugging Face Hub",
                       description="Download a model's safetensors weights, configs and tokenizer into the HF "
                                   "cache (resumable; never pickles or code).")
    p.add_argument("repo", metavar="REPO", help="Hub repo id, e.g. inclusionAI/Ling-3.0-flash-fp4")
    p.add_argument("--revision", metavar="R", help="branch, tag or commit (default: main)")
    p.add_argument("--offline", action="store_true", help="only use the local cache; say what is missing")
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("models", help="list local models (size, format, whether they fit in memory)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("rm", help="delete a local model")
    p.add_argument("name", metavar="NAME", help="a name from `sparkchat models`, or its path")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("info", help="device, memory, versions and which optimizations work here")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("config", help="show settings, or change one with `config set KEY VALUE`")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION")
    s = csub.add_parser("set", help="set one value (e.g. `config set temperature 0.7`)")
    s.add_argument("key", metavar="KEY")
    s.add_argument("value", metavar="VALUE")
    s.set_defaults(func=cmd_config_set)
    u = csub.add_parser("unset", help="put one value back to its default")
    u.add_argument("key", metavar="KEY")
    u.set_defaults(func=cmd_config_unset)
    p.set_defaults(func=cmd_config_show)


def _fail(message: str, code: str) -> int:
    """One line on stderr; `code` names an exit code of sparkchat.cli (imported late: it imports us)."""
    from sparkchat import cli

    return cli.fail(message, getattr(cli, code))


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(file=sys.stderr if stderr else sys.stdout, highlight=False)


# --- download -----------------------------------------------------------------------------------------

def cmd_download(args: argparse.Namespace) -> int:
    from sparkchat.settings import SettingsError, load_settings

    try:
        endpoint = load_settings().hub_endpoint or None
    except SettingsError as e:
        return _fail(str(e), "EXIT_USAGE")
    if endpoint and not os.environ.get("HF_ENDPOINT"):
        # before huggingface_hub is imported, so its own side requests go to the mirror too
        os.environ["HF_ENDPOINT"] = endpoint

    from sparkchat import hub
    from sparkchat.cli.progress import byte_bar

    console = _console(stderr=True)
    progress, task = byte_bar(console, args.repo)
    seen = {"bytes": 0}

    def on_bytes(done: int, total: int) -> None:
        seen["bytes"] = done
        progress.update(task, completed=done, total=total or None)

    start = time.monotonic()
    try:
        with progress:
            path = hub.download(args.repo, args.revision, offline=args.offline, progress=on_bytes,
                                endpoint=endpoint)
    except KeyboardInterrupt:
        return _fail(f"download of {args.repo} interrupted; run the same command to continue "
                     "(finished files are kept)", "EXIT_INTERRUPTED")
    except SparkchatError as e:
        return _fail(str(e), "EXIT_MODEL")
    took = time.monotonic() - start
    if seen["bytes"]:
        rate = hub.format_bytes(seen["bytes"] / max(took, 1e-3))
        console.print(f"{args.repo}: {hub.format_bytes(seen['bytes'])} downloaded in {took:.1f} s ({rate}/s)")
    else:
        console.print(f"{args.repo}: already downloaded")
    print(path)
    return 0


# --- models / rm --------------------------------------------------------------------------------------

def cmd_models(args: argparse.Namespace) -> int:
    from sparkchat import hub

    try:
        models = hub.list_local_models()
    except SparkchatError as e:
        return _fail(str(e), "EXIT_MODEL")
    if args.json:
        rows = [{"name": m.name, "path": str(m.path), "size_bytes": m.size, "format": m.weight_format,
                 "resident_bytes": m.resident_bytes, "available_bytes": m.available_bytes, "fits": m.fits,
                 "source": m.source, "revision": m.revision, "has_mtp": m.has_mtp} for m in models]
        print(json.dumps(rows, indent=2))
        return 0
    console = _console()
    if not models:
        console.print("no local models yet: `sparkchat download inclusionAI/Ling-3.0-flash-fp4` fetches one")
        return 0
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("name", "size", "format", "fits", "path"):
        table.add_column(col, justify="right" if col == "size" else "left", no_wrap=col != "path")
    fb = hub.format_bytes
    for m in models:
        fits = "[green]yes[/]" if m.fits else f"[red]no[/]: needs {fb(m.resident_bytes)}, {fb(m.available_bytes)} free"
        table.add_row(m.name, fb(m.size), m.weight_format, fits, str(m.path))
    console.print(table)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from sparkchat import hub

    m = hub.find_local_model(args.name)
    if m is None:
        return _fail(f"no local model named {args.name!r}: `sparkchat models` lists them", "EXIT_MODEL")
    if not args.yes:
        if not sys.stdin.isatty():
            return _fail(f"not deleting {m.name} without --yes (stdin is not a terminal)", "EXIT_USAGE")
        answer = input(f"delete {m.name} ({hub.format_bytes(m.size)}) at {m.path}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("kept", file=sys.stderr)
            return 0
    try:
        removed, freed = hub.remove_model(m.path)
    except SparkchatError as e:
        return _fail(str(e), "EXIT_MODEL")
    print(f"removed {removed.name} (freed {hub.format_bytes(freed)})")
    return 0


# --- info ---------------------------------------------------------------------------------------------

def cmd_info(args: argparse.Namespace) -> int:
    from sparkchat import hub
    from sparkchat.engine.capabilities import detect
    from sparkchat.settings import SettingsError, load_settings

    has_mtp = None
    model_name = None
    try:
        model_name = load_settings().model
        local = hub.find_local_model(model_name, hub.list_local_models(available_bytes=0))
        has_mtp = local.has_mtp if local is not None else None
    except SettingsError as e:
        return _fail(str(e), "EXIT_USAGE")
    except (SparkchatError, OSError):
        pass
    caps = detect(has_mtp=has_mtp)
    if args.json:
        print(json.dumps({**caps.to_dict(), "model": model_name}, indent=2))
        return 0

    from rich.table import Table

    fb = hub.format_bytes
    console = _console()
    t = Table(box=None, show_header=False, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    cc = caps.compute_capability
    mem_kind = "unified memory" if caps.unified_memory else ("device memory" if caps.cuda_available else "host RAM")
    t.add_row("device", f"{caps.device} · {caps.device_name}" + (f" · sm_{cc[0]}{cc[1]}" if cc else ""))
    t.add_row("memory", f"{fb(caps.free_memory_bytes)} free of {fb(caps.total_memory_bytes)} ({mem_kind})")
    t.add_row("python", caps.python_version)
    t.add_row("torch", f"{caps.torch_version or 'not installed'}"
                       + (f" (CUDA {caps.cuda_version})" if caps.cuda_version else ""))
    t.add_row("triton", caps.triton_version if caps.triton_importable else (caps.triton_error or "not installed"))
    t.add_row("model", f"{model_name}" + ("" if has_mtp is not None else " (not downloaded)"))
    console.print(t)
    console.print()
    o = Table(box=None, pad_edge=False)
    o.add_column("optimization")
    o.add_column("here")
    o.add_column("why / how")
    for key, a in caps.optimizations.items():
        here = "[green]yes[/]" if a.available else ("[yellow]?[/]" if a.available is None else "[red]no[/]")
        o.add_row(key, here, a.reason or "")
    console.print(o)
    return 0


# --- config -------------------------------------------------------------------------------------------

def cmd_config_show(args: argparse.Namespace) -> int:
    from sparkchat.settings import Settings, SettingsError, data_dir, load_settings, settings_path

    path = settings_path()
    try:
        s = load_settings(path)
    except SettingsError as e:
        return _fail(str(e), "EXIT_USAGE")
    state = "" if path.is_file() else " (not created yet: defaults in force)"
    print(f"# {path}{state}")
    print(f"# data dir: {data_dir()}")
    defaults = Settings().flat()
    for key, value in s.flat().items():
        shown = "none" if value is None else json.dumps(value) if isinstance(value, str) else (
            str(value).lower() if isinstance(value, bool) else str(value))
        mark = "" if value == defaults[key] else "  # changed"
        print(f"{key} = {shown}{mark}")
    return 0


def cmd_config_set(args: argparse.Namespace) -> int:
    from sparkchat.settings import SettingsError, load_settings, save_settings, set_value

    try:
        s = set_value(load_settings(), args.key, args.value)
        path = save_settings(s)
    except SettingsError as e:
        return _fail(str(e), "EXIT_USAGE")
    print(f"{args.key} = {args.value} (saved to {path})")
    return 0


def cmd_config_unset(args: argparse.Namespace) -> int:
    from sparkchat.settings import SettingsError, load_settings, reset_value, save_settings

    try:
        s = reset_value(load_settings(), args.key)
        path = save_settings(s)
    except SettingsError as e:
        return _fail(str(e), "EXIT_USAGE")
    print(f"{args.key} back to its default (saved to {path})")
    return 0

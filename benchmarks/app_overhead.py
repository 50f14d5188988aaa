"""What answering through the terminal app costs against `sparkchat ask`: same model, prompt, switches.

    python benchmarks/app_overhead.py                       # builds a small CPU model once, 5 rounds
    python benchmarks/app_overhead.py --model DIR --runs 7 --max-tokens 128 --device cpu
    python benchmarks/app_overhead.py --model DIR --runs 15 --in-process   # the streaming UI's cost alone

Each round runs `sparkchat ask --json` and then the app (headless, driven by a Pilot, with run_app's own
process settings), each in a fresh process so both start cold, and reads the decode tok/s the engine
reports. Rounds alternate, so both see the same machine; the overhead is the median over rounds of
1 - app/ask. It also reports the share of a core the app's UI thread used while answering (median),
a figure the machine's noise hardly moves. On a shared machine a
run is started only once other processes are quiet, and done again if they took CPU meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the checkout

PROMPT = "Explain how a hash table works, step by step."
MODEL_CACHE = Path(tempfile.gettempdir()) / "sparkchat-overhead-model"
# A random Ling-3.0-flash-shaped model big enough that a CPU decode step takes ~20 ms (tiny: ~5 ms).
SMALL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=8, head_dim=32, kv_lora_rank=64, qk_rope_head_dim=32,
             qk_nope_head_dim=32, v_head_dim=32, num_local_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2,
             layer_group_size=4)


def build_model(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    from tests.conftest import make_model_dir  # needs the test extras (transformers)

    return make_model_dir(path, **SMALL)


def fast_paths(device: str) -> bool:
    """The engine's own defaults: FP8 head, MXFP4 kernels and CUDA graphs on a GPU, none on the CPU."""
    return device != "cpu"


def switch_flags(mtp: bool, device: str) -> list[str]:
    # explicit on both sides: the app's saved switches and ask's engine defaults differ on CPU (FP8 head)
    fast = fast_paths(device)
    return ["--mtp" if mtp else "--no-mtp", "--draft-steps", "3", "--fp8-head" if fast else "--no-fp8-head",
            "--mxfp4-kernels" if fast else "--no-mxfp4-kernels"]


def _busy_and_children() -> tuple[float, float]:
    """(CPU seconds every process has used, CPU seconds our finished children used)."""
    import resource

    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy / os.sysconf("SC_CLK_TCK"), child.ru_utime + child.ru_stime


def wait_until_quiet(limit: float, timeout: float = 300.0) -> None:
    """Wait until other processes use less than `limit` cores (measured over a second)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b0, _ = _busy_and_children()
        time.sleep(1.0)
        b1, _ = _busy_and_children()
        if b1 - b0 < limit:
            return
    print("the machine stayed busy; measuring anyway", file=sys.stderr)


def measured(fn, model: Path, args: argparse.Namespace, env: dict[str, str]) -> tuple[dict, float]:
    """Run one measurement; returns its stats and the cores other processes used meanwhile."""
    b0, c0 = _busy_and_children()
    t0 = time.monotonic()
    stats = fn(model, args, env)
    b1, c1 = _busy_and_children()
    return stats, max(0.0, ((b1 - b0) - (c1 - c0)) / (time.monotonic() - t0))


def run_ask(model: Path, args: argparse.Namespace, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "sparkchat", "ask", PROMPT, "--model", str(model), "--device", args.device,
           "--max-tokens", str(args.max_tokens), "--json", *switch_flags(args.mtp, args.device)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["stats"]


def run_app_once(model: Path, args: argparse.Namespace, env: dict[str, str]) -> dict:
    cmd = [sys.executable, __file__, "--app-once", "--model", str(model), "--device", args.device,
           "--max-tokens", str(args.max_tokens), "--mtp" if args.mtp else "--no-mtp"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@contextlib.asynccontextmanager
async def running_app(model: Path, args: argparse.Namespace, history, settings):
    """The app with `model` loaded through its own loader, the benchmark's switches and chat settings,
    under a Pilot: yields (app, pilot) once the engine is up."""
    from sparkchat.engine.events import Switches
    from sparkchat.ui.app import SparkchatApp, engine_loader, engine_thread_settings

    with engine_thread_settings():
        app = SparkchatApp(engine_factory=engine_loader(model, device=args.device), history=history,
                           model_label=model.name)
        app.prefs.chat = settings
        fast = fast_paths(args.device)
        app.prefs.switches = Switches(mtp=args.mtp, draft_steps=3, fp8_head=fast, mxfp4_kernels=fast, cuda_graphs=fast)
        async with app.run_test(size=(120, 40)) as pilot:
            while app.engine is None:
                if app.engine_status == "failed":
                    raise SystemExit(app.engine_error)
                await pilot.pause(0.05)
            yield app, pilot


async def drive_app(model: Path, args: argparse.Namespace) -> dict:
    """One answer through the app, as a user gets it: the engine loads through the app's loader, the
    prompt goes in through the prompt box, the answer streams into the chat with live stats."""
    from sparkchat.history import History
    from sparkchat.ui.prefs import ChatSettings
    from sparkchat.ui.widgets.prompt import PromptInput

    history = History(Path(os.environ["SPARKCHAT_DATA_DIR"]) / "history.db")
    async with running_app(model, args, history, ChatSettings(max_tokens=args.max_tokens, thinking=True)) as (app, pilot):
        chat = app.chat_screen
        prompt = chat.query_one(PromptInput)
        prompt.focus()
        prompt.text = PROMPT
        wall0, cpu0 = time.monotonic(), time.thread_time()  # this is the UI thread
        await pilot.press("enter")
        while chat.conversation is None or chat.generating:
            await asyncio.sleep(0.1)  # not pilot.pause: the harness must not add work to the UI thread
        ui_cores = (time.thread_time() - cpu0) / (time.monotonic() - wall0)
        conv = history.list()[0]
        stats = dict(history.messages(conv.id)[-1].stats, ui_cores=ui_cores)
    history.close()
    return stats


async def drive_in_process(model: Path, args: argparse.Namespace) -> dict:
    """`--in-process`: per round, one answer without the UI and one through it, same engine, same thread."""
    from sparkchat.history import History
    from sparkchat.ui.prefs import ChatSettings
    from sparkchat.ui.widgets.prompt import PromptInput

    history = History(Path(os.environ["SPARKCHAT_DATA_DIR"]) / "history.db")
    settings = ChatSettings(max_tokens=args.max_tokens, thinking=True)
    messages = [{"role": "user", "content": PROMPT}]
    results: dict[str, list[dict]] = {"ask": [], "app": []}
    async with running_app(model, args, history, settings) as (app, pilot):
        engine, chat = app.engine, app.chat_screen
        prompt = chat.query_one(PromptInput)

        def headless() -> dict:  # what `ask` does, on the same engine thread
            engine.reset()
            last = None
            for last in engine.generate(messages, settings.sampling(), enable_thinking=True):
                pass
            return last.stats.to_dict()

        async def without_ui() -> dict:
            return await asyncio.to_thread(app.on_engine_thread, headless)  # the UI loop idles meanwhile

        async def with_ui() -> dict:
            await pilot.press("ctrl+n")  # a new conversation: the same prompt, all of it prefilled
            while chat.conversation is not None:  # (the key waits its turn after the last answer's end)
                await asyncio.sleep(0.05)
            prompt.focus()
            prompt.text = PROMPT
            wall0, cpu0 = time.monotonic(), time.thread_time()
            await pilot.press("enter")
            while chat.generating or prompt.text:
                await asyncio.sleep(0.1)
            ui_cores = (time.thread_time() - cpu0) / (time.monotonic() - wall0)
            return dict(history.messages(chat.conversation.id)[-1].stats, ui_cores=ui_cores)

        await without_ui()  # warm-up: first-use costs go to neither side
        await with_ui()
        for i in range(args.runs):
            order = (("ask", without_ui), ("app", with_ui)) if i % 2 == 0 else (("app", with_ui), ("ask", without_ui))
            for name, fn in order:
                stats = await fn()
                results[name].append(stats)
                print(f"round {i + 1} {name}: {stats['decode_tok_s']:.1f} tok/s, {stats['generated_tokens']} tokens",
                      file=sys.stderr)
    history.close()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: a small random one, built once)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--quiet", type=float, default=0.1,
                   help="redo a run when other processes used more than this many cores meanwhile (0.1)")
    p.add_argument("--retries", type=int, default=5, help="redos per run at most (5)")
    p.add_argument("--in-process", action="store_true",
                   help="both sides in one process with one engine, alternating (the UI's streaming cost alone)")
    p.add_argument("--app-once", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    model = Path(args.model) if args.model else build_model(MODEL_CACHE)
    if args.app_once:
        print(json.dumps(asyncio.run(drive_app(model, args))))
        return
    results: dict[str, list[dict]] = {"ask": [], "app": []}
    if args.in_process:
        with tempfile.TemporaryDirectory() as tmp:
            os.environ.update(SPARKCHAT_CONFIG_DIR=f"{tmp}/config", SPARKCHAT_DATA_DIR=f"{tmp}/data")
            wait_until_quiet(args.quiet)
            results = asyncio.run(drive_in_process(model, args))
    else:
        _separate_processes(model, args, results)
    report(model, args, results)


def _separate_processes(model: Path, args: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for name, fn in (("ask", run_ask), ("app", run_app_once)):
                env = dict(os.environ, SPARKCHAT_CONFIG_DIR=f"{tmp}/config-{name}-{i}",
                           SPARKCHAT_DATA_DIR=f"{tmp}/data-{name}-{i}")
                for attempt in range(args.retries + 1):
                    # this box is shared: a run during which other processes took CPU is done again
                    wait_until_quiet(args.quiet)
                    stats, others = measured(fn, model, args, env)
                    print(f"round {i + 1} {name}: {stats['decode_tok_s']:.1f} tok/s, {stats['generated_tokens']} "
                          f"tokens, others used {others:.2f} cores", file=sys.stderr)
                    if others < args.quiet:
                        break
                results[name].append(stats)


def report(model: Path, args: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    med = {k: statistics.median(s["decode_tok_s"] for s in v) for k, v in results.items()}
    tokens = {k: sorted({s["generated_tokens"] for s in v}) for k, v in results.items()}
    # paired: each round's app run against the ask run just before it (the machine's speed drifts)
    ratios = [app["decode_tok_s"] / ask["decode_tok_s"] for ask, app in zip(results["ask"], results["app"])]
    overhead = 100 * (1 - statistics.median(ratios))
    ui = statistics.median(s["ui_cores"] for s in results["app"])
    print(json.dumps({"model": str(model), "device": args.device, "mtp": args.mtp, "runs": args.runs,
                      "in_process": args.in_process,
                      "max_tokens": args.max_tokens, "tokens": tokens, "median_decode_tok_s": med,
                      "app_ui_thread_cores": round(ui, 4),
                      "all_decode_tok_s": {k: [round(s["decode_tok_s"], 1) for s in v] for k, v in results.items()},
                      "overhead_pct": round(overhead, 1)}, indent=1))


if __name__ == "__main__":
    main()

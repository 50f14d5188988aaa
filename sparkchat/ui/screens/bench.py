"""The bench screen: NVIDIA's published table (baseline → +MXFP4 → +FP8 head → +MTP) beside the same four
configurations measured here, as a table and as bars, with the projected DGX Spark figure.

A thread worker runs `run_plan` on the app's engine thread and only posts BenchProgress and BenchDone.
It measures the loaded model's weights (and, with an MTP layer, its accept length) or synthetic weights
built for the run: Ling-3.0-flash-fp4's full shapes on a GPU, a small config on the CPU. While it runs
the engine takes no answers (`SparkchatApp.engine_busy`); afterwards its own switches are put back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Header, Input, Label, ProgressBar, Select, Static, Switch

from sparkchat.cli.bench import spark_projection_note
from sparkchat.engine.errors import SparkchatError
from sparkchat.ui.messages import BenchDone, BenchProgress
from sparkchat.ui.widgets.bars import Bar, BarChart

if TYPE_CHECKING:
    from sparkchat.ui.app import SparkchatApp

# NVIDIA's figures: SGLang on the DGX Spark, batch 1, Ling-3.0-flash-fp4 (see shared/performance.md).
CONFIGS = ["baseline", "+ MXFP4 kernels", "+ FP8 head", "+ MTP"]
NVIDIA_SPARK_TOK_S = [36.09, 39.45, 43.94, 51.8]
NVIDIA_SPARK_TEXT = ["36.1", "39.5", "43.9", "51.8–53.9"]
NVIDIA_VERIFY_RATIO = 2.26
FULL_LAYERS = 42  # Ling-3.0-flash-fp4's decoder layers
# A small config of the same architecture, quick on a CPU (the numbers mean little; the table's shape does).
SMALL_CONFIG = dict(hidden_size=256, num_attention_heads=4, head_dim=32, vocab_size=2048, num_experts=32, n_group=4,
                    topk_group=2, num_experts_per_tok=4, moe_intermediate_size=64, intermediate_size=512,
                    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_hidden_layers=6,
                    layer_group_size=3, first_k_dense_replace=1)
DEFAULTS = {"cuda": (1024, 20), "cpu": (64, 3)}  # (context, iters)
MEMORY_MARGIN = 1.1


class BenchCancelled(Exception):
    pass


@dataclass
class BenchPlan:
    source: str  # "loaded" (the engine's model), "full" (synthetic, full shapes, GPU), "small" (synthetic, CPU)
    context: int
    iters: int
    draft_steps: int = 3
    graphs: bool = True
    layers: int = FULL_LAYERS  # "full" only
    measure_accept: bool = True  # "loaded" only: measure the MTP accept length with a few answers
    draft_vocab: int | None = None  # the MTP row drafts through the top-N head (None: the full head)
    engine: Any = None
    cancel: threading.Event = field(default_factory=threading.Event)


Say = Callable[[str, int, int], None]  # (step, index from 1, steps)


class _Steps:
    """Counts the steps of a run for BenchProgress, and stops the run between two when cancelled."""

    def __init__(self, say: Say, cancel: threading.Event) -> None:
        self.say, self.cancel = say, cancel
        self.total = 0
        self.index = 0

    def check(self) -> None:
        if self.cancel.is_set():
            raise BenchCancelled()

    def next(self, name: str) -> None:
        self.check()
        self.index += 1
        self.total = max(self.total, self.index)
        self.say(name, self.index, self.total)


def run_plan(plan: BenchPlan, say: Say) -> tuple[Any, str]:
    """Run the bench as planned; returns (BenchResult, what was measured). Raises BenchCancelled when
    `plan.cancel` is set (checked between steps)."""
    import torch

    from sparkchat.engine.bench import run_bench

    steps = _Steps(say, plan.cancel)
    engine = plan.engine if plan.source == "loaded" else None
    model: Any = None
    saved = None
    accept = rows = None
    try:
        if plan.source == "loaded":
            if engine is None or getattr(engine, "model", None) is None:
                raise SparkchatError("no local model is loaded to measure")
            model = engine.model
            source = f"model {engine.name}"
            has_mtp = model.mtp is not None
            measure = plan.measure_accept and has_mtp
            steps.total = int(measure) + 6 + 2 * int(has_mtp)  # head alone, 3 rows, decode loop; MTP: 2 more
            saved = replace(engine.switches)
            if measure:
                from sparkchat.cli.bench import measure_accept_length

                steps.next("measuring the MTP accept length (3 answers)")
                accept = measure_accept_length(engine, plan.draft_steps)
            if plan.draft_vocab and has_mtp:
                rows = engine.draft_rows(plan.draft_vocab)  # the engine's own top-N, as `sparkchat bench`
        else:
            cfg, device, dtype, source = _synthetic_setup(plan)
            steps.total = 1 + 6 + 2 * int(cfg.has_mtp)
            steps.next("building synthetic weights")
            from sparkchat.engine.synthetic import build_synthetic

            model = build_synthetic(cfg, device, dtype, max_context=plan.context + 128)
        steps.next("measuring the read bandwidth and the first fast step")
        result = run_bench(model, context=plan.context, iters=plan.iters, draft_steps=plan.draft_steps,
                           graphs=plan.graphs, accept_length=accept, progress=steps.next,
                           draft_vocab=plan.draft_vocab, draft_rows=rows)
        steps.check()
        return result, source
    finally:
        if engine is not None and saved is not None:
            _restore(engine, saved)
        elif model is not None:
            model = None
            _free(torch)


def _synthetic_setup(plan: BenchPlan) -> tuple[Any, Any, Any, str]:
    """(config, device, dtype, description) for synthetic weights; refuses what cannot run here."""
    import torch

    from sparkchat.engine.synthetic import LING3_FLASH, synthetic_config

    if plan.source != "full":
        cfg = synthetic_config(base={**LING3_FLASH, **SMALL_CONFIG})
        source = f"synthetic weights, small config ({cfg.num_hidden_layers} layers)"
        return cfg, torch.device("cpu"), torch.float32, source
    if not torch.cuda.is_available():
        raise SparkchatError("full-size synthetic weights need a CUDA GPU; use the small config on the CPU")
    cfg = synthetic_config(plan.layers)
    need, free = synthetic_bytes(cfg), _available_memory()
    if need * MEMORY_MARGIN > free:
        raise SparkchatError(f"synthetic weights for {plan.layers} layers need about {need / 1e9:.0f} GB and "
                             f"{free / 1e9:.0f} GB is free: choose fewer layers")
    from sparkchat.engine.nn.ops import enable_compile, use_persistent_cache

    use_persistent_cache()
    enable_compile()
    return (cfg, torch.device("cuda"), torch.bfloat16,
            f"synthetic weights, Ling-3.0-flash-fp4 shapes, {cfg.num_hidden_layers} layers")


def synthetic_bytes(cfg: Any) -> int:
    """About how much memory synthetic weights for `cfg` take (MXFP4 experts, FP8 linears, BF16 ends)."""
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace + cfg.num_nextn_predict_layers
    experts = moe_layers * E * 3 * H * I * (0.5 + 1 / 32)  # 4-bit values + one scale byte per 32
    attn = cfg.num_hidden_layers * 6 * H * cfg.num_attention_heads * cfg.head_dim  # FP8 projections
    shared = moe_layers * 3 * H * I * cfg.num_shared_experts + moe_layers * E * H * 4
    ends = 2 * cfg.vocab_size * H * 2
    return int(experts + attn + shared + ends)


def _available_memory() -> int:
    from sparkchat.engine.capabilities import available_memory_bytes

    return available_memory_bytes()


def _restore(engine: Any, switches: Any) -> None:
    """The bench set the model's fast paths per row: put the engine's own configuration back."""
    engine.set_switches(switches)
    graphs = getattr(engine, "_graphs", None)
    if graphs is not None:
        graphs.clear()  # captured while the bench's kernels were installed
    engine.reset()
    engine._apply_switches()


def _free(torch: Any) -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class BenchScreen(Screen[None]):
    CSS_PATH = "bench.tcss"
    BINDINGS = [
        Binding("ctrl+r", "run", "Run bench"),
        Binding("escape", "stop", "Stop", priority=True),
        Binding("escape", "back", "Back to chat"),
    ]

    app: SparkchatApp

    def __init__(self) -> None:
        super().__init__()
        self.plan: BenchPlan | None = None
        self.result: Any = None
        self.source = ""
        self.cuda: bool | None = None  # None until probed

    # -- layout and state ----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="⚡")
        with VerticalScroll(id="bench-main"):
            with Horizontal(classes="bench-row"):
                yield Label("Weights", classes="bench-label")
                yield Select([], id="bench-source", allow_blank=True, compact=True, prompt="probing the device…")
                yield Label("Layers", classes="bench-label bench-label-short", id="bench-layers-label")
                yield Input(str(FULL_LAYERS), id="bench-layers", type="integer", compact=True, classes="bench-field")
            with Horizontal(classes="bench-row"):
                yield Label("Context", classes="bench-label")
                yield Input("", id="bench-context", type="integer", compact=True, classes="bench-field")
                yield Label("Iterations", classes="bench-label bench-label-short")
                yield Input("", id="bench-iters", type="integer", compact=True, classes="bench-field")
                yield Label("Draft steps", classes="bench-label bench-label-short")
                yield Select([(str(n), n) for n in range(1, 5)], value=3, allow_blank=False, id="bench-draft",
                             compact=True)
            with Horizontal(classes="bench-row"):
                yield Switch(True, id="bench-graphs")
                yield Label("CUDA graphs", classes="bench-switch-label", id="bench-graphs-label")
                yield Switch(True, id="bench-accept")
                yield Label("measure the MTP accept length", classes="bench-switch-label", id="bench-accept-label")
                yield Button("Run  ^r", variant="primary", id="bench-run", compact=True)
                yield Button("Stop  esc", id="bench-stop", compact=True, disabled=True)
            with Horizontal(id="bench-status-row"):
                yield Static("", id="bench-status", markup=False)
                yield ProgressBar(id="bench-progress", show_eta=False, show_percentage=False)
            yield DataTable(id="bench-table", cursor_type="none", zebra_stripes=True)
            yield BarChart(id="bench-measured")
            yield BarChart(id="bench-spark")
            yield Static("", id="bench-notes", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.app.bench_screen = self
        self.title = "Bench"
        table = self.query_one("#bench-table", DataTable)
        for label, key in (("Configuration", "name"), ("TPOT ms", "tpot"), ("tok/s", "tok_s"), ("MB/token", "mb"),
                           ("GB/s", "gbs"), ("% read BW", "pct"), ("Spark tok/s*", "spark"),
                           ("NVIDIA Spark tok/s", "nvidia")):
            table.add_column(label if key == "name" else Text(label, justify="right"), key=key)
        self.query_one("#bench-progress").display = False
        self.engine_changed()
        self.show_result(None)
        self._probe_device()

    def on_unmount(self) -> None:
        if self.plan is not None:
            self.plan.cancel.set()

    @property
    def running(self) -> bool:
        return self.plan is not None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return self.running and not self.plan.cancel.is_set()  # type: ignore[union-attr]
        if action == "back":
            return not self.running
        return True

    @work(thread=True, group="bench-probe", exit_on_error=False)
    def _probe_device(self) -> None:
        try:
            import torch

            cuda = bool(torch.cuda.is_available())
        except Exception:
            cuda = False
        self.app.call_from_thread(self._set_cuda, cuda)

    def _set_cuda(self, cuda: bool) -> None:
        self.cuda = cuda
        self._fill_sources()

    def _engine_device(self) -> str | None:
        engine = self.app.engine
        device = getattr(engine, "device", None) if engine is not None else None
        return getattr(device, "type", None)

    def engine_changed(self) -> None:
        engine = self.app.engine
        self.sub_title = f"{engine.name} loaded" if engine is not None else {
            "loading": "loading a model…", "failed": "model failed to load"}.get(self.app.engine_status,
                                                                                  "no model loaded")
        self._fill_sources()

    def _sources(self) -> list[tuple[str, str]]:
        out = []
        engine = self.app.engine
        if engine is not None and getattr(engine, "model", None) is not None:
            out.append((f"{engine.name} (the loaded model, {self._engine_device() or '?'})", "loaded"))
        if self.cuda or self._engine_device() == "cuda":
            out.append(("synthetic, Ling-3.0-flash-fp4 shapes (GPU)", "full"))
        out.append(("synthetic, small config (CPU)", "small"))
        return out

    def _fill_sources(self) -> None:
        select = self.query_one("#bench-source", Select)
        options = self._sources()
        current = select.value
        select.set_options(options)
        values = [v for _, v in options]
        select.value = current if current in values else values[0]
        self._source_changed(select.value)  # type: ignore[arg-type]

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "bench-source" and isinstance(event.value, str):
            self._source_changed(event.value)

    def _source_changed(self, source: str) -> None:
        gpu = source == "full" or (source == "loaded" and self._engine_device() == "cuda")
        context, iters = DEFAULTS["cuda" if gpu else "cpu"]
        self.query_one("#bench-context", Input).value = str(context)
        self.query_one("#bench-iters", Input).value = str(iters)
        for wid in ("#bench-layers", "#bench-layers-label"):
            self.query_one(wid).display = source == "full"
        for wid in ("#bench-graphs", "#bench-graphs-label"):
            self.query_one(wid).display = gpu
        for wid in ("#bench-accept", "#bench-accept-label"):
            self.query_one(wid).display = source == "loaded"

    # -- running -------------------------------------------------------------------------------------

    def make_plan(self) -> BenchPlan:
        """The form's values; raises ValueError with a readable message on a bad field."""
        def number(wid: str, label: str, low: int) -> int:
            text = self.query_one(wid, Input).value.strip()
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"{label}: '{text}' is not a whole number") from None
            if value < low:
                raise ValueError(f"{label} must be at least {low}")
            return value

        source = self.query_one("#bench-source", Select).value
        if not isinstance(source, str):
            raise ValueError("choose the weights to measure")
        draft = self.query_one("#bench-draft", Select).value
        plan = BenchPlan(source=source, context=number("#bench-context", "Context", 1),
                         iters=number("#bench-iters", "Iterations", 1),
                         draft_steps=int(draft) if isinstance(draft, int) else 3,
                         graphs=self.query_one("#bench-graphs", Switch).value,
                         measure_accept=self.query_one("#bench-accept", Switch).value)
        # the truncated draft head as the engine has it (the app's switches when no engine holds any)
        switches = getattr(self.app.engine, "switches", None) or self.app.prefs.switches
        if switches.truncated_draft_head:
            plan.draft_vocab = switches.draft_vocab
        if source == "full":
            plan.layers = number("#bench-layers", "Layers", 1)
        if source == "loaded":
            plan.engine = self.app.engine
            max_context = getattr(plan.engine, "max_context", None)
            if max_context is not None and plan.context + 64 > max_context:
                raise ValueError(f"Context: at most {max_context - 64} with this model's context of {max_context}")
        return plan

    def action_run(self) -> None:
        if self.running:
            self.notify("The bench is already running.", severity="warning")
            return
        try:
            plan = self.make_plan()
        except ValueError as exc:
            self.notify(str(exc), title="Not started", severity="error")
            return
        self.start(plan)

    def start(self, plan: BenchPlan) -> bool:
        busy = self.app.engine_busy()
        if busy:
            self.notify(f"Cannot run the bench now: {busy}.", severity="warning")
            return False
        self.plan = plan
        self.app.bench_running = True
        self._set_running(True)
        self._status("starting…")
        self._run(plan)
        return True

    @work(thread=True, group="bench", exit_on_error=False)
    def _run(self, plan: BenchPlan) -> None:
        def say(step: str, index: int, steps: int) -> None:
            self.post_message(BenchProgress(step, index, steps))

        try:
            result, source = self.app.on_engine_thread(run_plan, plan, say)
        except BenchCancelled:
            self.post_message(BenchDone(cancelled=True))
        except SparkchatError as exc:
            self.post_message(BenchDone(error=str(exc)))
        except Exception as exc:  # show it instead of crashing the app
            self.post_message(BenchDone(error=" ".join(f"{type(exc).__name__}: {exc}".split())))
        else:
            self.post_message(BenchDone(result, source))

    def on_bench_progress(self, message: BenchProgress) -> None:
        if not self.running:
            return
        bar = self.query_one("#bench-progress", ProgressBar)
        bar.update(total=message.steps, progress=message.index - 1)
        bar.display = True
        self._status(f"{message.index} of {message.steps}: {message.step}…")

    def on_bench_done(self, message: BenchDone) -> None:
        plan = self.plan
        self.plan = None
        self.app.bench_running = False
        if plan is not None and plan.engine is not None:
            self.app.apply_switches()  # the user's switches, whatever the bench set meanwhile
        self._set_running(False)
        self.query_one("#bench-progress").display = False
        if message.cancelled:
            self._status("stopped; the table shows the last complete run", error=True)
        elif message.error:
            self._status(f"failed: {message.error}", error=True)
            self.notify(message.error, title="Bench failed", severity="error")
        else:
            self.show_result(message.result, message.source)

    def action_stop(self) -> None:
        if self.plan is not None:
            self.plan.cancel.set()
            self._status("stopping after the current step…")
            self.query_one("#bench-stop", Button).disabled = True
            self.refresh_bindings()

    def action_back(self) -> None:
        self.app.switch_mode("chat")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "bench-run":
            self.action_run()
        elif event.button.id == "bench-stop":
            self.action_stop()

    def _set_running(self, running: bool) -> None:
        self.query_one("#bench-run", Button).disabled = running
        self.query_one("#bench-stop", Button).disabled = not running
        for wid in ("#bench-source", "#bench-layers", "#bench-context", "#bench-iters", "#bench-draft",
                    "#bench-graphs", "#bench-accept"):
            self.query_one(wid).disabled = running
        self.refresh_bindings()

    def _status(self, text: str, *, error: bool = False) -> None:
        status = self.query_one("#bench-status", Static)
        status.update(text)
        status.set_class(error, "-error")

    # -- results -------------------------------------------------------------------------------------

    def show_result(self, result: Any, source: str = "") -> None:
        """Fill the table, the bars and the notes from a BenchResult (None: NVIDIA's figures only)."""
        self.result, self.source = result, source
        rows = list(result.rows) if result is not None else []
        table = self.query_one("#bench-table", DataTable)
        table.clear()
        for i, label in enumerate(CONFIGS):
            row = rows[i] if i < len(rows) else None
            name = label
            if row is not None and "[CUDA graph]" in row.name:
                name += " · graph"
            if i == 3 and row is not None:
                name += f" ×{_drafts(row)}"
            cells = (_cells(row) if row is not None else ["—"] * 6) + [NVIDIA_SPARK_TEXT[i]]
            table.add_row(name, *(Text(c, justify="right") for c in cells), key=str(i))
        measured = self.query_one("#bench-measured", BarChart)
        spark = self.query_one("#bench-spark", BarChart)
        if result is None:
            self._status("ctrl+r runs the four configurations here; until then, NVIDIA's published figures")
            measured.display = False
            spark.show("DGX Spark tok/s · NVIDIA, published (SGLang, batch 1)",
                       [Bar(c, v, t, kind="b") for c, v, t in zip(CONFIGS, NVIDIA_SPARK_TOK_S, NVIDIA_SPARK_TEXT)])
            self.query_one("#bench-notes", Static).update(self._footnote(None))
            return
        self._status(f"{source} · {result.device} · context {result.context} tokens")
        measured.display = True
        measured.show(f"tok/s measured here ({result.device})",
                      [Bar(CONFIGS[i], r.tok_s, f"{r.tok_s:,.1f}", kind="a") for i, r in enumerate(rows[:4])])
        bars = []
        for i, label in enumerate(CONFIGS):
            bars.append(Bar(f"{label} · NVIDIA", NVIDIA_SPARK_TOK_S[i], NVIDIA_SPARK_TEXT[i], kind="b"))
            if i < len(rows):
                value = rows[i].projected_spark_tok_s
                bars.append(Bar(" " * len(label) + " · projected", value, f"{value:,.1f}", kind="c"))
        spark.show("DGX Spark tok/s · NVIDIA published (Ling-3.0-flash-fp4) vs projected for the weights measured "
                   "here (a projection)", bars)
        self.query_one("#bench-notes", Static).update(self._footnote(result))

    def _footnote(self, r: Any) -> str:
        lines = []
        if r is not None:
            if r.verify_decode_ratio is not None:
                how = "measured" if r.accept_length_source == "measured" else "NVIDIA's figure, assumed"
                lines.append(f"verify ÷ decode step {r.verify_decode_ratio:.2f}× "
                             f"(NVIDIA: {NVIDIA_VERIFY_RATIO}×) · draft step {number(r.draft_step_ms)} ms · "
                             f"accept length {r.accept_length:.2f} "
                             f"({how})")
            if r.loop_cycle_ms is not None:
                lines.append(f"the MTP loop as it runs (accept, commit, stream included): "
                             f"{number(r.loop_cycle_ms)} ms a cycle → {number(r.loop_tpot_ms)} ms a token at "
                             f"accept length {r.accept_length:.2f}"
                             + ("" if r.loop_gap_ms is None else
                                f" · verify end → next draft on the GPU {number(r.loop_gap_ms)} ms"))
            if r.decode_loop_ms is not None:
                lines.append(f"the decode loop as it runs, without MTP: {number(r.decode_loop_ms)} ms a token")
            first = ""
            if r.first_step_s is not None:
                first = f" · first fast step {number(r.first_step_s)} s"
                if r.graphs:
                    first += " (compiling, capturing)"
            lines.append(f"read bandwidth {number(r.read_bw_gb_s)} GB/s, measured in this run · CUDA graphs "
                         f"{'on' if r.graphs else 'off'}{first}")
            lines += spark_projection_note(r.to_dict())
        lines.append("NVIDIA: SGLang on the DGX Spark, batch 1, Ling-3.0-flash-fp4; + MTP is 3 draft steps on "
                     "GSM8K at accept length 2.68.")
        return "\n".join(lines)


def _drafts(row: Any) -> str:
    name = row.name
    start = name.find("(")
    return name[start + 1:].split()[0] if start >= 0 else "?"


def number(value: float | None) -> str:
    """Three significant figures or so: 4,820 · 33.1 · 1.58 · 0.021; '—' for None."""
    if value is None:
        return "—"
    size = abs(value)
    if size >= 100:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 0.1:
        return f"{value:.2f}"
    return f"{value:.2g}"


def _cells(row: Any) -> list[str]:
    mb = row.bytes_per_token / 1e6 if row.bytes_per_token else None
    return [number(row.tpot_ms), f"{row.tok_s:,.1f}", number(mb), number(row.gb_s), number(row.pct_read_bw),
            f"{row.projected_spark_tok_s:,.1f}"]

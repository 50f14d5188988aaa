"""Profile one decode step at Ling-3.0-flash-fp4's full shapes (synthetic weights): where the time goes.

    python benchmarks/profile_step.py [--layers N] [--no-compile] [--prefill N | --timeline [--tokens T] [--sequence]
                                      | --draft | --switch NAME | --ab | --knockout
                                      | --loop-switch NAME]

With --prefill N it profiles the prefill of an N-token prompt instead (eager, as the engine runs it);
with --host as well, it profiles the host's Python instead (cProfile): where a short prompt's time
goes when the GPU waits for launches.
With --timeline it traces replays of the graphed decode step and prints, per kernel, its count and
time inside the graph, and how much of the step no kernel was running (the gaps PDL cannot hide);
--sequence lists every kernel in start order as well.
With --draft it does the same for a greedy MTP draft of 3 tokens (one graph), each kernel in order.
With --switch NAME it alternates one environment switch on and off (NAME=VALUE: VALUE and 0; NAME=V1,V2:
each value, then 0; A=1+B=2: both set, then both 0), timing the graphed step each time; given several
times, it does so for each switch in turn (the others as they were), over one model build.
With --ab it times the graphed decode step with programmatic dependent launch (kernels/pdl.py), the
shared expert's side stream (engine/streams.py) and the MoE's bf16x2 products (kernels/mxfp4_moe.py)
all on, each off alone, and all off.
With --knockout it times the graphed step and the 4-token verify with parts of every MoE layer taken
out (the shared expert; the router, replaced by fixed ids) or moved (the shared expert on the main
stream, or joined only after the routed experts), or every KDA layer's last-program tail (the output
norm and the q/k conv state write: its arrival counters start too high for any program to be last):
what each part costs on the step's critical path, with PDL and the side stream hiding what they can.
The outputs are wrong, the times not. --knockout-only KEY,... times some of them (keys: everything,
no-shared, no-router, neither, shared-main, shared-late, no-kda-tail).
With --loop-switch NAME[=VALUE] it alternates one environment switch (VALUE or 1, then 0) in the real
speculative loop (generate_tokens, greedy, 3 drafts, the 32K-row draft head, a 1000-token prompt) and prints the
time a cycle (with --loop-temperature T it samples at T; with --loop-drafts 0 it decodes without MTP,
a step a cycle); with --loop-sampling it alternates greedy and sampled (temperature 0.7) decoding there.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from sparkchat.engine import fastpath
from sparkchat.engine.generate import Decoder
from sparkchat.engine.graphs import StepGraphs
from sparkchat.engine.nn.ops import enable_compile
from sparkchat.engine.state import ConversationState
from sparkchat.engine.synthetic import build_synthetic, synthetic_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--prefill", type=int, default=0, help="profile an N-token prefill instead")
    ap.add_argument("--host", action="store_true", help="--prefill: profile the host's Python (cProfile)")
    ap.add_argument("--timeline", action="store_true", help="per-kernel times inside the graphed step")
    ap.add_argument("--tokens", type=int, default=1, help="--timeline: a verify of this many tokens instead")
    ap.add_argument("--sequence", action="store_true", help="--timeline: every kernel in start order as well")
    ap.add_argument("--draft", action="store_true", help="each kernel of a greedy 3-draft chain (MTP)")
    ap.add_argument("--switch", action="append", default=None,
                    help="time the graphed step with this env switch 1/0 alternated (repeatable)")
    ap.add_argument("--rounds", type=int, default=3, help="--switch: rounds of on, off")
    ap.add_argument("--ab", action="store_true", help="time PDL, the side stream and packed MoE products on and off")
    ap.add_argument("--knockout", action="store_true", help="time the step without the shared expert / router")
    ap.add_argument("--knockout-only", default=None, help="--knockout: these variants only (comma-separated keys)")
    ap.add_argument("--knockout-rounds", type=int, default=2, help="--knockout: rounds over the variants")
    ap.add_argument("--loop-switch", default=None, help="alternate this env switch 1/0 in the real MTP loop")
    ap.add_argument("--loop-sampling", action="store_true", help="the real MTP loop greedy and sampled, alternated")
    ap.add_argument("--loop-temperature", type=float, default=0.0, help="--loop-switch: sample at this temperature")
    ap.add_argument("--loop-rounds", type=int, default=3, help="--loop-switch/--loop-sampling: rounds of on, off")
    ap.add_argument("--loop-drafts", type=int, default=3, help="--loop-switch: drafts a cycle (0: plain decoding)")
    args = ap.parse_args()
    for switch in args.switch or ():  # a bad spec fails now, not after the model is built
        switch_variants(switch)
    if args.compile:
        enable_compile()
    model, state = fast_synthetic(args.layers, max(2048, 2 * args.prefill))
    if args.prefill:
        profile_prefill(model, state, args.prefill, args.host)
        return
    if args.ab:
        compare_overlap(model, state)
        return
    if args.switch:
        for switch in args.switch:
            alternate(model, state, switch, args.rounds)
        return
    if args.knockout:
        knockout(model, state, args.knockout_rounds, args.knockout_only.split(",") if args.knockout_only else None)
        return
    if args.loop_switch:
        alternate_loop(model, state, args.loop_switch, args.loop_rounds, temperature=args.loop_temperature,
                       drafts=args.loop_drafts)
        return
    if args.loop_sampling:
        alternate_loop(model, state, None, args.loop_rounds)
        return
    if args.timeline:
        graph_timeline(model, state, args.tokens, sequence=args.sequence)
        return
    if args.draft:
        draft_timeline(model, state)
        return
    state.token_ids = [0] * 1024
    eager = Decoder(model, state)
    for _ in range(3):
        eager.forward([1])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eager.forward([1])
        torch.cuda.synchronize()
    events = prof.key_averages()
    n_kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    print(f"kernels per decode step: {n_kernels}")
    print(events.table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70))
    print(f"graph decode step: {graph_step_ms(model, state):.3f} ms")


def fast_synthetic(layers: int | None, context: int) -> tuple[torch.nn.Module, ConversationState]:
    """A synthetic Ling-3.0-flash-fp4 (full width; `layers` of them, all when None) on the GPU with every
    kernel installed and the FP8 head, and a conversation state for `context` tokens."""
    cfg = synthetic_config(layers)
    model = build_synthetic(cfg, "cuda", max_context=context)
    model.lm_head.build_fp8()
    model.lm_head.use_fp8 = True
    fastpath.install(model, linears=True, experts=True, head=True)
    return model, ConversationState.allocate(cfg, context, "cuda", torch.bfloat16)


def graph_step_ms(model, state: ConversationState, iters: int = 50, tokens: int = 1) -> float:
    """Mean time of a graphed decode step (a verify of `tokens` when > 1), replayed back to back."""
    state.token_ids = [0] * 1024
    graphed = Decoder(model, state, StepGraphs(model, state))

    def step():
        graphed.forward([1] * tokens, keep_steps=tokens > 1)
        state.token_ids = state.token_ids[:1024]  # every replay at the same context

    for _ in range(3):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _last_replay_kernels(run, replays: int = 5) -> list[dict]:
    """Kernel records (CUPTI traces the kernels inside a graph) of the last of `replays` calls of `run`,
    caches and clocks warm, in start order."""
    import json
    import tempfile

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            run()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    kernels = sorted((e for e in trace["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    return kernels[-(len(kernels) // replays):]


def _print_kernels(kernels: list[dict], label: str, sequence: bool = False) -> None:
    """The records' wall time against the union of busy time, optionally each kernel in start order, and
    per kernel name the calls and summed duration."""
    import collections

    t0, t1 = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
    busy, end = 0.0, t0
    for e in kernels:  # union of [ts, ts + dur) over both streams
        s0, s1 = max(e["ts"], end), e["ts"] + e["dur"]
        if s1 > s0:
            busy += s1 - s0
        end = max(end, s1)
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in kernels:
        by_name[e["name"]].append(e["dur"])
    total = sum(sum(v) for v in by_name.values())
    print(f"kernels per {label}: {len(kernels)}; {t1 - t0:.1f} us, some kernel running {busy:.1f} us, "
          f"idle {t1 - t0 - busy:.1f} us; summed kernel time {total:.1f} us (overlap counted twice)")
    if sequence:
        print(f"{'start us':>8} {'us':>7}  kernel")
        for e in kernels:
            print(f"{e['ts'] - t0:8.1f} {e['dur']:7.2f}  {e['name'][:90]}")
    print(f"{'us':>8} {'calls':>6} {'us/call':>8}  kernel")
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"{sum(durs):8.1f} {len(durs):6d} {sum(durs) / len(durs):8.2f}  {name[:90]}")


def gemv_roles(names: list[str]) -> list[str]:
    """Kernel names in start order -> the same, each fp8_gemv_kernel named by its place in a decoder layer
    (the engine's order): after the add+norm that opens a layer, the attention's input projection; after
    the attention (kda_decode / mla_combine_unfold), its output projection; after the next add+norm, the
    router logits, shared expert gate|up and down in issue order where a route_kernel follows (a MoE
    layer), else the dense MLP's gate|up and down; the step's last GEMV, the head. Either add+norm may be
    missing (done inside the output projection, or the MoE's stage 2: the engine's opt-in fusions)."""
    roles = list(names)
    phase, ffn = "layer", []
    moe = ("gemv router logits", "gemv shared gate|up", "gemv shared down")
    dense = ("gemv mlp gate|up", "gemv mlp down")

    def close_ffn(is_moe: bool) -> None:
        for j, i in enumerate(ffn):
            roles[i] = (moe if is_moe else dense)[min(j, 2 if is_moe else 1)]

    for i, name in enumerate(names):
        if name.startswith("fp8_gemv"):
            if phase in ("ffn", "moe"):
                ffn.append(i)
            elif phase == "attention":
                roles[i], phase = "gemv attention output", "attention out"
            elif phase == "attention out":  # the output projection did its own add+norm: the FFN's first GEMV
                phase, ffn = "ffn", [i]
            else:  # a layer's start (after an add+norm, or a MoE whose stage 2 did the add+norm)
                roles[i] = "gemv attention input"
        elif name.startswith("splitk_add_norm"):
            if phase in ("attention", "attention out"):
                phase, ffn = "ffn", []
            else:
                close_ffn(False) if phase == "ffn" and ffn else None
                phase = "layer"
        elif name.startswith(("kda_decode", "mla_combine_unfold")):
            phase = "attention"
        elif name.startswith("route_kernel") and phase == "ffn":
            phase = "moe"
        elif name.startswith("mxfp4_moe_stage2") and phase == "moe":
            close_ffn(True)
            phase = "moe done"
    last = max((i for i, n in enumerate(names) if n.startswith("fp8_gemv")), default=None)
    if last is not None:
        roles[last] = "gemv head"
    return roles


def exposed_us(spans: list[tuple[float, float, str]]) -> dict[str, tuple[float, int]]:
    """(start, end, label) spans -> per label (exposed us, calls): the step's wall time cut at every
    kernel's end, each slice (an idle gap too) credited to the kernel ending it. The slices sum to the
    wall time; a kernel that overlaps others (PDL, the side stream) is credited only with what it adds
    at its end, an estimate of its share of the critical path."""
    out: dict[str, list] = {}
    done = min(s for s, _, _ in spans)
    for start, end, label in sorted(spans, key=lambda x: x[1]):
        row = out.setdefault(label, [0.0, 0])
        row[0] += max(0.0, end - done)
        row[1] += 1
        done = max(done, end)
    return {k: (v[0], v[1]) for k, v in out.items()}


def graph_timeline(model, state: ConversationState, tokens: int = 1, replays: int = 5,
                   sequence: bool = False) -> None:
    """Per kernel name, the calls and summed duration inside one graphed step, and the step's wall time
    against the union of busy time; with `sequence`, every kernel in start order first."""
    state.token_ids = [0] * 1024
    graphed = Decoder(model, state, StepGraphs(model, state))
    kernels = _last_replay_kernels(lambda: graphed.forward([1] * tokens, keep_steps=tokens > 1), replays)
    _print_kernels(kernels, f"{tokens}-token step", sequence=sequence)
    roles = gemv_roles([e["name"] for e in kernels])
    spans = [(e["ts"], e["ts"] + e["dur"], role[:60]) for e, role in zip(kernels, roles)]
    print("exposed time (the wall cut at each kernel's end, each slice credited to the kernel ending it):")
    print(f"{'us':>8} {'calls':>6} {'us/call':>8}  kernel (GEMVs by their place in the layer)")
    for label, (us, calls) in sorted(exposed_us(spans).items(), key=lambda kv: -kv[1][0]):
        print(f"{us:8.1f} {calls:6d} {us / calls:8.2f}  {label}")


def draft_timeline(model, state: ConversationState, k: int = 3, rows: int = 32768) -> None:
    """Each kernel of one greedy draft (a one-slot catch-up and k-1 more drafts, one graph, the head
    truncated to `rows` rows as the engine runs it) in start order, then per kernel name."""
    from sparkchat.engine.events import SamplingParams

    state.token_ids = [0] * 1024
    model.lm_head.set_draft_rows(list(range(rows)))
    graphed = Decoder(model, state, StepGraphs(model, state))

    def draft():
        state.mtp_length = state.length - 1  # one catch-up slot, as after a verify
        graphed.draft(1, k, SamplingParams(temperature=0.0), None)

    _print_kernels(_last_replay_kernels(draft), f"{k}-draft chain", sequence=True)
    model.lm_head.set_draft_rows(None)


def compare_overlap(model, state: ConversationState) -> None:
    """The graphed step with everything on, then each switch off alone, then all off."""
    import os

    switches = ("SPARKCHAT_PDL", "SPARKCHAT_SIDE_STREAM", "SPARKCHAT_MOE_PACKED")
    for off in ((), *((s,) for s in switches), switches):
        for name in switches:
            os.environ[name] = "0" if name in off else "1"
        fastpath.install(model, linears=True, experts=True, head=True)
        times = [graph_step_ms(model, state) for _ in range(3)]
        label = "all on" if not off else ("all off" if len(off) > 1 else f"{off[0]}=0")
        print(f"{label:<26} graph decode step: {min(times):.3f} ms (3 runs: {', '.join(f'{t:.3f}' for t in times)})",
              flush=True)


def switch_variants(name: str) -> list[list[tuple[str, str]]]:
    """--switch NAME's variants, each a list of (variable, value), the switches-off one last: A=1+B=2
    sets both, then both 0; NAME=VALUE alternates VALUE and 0; NAME=V1,V2 each of them, then 0. Any of
    them followed by |A=x+B=y: that, not 0, is what they are timed against (an old default that is not
    off, e.g.), over the same variables. A variant equal to the off one would time nothing: refused."""
    name, bar, against = name.partition("|")
    variants = _switch_on_off(name)
    if bar:
        base = [(n, v) for n, _, v in (part.partition("=") for part in against.split("+"))]
        if sorted(n for n, _ in base) != sorted(n for n, _ in variants[-1]) or not all(v for _, v in base):
            raise SystemExit(f"--switch {name}|{against}: name every variable of the switch once, with a value")
        order = [n for n, _ in variants[-1]]
        variants[-1] = sorted(base, key=lambda nv: order.index(nv[0]))
    if any(v == variants[-1] for v in variants[:-1]):
        raise SystemExit(f"--switch {name}: a variant is the one it is timed against (the switches-off one, or"
                         " the one after |); name another value")
    return variants


def _switch_on_off(name: str) -> list[list[tuple[str, str]]]:
    """switch_variants without a `|` part: the switches-off one (every variable 0) last."""
    if "+" in name:
        settings = [part.partition("=") for part in name.split("+")]
        variants = [[(n, v or "1") for n, _, v in settings], [(n, "0") for n, _, _ in settings]]
    else:
        n, _, on = name.partition("=")
        variants = [[(n, v)] for v in (*(on or "1").split(","), "0")]
    return variants


def alternate(model, state: ConversationState, name: str, rounds: int = 3) -> None:
    """The graphed step with one switch on, off, on, off...: a change's effect without machine drift.
    Each variant also answers one fixed step and verify, from the same state, and its logits are
    compared with the last variant's (the switches off): a variant that is fast because it is wrong
    (a race, a missing wait) shows as a far or non-finite answer beside its time."""
    import os
    import statistics

    variants = switch_variants(name)
    before = {n: os.environ.get(n) for n, _ in variants[0]}
    labels = ["+".join(f"{n}={v}" for n, v in variant) for variant in variants]
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in labels}
    answers: dict[str, list] = {}
    # an untimed pass first: the first timing in a process read 0.03-0.04 ms low on the H100 (2.363 / 2.373
    # against 2.40-2.41 after it; docs/benchmarks.md session 37), which favoured whichever variant ran first
    os.environ.update(dict(variants[0]))
    fastpath.install(model, linears=True, experts=True, head=True)
    graph_step_ms(model, state), graph_step_ms(model, state, tokens=4)
    for r in range(rounds):
        for variant, label in zip(variants, labels):
            os.environ.update(dict(variant))
            fastpath.install(model, linears=True, experts=True, head=True)
            step, verify = graph_step_ms(model, state), graph_step_ms(model, state, tokens=4)
            if r == 0:  # after the replays: the first variant's saves states those steps moved off zero
                answers[label] = [step_logits(model, state, tokens) for tokens in (1, 4)]
            times[label].append((step, verify))
            print(f"{label}  graph decode step: {step:.3f} ms, verify of 4: {verify:.3f} ms", flush=True)
    print(f"{name}: medians of {rounds} rounds; logits against {labels[-1]}")
    for label in labels:
        steps, verifies = zip(*times[label])
        checks = ", ".join(logits_agreement(a, b) for a, b in zip(answers[label], answers[labels[-1]]))
        print(f"  {label}: step {statistics.median(steps):.3f} ms, verify {statistics.median(verifies):.3f} ms;"
              f" {checks}", flush=True)
    for n, value in before.items():  # the next switch is timed with these as they were
        if value is None:
            os.environ.pop(n)
        else:
            os.environ[n] = value
    fastpath.install(model, linears=True, experts=True, head=True)


_STARTS: dict[int, object] = {}  # id(state) -> its StateCheckpoint at step_logits' first call


def step_logits(model, state: ConversationState, tokens: int = 1) -> torch.Tensor:
    """The graphed step's logits (a verify's when tokens > 1, fp32 [T, V]) at context 1024 from the
    state saved at the first call for this state (restored before and after), so that every variant
    answers the same question."""
    state.token_ids = [0] * 1024
    start = _STARTS.setdefault(id(state), state.checkpoint())
    state.restore(start)
    graphed = Decoder(model, state, StepGraphs(model, state))
    _, logits, _ = graphed.forward(list(range(1, tokens + 1)), keep_steps=tokens > 1)
    out = logits.float().clone()
    state.restore(start)
    return out


def logits_agreement(a: torch.Tensor, b: torch.Tensor) -> str:
    """How far logits a [T, V] are from b: the largest difference a row as a share of b's row scale,
    the rows with the same argmax, and whether a is finite. bf16 paths summing in another order land
    within a few percent on synthetic weights (a flipped near-tie routing choice moves a row further);
    a broken kernel lands at ~100% or non-finite."""
    T = a.shape[0]
    if not bool(torch.isfinite(a).all()):
        return f"{T} tokens: NOT FINITE"
    rel = ((a - b).abs().amax(-1) / b.abs().amax(-1).clamp_min(1e-30)).max().item()
    same = int((a.argmax(-1) == b.argmax(-1)).sum())
    return f"{T} tokens: max diff {100 * rel:.1f}% of scale, argmax {same}/{T}"


KNOCKOUTS = {  # key: (label, shared expert "on" / "off" / "main" stream / "late" join, router on, KDA tail on)
    "everything": ("everything", "on", True, True),
    "no-shared": ("no shared expert", "off", True, True),
    "no-router": ("fixed routing (no router)", "on", False, True),
    "neither": ("neither", "off", False, True),
    "shared-main": ("shared expert on the main stream", "main", True, True),
    "shared-late": ("shared expert joined late", "late", True, True),
    "no-kda-tail": ("no KDA last-program tail", "on", True, False),
}


def knockout(model, state: ConversationState, rounds: int = 2, only: list[str] | None = None) -> None:
    """The graphed step and verify with every MoE layer's shared expert and/or router taken out, or every
    KDA layer's last-program tail (`only`: those KNOCKOUTS keys)."""
    import types

    from sparkchat.engine.kernels.counters import arrival_counters
    from sparkchat.engine.nn.moe import MoE
    from sparkchat.engine.nn.ops import ops
    from sparkchat.engine.streams import fork

    layers = [(m, m.shared_experts, m.side_stream) for m in model.modules() if isinstance(m, MoE)]
    cfg, real_route = model.cfg, ops.route
    gen = torch.Generator().manual_seed(0)
    fixed = {}  # distinct experts per token, as random routing picks them; built before any capture
    for T in (1, 4):
        ids = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[:cfg.num_experts_per_tok] for _ in range(T)])
        fixed[T] = (ids.cuda(), torch.full(ids.shape, 1.0 / ids.shape[1], device="cuda"))

    def fixed_route(x, *args, **kwargs):
        return fixed[x.shape[0]]

    def late_join(self, x, add_norm=None):  # the shared expert joined after the routed experts, its output unused
        shared, join = fork(self.side_stream, self.shared_experts, x)
        ids, weights = self.gate(x)
        out = self.fast_experts(x, ids, weights)
        join()
        return out if add_norm is None else add_norm[1].add_norm(add_norm[0], out)

    unknown = set(only or ()) - set(KNOCKOUTS)
    if unknown:
        raise SystemExit(f"--knockout-only: unknown {sorted(unknown)} (keys: {', '.join(KNOCKOUTS)})")
    # the KDA kernel's per-head arrival counters (kernels/counters.py): far above any count a launch reaches,
    # no program is the head's last, so none normalizes o or writes the q/k conv state
    kda_counters = arrival_counters("kda_decode", torch.device("cuda"), cfg.num_attention_heads)
    for _ in range(rounds):
        for key in only or KNOCKOUTS:
            label, how, router, kda_tail = KNOCKOUTS[key]
            for m, shared, side in layers:
                m.shared_experts, m.side_stream = {"off": (None, None), "main": (shared, None)}.get(how, (shared, side))
                m.forward = types.MethodType(late_join, m) if how == "late" else types.MethodType(MoE.forward, m)
            ops.route = real_route if router else fixed_route
            kda_counters.fill_(0 if kda_tail else 1 << 24)
            print(f"{label:<34} graph decode step: {graph_step_ms(model, state):.3f} ms, "
                  f"verify of 4: {graph_step_ms(model, state, tokens=4):.3f} ms", flush=True)
    for m, shared, side in layers:
        m.shared_experts, m.side_stream = shared, side
        del m.forward
    ops.route = real_route
    kda_counters.fill_(0)


def alternate_loop(model, state: ConversationState, name: str | None, rounds: int = 3, rows: int = 32768,
                   temperature: float = 0.0, drafts: int = 3) -> None:
    """The real speculative loop (bench's loop line, more tokens) with one switch on, off, on, off... (NAME or
    NAME=VALUE: VALUE, then 0), greedy or sampled at `temperature`, `drafts` a cycle (0: plain decoding,
    a step a cycle); name None: greedy, then sampled at temperature 0.7."""
    import os

    from sparkchat.engine.bench import _loop_cycle

    model.lm_head.set_draft_rows(list(range(rows)))
    name, _, on = (name or "").partition("=")  # NAME=VALUE alternates VALUE and 0
    name = name or None
    for _ in range(rounds):
        for value in (on or "1", "0"):
            if name is None:
                label, temperature = ("greedy", 0.0) if value == "1" else ("sampled, temperature 0.7", 0.7)
            else:
                os.environ[name] = value
                label = f"{name}={value}" + (f" (temperature {temperature})" if temperature else "")
            cycle, per_cycle, gap = _loop_cycle(model, state, 1000, drafts, True, tokens=160, temperature=temperature)
            print(f"{label}  MTP loop: {1000 * cycle:.3f} ms a cycle, {per_cycle:.2f} tokens a cycle, "
                  f"{1000 * gap:.3f} ms of it between a verify's end and the next draft's start", flush=True)
    model.lm_head.set_draft_rows(None)


def profile_prefill(model, state: ConversationState, n: int, host: bool = False) -> None:
    import time

    dec = Decoder(model, state)
    prompt = [(7 * i) % 1000 + 5 for i in range(n)]
    for warm in (prompt[:64], prompt):  # compilation and lazy initialisation, at this length too
        dec.forward(warm, last_logits=True)
        state.reset()
    torch.cuda.synchronize()
    if host:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        dec.forward(prompt, last_logits=True)[1].argmax()
        torch.cuda.synchronize()
        prof.disable()
        print(f"prefill of {n} tokens: {1000 * (time.perf_counter() - t0):.1f} ms under cProfile")
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(45)
        return
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dec.forward(prompt, last_logits=True)  # as generate_tokens runs a prompt
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    n_kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    print(f"prefill of {n} tokens: {wall:.2f} s under the profiler ({1000 * wall / n:.3f} ms per token), "
          f"{n_kernels} kernels")
    print(events.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    print(events.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()

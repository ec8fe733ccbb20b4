#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine (venv, CPU torch, specmesh, redis-server),
# then runs lint, type checks and the whole test suite.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup-env.sh
source scripts/install-redis.sh
ruff check .
ruff format --check .
mypy
python -m pytest "$@"

#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine, then runs lint, type checks and the tests.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup-env.sh
ruff check .
ruff format --check .
mypy
python -m pytest "$@"

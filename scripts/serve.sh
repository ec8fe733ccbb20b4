#!/usr/bin/env bash
# Sets up a fresh machine (venv, torch, specmesh, redis-server) and serves the shipped reference
# model: gateway, scheduler, suffix cache, worker and Redis, all started by `specmesh serve`.
#   bash scripts/serve.sh [specmesh serve args...]      e.g. --port 8000 --pd
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup-env.sh
source scripts/install-redis.sh
exec specmesh serve "$@"

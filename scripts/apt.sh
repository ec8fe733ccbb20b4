# Sourced by the scripts that install system packages: `apt_get ARGS...` runs apt-get and, while
# another process holds the dpkg / apt lock (unattended-upgrades on a fresh machine, another
# install), waits and retries instead of failing, for up to APT_LOCK_TIMEOUT_S (600) seconds.
APT_LOCK_TIMEOUT_S="${APT_LOCK_TIMEOUT_S:-600}"
APT_RETRY_SLEEP_S="${APT_RETRY_SLEEP_S:-10}"
APT_LOCK_MESSAGE="could not get lock|unable to acquire the dpkg|unable to lock|is another process using it"

apt_get() {
    local deadline=$((SECONDS + APT_LOCK_TIMEOUT_S)) output status
    while true; do
        # DPkg::Lock::Timeout makes apt itself wait for the dpkg lock (apt 1.9.11 and later)
        output="$(DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=60 "$@" 2>&1)" && return 0
        status=$?
        if ! grep -qiE "$APT_LOCK_MESSAGE" <<<"$output"; then
            printf '%s\n' "$output" >&2
            return "$status"
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            printf '%s\n' "$output" >&2
            echo "apt-get: the dpkg lock was still held after ${APT_LOCK_TIMEOUT_S} s; giving up" >&2
            return "$status"
        fi
        echo "apt-get: another process holds the dpkg lock; retrying in ${APT_RETRY_SLEEP_S} s" >&2
        sleep "$APT_RETRY_SLEEP_S"
    done
}

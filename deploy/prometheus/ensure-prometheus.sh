#!/bin/sh
# Make sure `promtool` and `prometheus` are on PATH for the tests (tests/deploy).
# They come from Debian's `prometheus` package: a no-op when already there, an apt
# install when we are root on a Debian-like machine, else one clear line and exit 1.
set -eu

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    exit 0
fi

if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's prometheus package (promtool + prometheus) for the tests" >&2
    export DEBIAN_FRONTEND=noninteractive
    # The package index may be missing or stale on a fresh machine.
    apt-get update -qq >/dev/null || true
    # policy-rc.d keeps the package's own service from starting (no daemon needed).
    had_policy=0
    if [ -e /usr/sbin/policy-rc.d ]; then had_policy=1; fi
    if [ "$had_policy" = 0 ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    fi
    status=0
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null || status=$?
    if [ "$had_policy" = 0 ]; then rm -f /usr/sbin/policy-rc.d; fi
    if [ "$status" = 0 ] && command -v promtool >/dev/null 2>&1; then
        exit 0
    fi
    echo "error: 'apt-get install prometheus' failed (exit $status); install Debian's prometheus package by hand" >&2
    exit 1
fi

echo "error: promtool/prometheus not found; install them (Debian: 'sudo apt-get install --no-install-recommends prometheus', or a release from prometheus.io) and put them on PATH" >&2
exit 1

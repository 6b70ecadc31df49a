#!/bin/sh
# Make sure libfaketime is installed for the tests (tests/agent/test_health_faults.py: a node
# whose clock is an hour off). A no-op when it is there, an apt install when we are root on a
# Debian-like machine, else one clear line and exit 1 (as deploy/prometheus/ensure-prometheus.sh).
set -eu

LIB=/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1
if [ -e "$LIB" ] || [ "$(uname -m)" != "x86_64" ]; then
    exit 0  # another architecture: the test says it is skipped, and why
fi

if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's libfaketime package for the tests" >&2
    export DEBIAN_FRONTEND=noninteractive
    status=0
    apt-get install -y -qq --no-install-recommends libfaketime >/dev/null 2>&1 || status=$?
    if [ "$status" != 0 ]; then  # the package index may be missing or stale on a fresh machine
        apt-get update -qq >/dev/null || true
        status=0
        apt-get install -y -qq --no-install-recommends libfaketime >/dev/null || status=$?
    fi
    if [ "$status" = 0 ] && [ -e "$LIB" ]; then
        exit 0
    fi
    echo "error: 'apt-get install libfaketime' failed (exit $status); install Debian's libfaketime package by hand" >&2
    exit 1
fi

echo "error: libfaketime not found at $LIB; install it (Debian: 'sudo apt-get install --no-install-recommends libfaketime')" >&2
exit 1

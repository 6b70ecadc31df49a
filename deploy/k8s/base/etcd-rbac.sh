#!/bin/sh
# etcd RBAC for elastic training, idempotent: safe to run again, before or after auth is on.
#
# Users authenticate by client certificate: with --client-cert-auth, etcd takes a
# certificate's CN as the user name, so these users have no password at all.
#   root     every right; only this bootstrap holds its certificate
#   trainer  role `trainer`: readwrite on $RBAC_PREFIX only (the agents)
#   monitor  role `monitor`: read on $RBAC_PREFIX only (`elastic sd`, `elastic top`)
#
# etcdctl reads its connection from the environment:
#   ETCDCTL_ENDPOINTS  https://etcd-0.etcd:2379,...
#   ETCDCTL_CACERT, ETCDCTL_CERT, ETCDCTL_KEY   root's client certificate (CN=root)
# RBAC_PREFIX (default /elastic/) must match the agents' --rdzv-conf key_prefix plus "/";
# give each team its own prefix and role.
set -eu
prefix=${RBAC_PREFIX:-/elastic/}
case $prefix in /*/) ;; *) echo "RBAC_PREFIX must start and end with '/', e.g. /elastic/" >&2; exit 2 ;; esac

tries=0
until etcdctl endpoint health >/dev/null 2>&1; do
  tries=$((tries + 1))
  [ "$tries" -lt 90 ] || { echo "etcd at $ETCDCTL_ENDPOINTS not healthy after 180 s" >&2; exit 1; }
  sleep 2
done

ensure_user() {  # name
  etcdctl user get "$1" >/dev/null 2>&1 || etcdctl user add "$1" --no-password
}
ensure_role() {  # name permission
  etcdctl role get "$1" >/dev/null 2>&1 || etcdctl role add "$1"
  etcdctl role grant-permission "$1" --prefix=true "$2" "$prefix"
}

ensure_user root
etcdctl user grant-role root root
ensure_role trainer readwrite
ensure_user trainer
etcdctl user grant-role trainer trainer
ensure_role monitor read
ensure_user monitor
etcdctl user grant-role monitor monitor

if etcdctl auth status 2>/dev/null | grep -q 'Authentication Status: true'; then
  echo "etcd auth already enabled; roles brought up to date"
else
  etcdctl auth enable
fi
etcdctl role get trainer

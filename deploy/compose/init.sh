#!/usr/bin/env bash
# Make what docker-compose.yml mounts as secrets, once, before `docker compose up`:
#   deploy/compose/init.sh [OUT_DIR]      (default: deploy/compose/secrets, gitignored)
#
# - a throwaway CA with etcd's server certificate and client certificates for root (the
#   RBAC bootstrap), trainer (the agents: etcd role limited to /elastic/) and monitor
#   (`elastic sd`: read-only), made by deploy/certs/make-certs.sh;
# - job.key, the job's HMAC key that signs the rendezvous state;
# - grafana-admin, Grafana's admin password.
# Running it again keeps the CA, the job key and the password; certificates are issued anew.
#
# This is for a rehearsal on one host. The files are made readable by the containers'
# unprivileged users (compose bind-mounts file secrets with the host's owner and mode);
# keep OUT_DIR private to you. Real clusters: docs/deploy.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/secrets}
mkdir -p "$out"
"$here/../certs/make-certs.sh" "$out" etcd --client root --client trainer --client monitor >/dev/null
( umask 077
  [ -s "$out/job.key" ] || head -c 32 /dev/urandom | base64 > "$out/job.key"
  [ -s "$out/grafana-admin" ] || head -c 18 /dev/urandom | base64 > "$out/grafana-admin" )
chmod 0700 "$out"
chmod 0644 "$out"/*.pem "$out/job.key" "$out/grafana-admin"
chmod 0600 "$out/ca-key.pem"
echo "wrote etcd certificates, the job key and Grafana's admin password to $out"
echo "Grafana: http://127.0.0.1:3000  user admin, password in $out/grafana-admin"

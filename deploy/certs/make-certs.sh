#!/usr/bin/env bash
# Make a throwaway CA plus etcd server/peer and client certificates, for trying TLS
# without a PKI. Production should use certificates from your own CA.
#
#   deploy/certs/make-certs.sh OUT_DIR HOST [HOST...] [--client NAME]...
#
# HOSTs (names or IPs) go into the server and peer certificates' SANs; localhost and
# 127.0.0.1 are always added. Each --client NAME makes NAME.pem/NAME-key.pem with CN=NAME
# (etcd maps a client certificate's CN to an etcd user when client-cert auth is on).
# Default client: "trainer". Keys are 0600; the CA key stays in OUT_DIR: keep it safe.
set -euo pipefail

usage() { echo "usage: $0 OUT_DIR HOST [HOST...] [--client NAME]..." >&2; exit 2; }
[ $# -ge 2 ] || usage
command -v openssl >/dev/null || { echo "error: openssl not found; install it (apt-get install openssl)" >&2; exit 1; }

out=$1; shift
hosts=(); clients=()
while [ $# -gt 0 ]; do
  case $1 in
    --client) [ $# -ge 2 ] || usage; clients+=("$2"); shift 2 ;;
    -*) usage ;;
    *) hosts+=("$1"); shift ;;
  esac
done
[ ${#hosts[@]} -gt 0 ] || usage
[ ${#clients[@]} -gt 0 ] || clients=(trainer)

mkdir -p "$out"; cd "$out"
umask 077
days=${CERT_DAYS:-365}

san="DNS:localhost,IP:127.0.0.1"
for h in "${hosts[@]}"; do
  if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then san="$san,IP:$h"; else san="$san,DNS:$h"; fi
done

if [ ! -f ca.pem ]; then
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca-key.pem -out ca.pem -days "$days" \
    -subj "/CN=elastic-trainer test CA" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

issue() {  # name cn usage san
  local name=$1 cn=$2 usage=$3 names=$4 ext
  ext=$(mktemp)
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$usage"
    [ -n "$names" ] && echo "subjectAltName=$names"
  } > "$ext"
  openssl req -newkey rsa:2048 -nodes -keyout "$name-key.pem" -out "$name.csr" -subj "/CN=$cn" 2>/dev/null
  openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial \
    -out "$name.pem" -days "$days" -extfile "$ext" 2>/dev/null
  rm -f "$name.csr" "$ext"
}

# Server certs also carry clientAuth so etcd (and health probes) may present them as clients.
issue server etcd-server "serverAuth,clientAuth" "$san"
issue peer etcd-peer "serverAuth,clientAuth" "$san"
for c in "${clients[@]}"; do issue "$c" "$c" "clientAuth" ""; done
chmod 0644 ca.pem server.pem peer.pem "${clients[@]/%/.pem}"
echo "wrote CA, server, peer and client (${clients[*]}) certificates to $(pwd)"

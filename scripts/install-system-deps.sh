#!/usr/bin/env bash
# System packages the test suite needs: systemd (systemd-analyze verify of the units) and
# prometheus (promtool checks and a real Prometheus server in an integration test) and
# etcd-server (etcd 3.4: the replicated state store of several dispatchers, run by the tests),
# openssl (test certificates for gRPC over TLS), iproute2 and util-linux (ip, unshare, nsenter: the
# bind tests run daemons in private network namespaces), nftables (nft: the partition tests drop
# frames between emulated hosts, bench/emulated_link.py), python3-pyverbs (rdma-core's verbs
# bindings: the rdma transport loads it from /usr/lib/python3/dist-packages into the virtualenv,
# lazily, when the Python minor versions match; see services/transport/rdma_verbs.py).
# Installs only what is missing; needs root (CI and the dev machines run as root).
set -euo pipefail
missing=()
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
{ command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; } || missing+=(prometheus)
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v nft >/dev/null 2>&1 || missing+=(nftables)
{ command -v unshare >/dev/null 2>&1 && command -v nsenter >/dev/null 2>&1; } || missing+=(util-linux)
[ -f /usr/lib/python3/dist-packages/pyverbs/__init__.py ] || missing+=(python3-pyverbs)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "install-system-deps: need root to install: ${missing[*]} (or install them yourself)" >&2
  exit 1
fi
echo "install-system-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null

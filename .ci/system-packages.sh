#!/usr/bin/env bash
# Installs the Debian packages the tests use, only when missing.
set -euo pipefail
need=()
command -v promtool >/dev/null || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null || command -v alertmanager >/dev/null || need+=(prometheus-alertmanager)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ]; then
  echo "missing ${need[*]}: install them with 'sudo apt-get install ${need[*]}' (tests that need them will fail)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The packages start services; the tests start their own on loopback ports.
systemctl disable --now prometheus prometheus-node-exporter prometheus-alertmanager >/dev/null 2>&1 || true
pkill -x prometheus >/dev/null 2>&1 || true
pkill -f prometheus-node-exporter >/dev/null 2>&1 || true
pkill -f prometheus-alertmanager >/dev/null 2>&1 || true

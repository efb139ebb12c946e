#!/usr/bin/env bash
# Installs Debian's chromium (headless browser for the dashboard screenshot test) when
# /usr/bin/chromium is missing. Idempotent; needs root (apt-get).
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
  exit 0
fi
echo "[install_browser] chromium not found: apt-get install chromium"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
/usr/bin/chromium --version

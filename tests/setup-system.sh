#!/usr/bin/env bash
# System packages some tests need: a real single-node Slurm (slurm-wlm, munge) for tests/slurm,
# Debian's Chromium for the dashboard browser test, tmux for `gpuswap top`'s live view.
# pytest never installs anything: without these, those tests skip and say which tool is missing.
# Run once as root (CI's .ci/run does): tests/setup-system.sh
set -euo pipefail
PACKAGES=(slurm-wlm munge chromium tmux)

missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "setup-system: ${PACKAGES[*]} already installed"
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "setup-system: missing ${missing[*]}; install them as root with apt-get (or your system's equivalent)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
echo "setup-system: apt-get install ${missing[*]}"
apt-get install -y --no-install-recommends "${missing[@]}" \
    || { apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"; }

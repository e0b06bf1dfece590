#!/usr/bin/env bash
# Tools the deployment tests need that the Python venv cannot provide, installed from Debian when missing:
#   docker-compose   validates compose.yaml (`docker-compose config`: the Compose spec schema; no engine needed)
#   ShellCheck       lints scripts/*.sh (package shellcheck)
#   systemd          systemd-analyze verify for deploy/systemd/*.service
#   iproute2         ip netns / veth for the multi-host test
#   chromium         the admin pages' browser tests (Playwright drives /usr/bin/chromium; no browser download)
#   g++              the engine's fused CPU decode attention (services/engine/kernels/cpu_attention.py)
# Idempotent: installs only what is absent. Without root (or password-less sudo) or apt-get it prints what
# is missing and exits 0; the tests then skip locally, and fail under LLMGW_CI=1 (set by .ci/run).
set -euo pipefail

declare -A PACKAGE=([docker-compose]=docker-compose [shellcheck]=shellcheck [systemd-analyze]=systemd [ip]=iproute2 [chromium]=chromium [g++]=g++)
missing=()
for tool in "${!PACKAGE[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("${PACKAGE[$tool]}")
done
[[ ${#missing[@]} -gt 0 ]] || exit 0

if [[ $EUID -eq 0 ]]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  echo "install-test-tools: missing ${missing[*]}; run this script as root to install them" >&2
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-test-tools: missing ${missing[*]} and no apt-get here: install them by hand" >&2
  exit 0
fi
echo "install-test-tools: apt-get install ${missing[*]}"
apt_install() {
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    -o DPkg::Lock::Timeout=600 "${missing[@]}"
}
apt_install || { "${sudo[@]}" apt-get update -q -o DPkg::Lock::Timeout=600 && apt_install; }

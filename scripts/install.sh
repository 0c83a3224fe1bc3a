#!/usr/bin/env bash
# Creates a virtual environment and installs pdserve with its test extra.
# Used by the README, .ci/run and the Dockerfile, so all three install the same way.
# Usage: scripts/install.sh [VENV_DIR]   (default .venv)
set -euo pipefail
venv="${1:-.venv}"
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
"$python" -m venv "$venv"
# torch first and pinned: on these machines 2.13.0 is a CPU build from local disk;
# an unpinned torch would pull a multi-GB CUDA build.
"$venv/bin/pip" install --quiet "torch==${TORCH_VERSION:-2.13.0}"
"$venv/bin/pip" install --quiet -e "$here[test]"
# Debian's headless chromium for the dashboard's browser test, where this machine can install it
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi

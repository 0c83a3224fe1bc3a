#!/usr/bin/env bash
# Creates a virtual environment and installs pdserve into it: what serving needs (`pip install pdserve`,
# no extras), or with --test also the test extra and, where this machine can install it, Debian's
# headless chromium for the dashboard's browser test.
# The README's run command and the Dockerfiles install for serving; the README's test command (which
# .ci/run runs verbatim) installs with --test.
# Usage: scripts/install.sh [--test] [VENV_DIR]   (default .venv)
set -euo pipefail
test_extra=0
if [ "${1:-}" = "--test" ]; then
  test_extra=1
  shift
fi
venv="${1:-.venv}"
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
"$python" -m venv "$venv"
# torch first and pinned: on these machines 2.13.0 is a CPU build from local disk;
# an unpinned torch would pull a multi-GB CUDA build.
"$venv/bin/pip" install --quiet "torch==${TORCH_VERSION:-2.13.0}"
if [ "$test_extra" = 1 ]; then
  "$venv/bin/pip" install --quiet -e "$here[test]"
  # Debian's headless chromium for the dashboard's browser test, where this machine can install it
  if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  fi
else
  "$venv/bin/pip" install --quiet -e "$here"
fi

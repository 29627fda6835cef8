#!/usr/bin/env bash
# Set up (or reuse) the virtualenv at .venv/ and run the demo or the test suite.
#   ./dev.sh demo [ARGS...]   the main job on a generated default workload
#   ./dev.sh test [ARGS...]   the whole test suite (what CI runs)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PYTHON=${PYTHON:-python3}
stamp=.venv/.hicache-setup

setup() {
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  # Reinstall only when the dependency files changed since the last setup.
  want=$(cat pyproject.toml requirements-dev.txt | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setting up .venv (first run: a few minutes; log in .venv/setup.log)" >&2
    if ! .venv/bin/python -m pip install -r requirements-dev.txt > .venv/setup.log 2>&1; then
      tail -n 40 .venv/setup.log >&2
      echo "setup failed; the full log is .venv/setup.log" >&2
      exit 1
    fi
    echo "$want" > "$stamp"
  fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    setup
    exec .venv/bin/hicache demo "$@"
    ;;
  test)
    setup
    .venv/bin/ruff check .
    exec .venv/bin/pytest "$@"
    ;;
  *)
    echo "usage: ./dev.sh demo|test [ARGS...]" >&2
    exit 2
    ;;
esac

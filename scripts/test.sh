#!/usr/bin/env bash
# The test command: sets up .venv, then lint, type-check and the whole test suite.
source "$(dirname "$0")/_setup.sh" dev
set -x
ruff check aiokv tests
ruff format --check aiokv tests
mypy --strict aiokv
lint-imports
python -m pytest -q "$@"

#!/usr/bin/env bash
# The floors check: build aiokv's wheel, install it with the declared MINIMUM versions of
# its dependencies (scripts/floors.txt) into a throwaway venv under /tmp, and run the smoke
# subset against that install. torch==2.13.0 goes in first (the CPU wheel): the torch
# floor (2.8, for torch.accelerator / torch.Stream / torch.Event) cannot be installed here
# without pulling a CUDA build. About 85 s with pip's cache warm (the install ~60 s of
# it); .ci/run runs it.
# AIOKV_FLOORS_VENV=DIR (.ci/run sets it): the venv goes there and is kept (the caller
# removes it), installed once: `floors.sh --install` only installs it (scripts/test.sh
# does so in the background, beside its other set-ups), a later `floors.sh` runs the checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -n "${AIOKV_FLOORS_VENV:-}" ]; then
  VENV=$AIOKV_FLOORS_VENV
else
  VENV=$(mktemp -d /tmp/aiokv-floors.XXXXXX)
  trap 'rm -rf "$VENV"' EXIT
fi
stamp=$VENV/.aiokv-floors-installed
if [ ! -f "$stamp" ]; then
  "$PY" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --upgrade pip
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" -c scripts/floors.txt ".[cli,testing]" "pytest-timeout>=2.3"
  touch "$stamp"
fi
if [ "${1:-}" = --install ]; then
  exit 0
fi
"$VENV/bin/python" -m pip list --disable-pip-version-check 2>/dev/null |
  grep -iE '^(torch|pydantic|pydantic.settings|anyio|sniffio|msgspec|numpy|sortedcontainers|typer|click|rich|pytest|pytest.asyncio) '
# the installed wheel, not this checkout: run from a directory without aiokv/ in it
"$VENV/bin/python" -W error -c "import aiokv, aiokv.sync, aiokv.testing; print('import aiokv: clean,', aiokv.__version__)"
"$VENV/bin/aiokv" --version
"$VENV/bin/aiokv" --help >/dev/null
run=$VENV/run
rm -rf "$run"
mkdir -p "$run/scripts"
cp -r tests "$run/tests"
cp pyproject.toml "$run/"
cp scripts/floors.txt "$run/scripts/"
cd "$run"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -x \
  tests/test_packaging.py tests/test_testing_plugin.py tests/test_config_env.py \
  tests/compat/test_config.py tests/test_models.py tests/test_cli.py \
  "tests/remote/test_remote.py::test_pull_blocks_exact"

#!/usr/bin/env bash
# The floors check: build aiokv's wheel, install it with the declared MINIMUM versions of
# its dependencies (scripts/floors.txt) into a throwaway venv under /tmp, and run the smoke
# subset against that install. torch==2.13.0 goes in first (the CPU wheel): the torch
# floor (2.8, for torch.accelerator / torch.Stream / torch.Event) cannot be installed here
# without pulling a CUDA build. About 85 s with pip's cache warm; .ci/run runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=$(mktemp -d /tmp/aiokv-floors.XXXXXX)
trap 'rm -rf "$VENV"' EXIT
"$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -c scripts/floors.txt ".[cli,testing]" "pytest-timeout>=2.3"
"$VENV/bin/python" -m pip list --disable-pip-version-check 2>/dev/null |
  grep -iE '^(torch|pydantic|pydantic.settings|anyio|sniffio|msgspec|numpy|sortedcontainers|typer|click|rich|pytest|pytest.asyncio) '
# the installed wheel, not this checkout: run from a directory without aiokv/ in it
"$VENV/bin/python" -W error -c "import aiokv, aiokv.sync, aiokv.testing; print('import aiokv: clean,', aiokv.__version__)"
"$VENV/bin/aiokv" --version
"$VENV/bin/aiokv" --help >/dev/null
cp -r tests "$VENV/tests"
cp pyproject.toml "$VENV/"
mkdir "$VENV/scripts" && cp scripts/floors.txt "$VENV/scripts/"
cd "$VENV"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -x \
  tests/test_packaging.py tests/test_testing_plugin.py tests/test_config_env.py \
  tests/compat/test_config.py tests/test_models.py tests/test_cli.py \
  "tests/remote/test_remote.py::test_pull_blocks_exact"

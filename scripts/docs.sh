#!/usr/bin/env bash
# The documentation site (mkdocs.yml, docs/): sets up .venv with the `docs` extra, then
#   bash scripts/docs.sh serve   # http://127.0.0.1:8000, rebuilt on every change (the default)
#   bash scripts/docs.sh build   # site/, strict: a broken link or anchor fails
source "$(dirname "$0")/_setup.sh" docs
export NO_MKDOCS_2_WARNING=1  # mkdocs-material's end-of-life banner
case "${1:-serve}" in
  serve) shift || true; exec mkdocs serve "$@" ;;
  build) shift; exec mkdocs build --strict "$@" ;;
  *) echo "usage: bash scripts/docs.sh [serve|build] [mkdocs options]" >&2; exit 2 ;;
esac

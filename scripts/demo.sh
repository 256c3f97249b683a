#!/usr/bin/env bash
# The demo: sets up .venv, then runs `aiokv demo`.
source "$(dirname "$0")/_setup.sh" cli,uvloop
exec aiokv demo "$@"

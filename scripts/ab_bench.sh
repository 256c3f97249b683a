#!/bin/bash
# Two versions of aiokv, one sitting: `aiokv bench latency`, `layerwise` and
# `transfer --backend nixl` on each, alternating (before, after, before, ...), ROUNDS
# rounds; the JSON of each run lands in OUT as <bench>-<before|after>-<round>.json, and
# scripts/ab_compare.py prints the median (min-max) of each ratio and after/before.
# Usage: scripts/ab_bench.sh BEFORE_CHECKOUT AFTER_CHECKOUT OUT [ROUNDS]
# e.g.   git worktree add --detach /tmp/before 4aaf3c6; git worktree add --detach /tmp/after main
#        scripts/ab_bench.sh /tmp/before /tmp/after /tmp/ab 3 && python scripts/ab_compare.py /tmp/ab
# Both run with this checkout's .venv (nixl installed: scripts/_setup.sh dev).
set -u
before=$(realpath "$1"); after=$(realpath "$2"); out=$(realpath -m "$3"); rounds=${4:-3}
py=$(realpath -s "$(dirname "$0")/../.venv/bin/python")  # -s: the venv's link, not the interpreter it names
mkdir -p "$out"
for round in $(seq "$rounds"); do
  for side in before after; do
    dir=$before; [ "$side" = after ] && dir=$after
    for bench in latency layerwise "transfer --backend nixl"; do
      name=${bench%% *}; [ "$name" = transfer ] && name=nixl
      (cd "$dir" && PYTHONPATH=$dir timeout 900 "$py" -m aiokv.cli bench $bench --json \
        > "$out/$name-$side-$round.json" 2> "$out/$name-$side-$round.err")
      echo "$(date +%T) $name $side round $round: rc=$?"
    done
  done
done

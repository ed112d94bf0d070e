#!/usr/bin/env bash
# One command under several versions of onnxgen's code, in turn, for changes a runtime switch cannot
# reach (a kernel's source): each version is a copy of the onnxgen package in .trees/NAME/onnxgen; the
# command runs in that folder (Python puts the current folder first on its path, before PYTHONPATH),
# with the repo root on PYTHONPATH for bench/. The working tree (named "head") runs in the repo root.
# Run from the repo root; give the command absolute paths.
#
#   here, before the device call (git-ignored; carry .trees):
#       bash bench/tree_ab.sh export NAME REV        # git archive REV's onnxgen/ into .trees/NAME
#   there:
#       bash bench/tree_ab.sh run ROUNDS NAMES -- COMMAND ...
#   e.g. bash bench/tree_ab.sh run 2 base,head -- python3 -m bench.step_sweep --package P --variant "x:"
#
# NAMES is a comma list of .trees folders and "head". Every round runs COMMAND once per name, in that
# order, so a drift of the machine over the run shows as a difference between rounds, not between
# versions. Each run's output is prefixed with "[NAME round R]". Compare versions within one run only.
set -euo pipefail
top=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
cd "$top"
case "${1:-}" in
  export)
    [ $# -eq 3 ] || { echo "usage: tree_ab.sh export NAME REV" >&2; exit 2; }
    rm -rf ".trees/$2" && mkdir -p ".trees/$2"
    git archive "$3" onnxgen | tar -x -C ".trees/$2"
    echo "exported $3 into .trees/$2" >&2
    ;;
  run)
    [ $# -ge 4 ] && [ "$4" = "--" ] || { echo "usage: tree_ab.sh run ROUNDS NAMES -- COMMAND ..." >&2; exit 2; }
    rounds=$2 names=$3
    shift 4
    IFS=, read -r -a versions <<< "$names"
    for v in "${versions[@]}"; do
      [ "$v" = head ] || [ -d ".trees/$v/onnxgen" ] || { echo "no .trees/$v/onnxgen (export it first)" >&2; exit 2; }
    done
    base_path=${PYTHONPATH:-}
    for round in $(seq 1 "$rounds"); do
      for v in "${versions[@]}"; do
        if [ "$v" = head ]; then dir=$top; else dir=$top/.trees/$v; fi
        echo "### [$v round $round] $*" >&2
        { (cd "$dir" && PYTHONPATH="$top${base_path:+:$base_path}" "$@" 2>&1) | sed "s/^/[$v round $round] /"; } ||
          echo "### [$v round $round] failed (exit $?)" >&2
      done
    done
    ;;
  *)
    echo "usage: tree_ab.sh export NAME REV | run ROUNDS NAMES -- COMMAND ..." >&2
    exit 2
    ;;
esac

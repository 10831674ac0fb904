#!/usr/bin/env bash
# This tree against another commit's, started in turn on one host: for a change to the serving
# code that no config switch tells apart (bench/run.py compares configs within one tree).
#   bash bench/ab.sh prepare BASE                 (needs git: BASE's tree into .ab/BASE)
#   bash bench/ab.sh run BASE ROUNDS COMMAND...   (on the host that measures; .ab/ travels
#                                                  with the checkout)
# `run` starts COMMAND in this tree, then in BASE's, ROUNDS times: the first start is the
# host's first (an empty inductor cache on a GPU host). Each start's results go to
# $OUT/<n>-<tree>/ (OUT: bench/results/ab-<time> when unset), its output to log.txt there;
# each tree comes first on PYTHONPATH, so its own serving code runs.
#   bash bench/ab.sh run 41bd2a2 2 bash bench/gpu_run.sh gpu.yaml --only gpu --loads one-conn
#   bash bench/ab.sh run 41bd2a2 1 "$PWD/.venv/bin/python" bench/run.py bench/scenarios/cpu.yaml
# COMMAND runs in each tree's folder: name the interpreter by an absolute path.
set -u
usage="usage: bash bench/ab.sh prepare BASE | run BASE ROUNDS COMMAND..."
action=${1:?$usage}
base=${2:?$usage}
case $action in
  prepare)
    rm -rf ".ab/$base" && mkdir -p ".ab/$base"
    git archive "$base" | tar -x -C ".ab/$base"
    echo "BASE's tree in .ab/$base"
    ;;
  run)
    rounds=${3:?$usage}
    shift 3
    [ -d ".ab/$base" ] || { echo "no .ab/$base: run bash bench/ab.sh prepare $base first"; exit 2; }
    out=${OUT:-$PWD/bench/results/ab-$(date +%Y%m%d-%H%M%S)}
    mkdir -p "$out"
    for n in $(seq "$rounds"); do
      for tree in . ".ab/$base"; do
        name=$n-$([ "$tree" = . ] && echo this || echo "$base")
        mkdir -p "$out/$name"
        # BASE's tree uses this tree's model export and GPU bundle (made by its first start)
        if [ "$tree" != . ]; then
          ln -sfn "$PWD/models" "$tree/models"
          [ -d .gpu ] && ln -sfn "$PWD/.gpu" "$tree/.gpu"
        fi
        (cd "$tree" && export PYTHONPATH="$PWD:$PWD/protos${PYTHONPATH:+:$PYTHONPATH}" \
          && OUT="$out/$name" "$@" > "$out/$name/log.txt" 2>&1)
        echo "== $name: exit $?"
        grep -E "ready after|^[a-z0-9/-]+ +[a-z0-9-]+ +[0-9.-]+ " "$out/$name/log.txt"
      done
    done
    echo "results in $out"
    ;;
  *) echo "$usage"; exit 2 ;;
esac

#!/usr/bin/env bash
# The GPU recipe of benchmarks/recipes/gpu_serve.py on a machine without network, in several device calls.
#
#   bash benchmarks/recipes/gpu_serve.sh stash DIR          # calls 1..n-1: copy the carried DIR to /tmp/carry, exit
#   bash benchmarks/recipes/gpu_serve.sh run DIR [ARGS...]  # last call: copy DIR too, join the parts, check the
#                                                  # sums, install the wheels into /tmp/site, run the recipe
#
# DIR holds wheels and data packed by `python -m benchmarks.recipes.gpu_wheels` (files cut in NAME.part-aa, -ab...
# where one call could not carry them whole; SHA256SUMS of the whole files). ARGS go to
# `python3 -m benchmarks.recipes.gpu_serve` (e.g. --models smollm2 --budget-s 300), or to the recipe module named by
# GPU_SERVE_RECIPE (e.g. benchmarks.recipes.gpu_two_replicas on the 2-GPU machine; same wheels, same calls). Results:
# $OUT (summary.json, report.md, gsm8k.json, log.txt). Each call must come while the machine is still warm
# (about 30 s).
set -euo pipefail
mode=${1:?usage: gpu_serve.sh stash|run DIR [ARGS...]}
dir=${2:?usage: gpu_serve.sh stash|run DIR [ARGS...]}
shift 2
carry=/tmp/carry
mkdir -p "$carry"
cp -f "$dir"/* "$carry"/
echo "gpu_serve.sh: $(ls "$carry" | wc -l) files in $carry ($(du -sh "$carry" | cut -f1))"
if [ "$mode" = stash ]; then
  exit 0
fi
[ "$mode" = run ] || { echo "unknown mode $mode" >&2; exit 2; }
start=$(date +%s)
cd "$carry"
for first in *.part-aa; do
  [ -e "$first" ] || continue
  whole=${first%.part-aa}
  cat "$whole".part-* > "$whole"
  rm -f "$whole".part-*
done
sha256sum -c --quiet SHA256SUMS
cd - > /dev/null
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$carry"/*.whl
echo "gpu_serve.sh: wheels installed in $(( $(date +%s) - t0 )) s"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_serve_out}
mkdir -p "$out"
set -o pipefail
# the recipe's budget: GPU_SERVE_BUDGET_S (default 480 s) from here on, less what joining and installing took
budget=$(( ${GPU_SERVE_BUDGET_S:-480} - ( $(date +%s) - start ) ))
python3 -m "${GPU_SERVE_RECIPE:-benchmarks.recipes.gpu_serve}" --out "$out" --data "$carry" --budget-s "$budget" "$@" 2>&1 | tee "$out/log.txt"

#!/usr/bin/env bash
# Device calls on a GPU machine without network: the GPU tests that need no Ray (`make test-gpu`'s
# selection, four pytest workers), gpt-oss-120b's batch-one engine benchmark, then the engine-level studies of
# docs/exactness.md (lane agreement in fp32, bf16 and bf16 with batch_invariant; gpt-oss-120b's TTFT and
# standard-lane sweep with batch_invariant on, then off), each writing its result files into $OUT.
#
#   here:  mkdir -p .whl/engine && python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#            --platform manylinux2014_x86_64 -d .whl/engine pydantic==2.14.4 pydantic-core==2.50.5 \
#            annotated-types==0.8.0 typing-inspection==0.4.5 pytest-xdist==3.8.0 execnet==2.1.2
#   there: GIT_COMMIT=<short hash> bash benchmarks/recipes/gpu_engine.sh .whl/engine   (carry .whl/engine)
#
# Steps (STEPS, default "tests batch_one lanes on off"; pick some per 10-minute call, e.g. "tests batch_one"
# then "lanes on off"): tests, batch_one (benchmarks.engine on gpt-oss-120b), decode_moe (one MoE layer per kernel
# and token count, benchmarks.decode_moe), baseline (the same benchmark
# from an older tree carried in BASELINE_TREE, its ops.bench.engine or benchmarks.engine, so that a card other
# than the results' can still say whether a number moved), lanes, on, off. Budgets (seconds, environment):
# TESTS_S (360), BATCH_ONE_S (150), LANES_S (150), MODEL_S (each 120b sweep, 200); SWEEP_C, the sweep's
# concurrencies (1,8,16,64,256; on an 80 GB card 1,8,16,64 fits). Whatever a step did not
# finish is still in $OUT (the benchmarks rewrite their files after every table).
set -uo pipefail
wheels=${1:?usage: gpu_engine.sh WHEEL_DIR}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_engine_out}
mkdir -p "$out/lanes" "$out/on" "$out/off" "$out/eng"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
steps=" ${STEPS:-tests batch_one lanes on off} "
workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-4}" --dist loadfile)
[[ $steps == *" tests "* ]] && { start=$SECONDS; timeout "${TESTS_S:-360}" python3 -m pytest -q -o addopts="-ra" \
  -p no:cacheprovider "${workers[@]}" --durations=12 -m "not stress and not cluster and not chaos and not lmeval" \
  tests/gpu tests/replicas/kernels 2>&1 | tee "$out/pytest.log" | tail -40; echo "tests: $((SECONDS - start)) s"; }
batch_one=(--shapes gpt-oss-120b --no-hf --reps 2 --slow-new-tokens 16)
[[ $steps == *" batch_one "* ]] && { start=$SECONDS; timeout "${BATCH_ONE_S:-150}" python3 -m benchmarks.engine \
  "${batch_one[@]}" --results "$out/eng" 2>&1 | tail -12; echo "batch_one: $((SECONDS - start)) s"; }
if [[ $steps == *" baseline "* ]]; then
  tree=${BASELINE_TREE:?baseline: set BASELINE_TREE to an older checkout}
  module=benchmarks.engine; [ -d "$tree/ops/bench" ] && module=ops.bench.engine
  ( cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout "${BATCH_ONE_S:-150}" python3 -m $module "${batch_one[@]}" \
    --json "$out/eng/baseline.json" 2>&1 | tail -12 )
fi
[[ $steps == *" decode_moe "* ]] && timeout "${DECODE_MOE_S:-150}" python3 -m benchmarks.decode_moe --out "$out" \
  --tokens 1 8 16 32 64 128 256 2>&1 | tail -40
[[ $steps == *" lanes "* ]] && timeout "${LANES_S:-150}" python3 -m benchmarks.prefill --out "$out/lanes" --parts lanes --budget-s "${LANES_S:-150}" \
  2>&1 | grep -A8 "Lane agreement"
for mode in on off; do
  [[ $steps == *" $mode "* ]] || continue
  flag=false; [ "$mode" = on ] && flag=true
  timeout "${MODEL_S:-200}" python3 -m benchmarks.prefill --out "$out/$mode" --parts gpt-oss-120b --reps 2 \
    --engine "batch_invariant=$flag" --concurrency "${SWEEP_C:-1,8,16,64,256}" \
    --budget-s "$(( ${MODEL_S:-200} - 20 ))" 2>&1 | grep -B2 -A12 "^### " | tail -40
done
# at most 8 files come back from $OUT: the reports were printed above; keep only errors that happened
find "$out" -name report.md -delete
grep -rl --include=errors.txt "^no errors" "$out" | xargs -r rm -f
ls -R "$out"

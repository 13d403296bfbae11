#!/usr/bin/env bash
# One device call on a GPU machine without network: the GPU tests that need no Ray, then the engine-level
# studies of docs/exactness.md (lane agreement in fp32, bf16 and bf16 with batch_invariant; gpt-oss-120b's
# TTFT and standard-lane sweep with batch_invariant on, then off), each writing its result files into $OUT.
#
#   here:  mkdir -p .whl/engine && python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#            --platform manylinux2014_x86_64 -d .whl/engine pydantic==2.14.4 pydantic-core==2.50.5 \
#            annotated-types==0.8.0 typing-inspection==0.4.5
#   there: GIT_COMMIT=<short hash> bash benchmarks/recipes/gpu_engine.sh .whl/engine   (carry .whl)
#
# Budgets (seconds, environment): TESTS_S (240), LANES_S (150), MODEL_S (each 120b run, 200). Whatever a
# step did not finish is still in $OUT (the benchmarks rewrite their files after every table). All four steps
# take more than one 10-minute call: STEPS picks some (default "tests lanes on off"), e.g. STEPS="tests lanes"
# in one call and STEPS="on off" in the next.
set -uo pipefail
wheels=${1:?usage: gpu_engine.sh WHEEL_DIR}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_engine_out}
mkdir -p "$out/lanes" "$out/on" "$out/off"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
steps=" ${STEPS:-tests lanes on off} "
[[ $steps == *" tests "* ]] && timeout "${TESTS_S:-240}" python3 -m pytest -q -o addopts="-ra" -p no:cacheprovider \
  tests/replicas/kernels/test_row_exact_gemm.py tests/gpu/test_exactness_gpu.py tests/gpu/test_prefill_gpu.py \
  2>&1 | tee "$out/pytest.log" | tail -25
[[ $steps == *" lanes "* ]] && timeout "${LANES_S:-150}" python3 -m benchmarks.prefill --out "$out/lanes" --parts lanes --budget-s "${LANES_S:-150}" \
  2>&1 | grep -A8 "Lane agreement"
for mode in on off; do
  [[ $steps == *" $mode "* ]] || continue
  flag=false; [ "$mode" = on ] && flag=true
  timeout "${MODEL_S:-200}" python3 -m benchmarks.prefill --out "$out/$mode" --parts gpt-oss-120b --reps 2 \
    --engine "batch_invariant=$flag" --budget-s "$(( ${MODEL_S:-200} - 20 ))" 2>&1 | grep -B2 -A12 "^### " | tail -40
done
# at most 8 files come back from $OUT: the reports were printed above; keep only errors that happened
find "$out" -name report.md -delete
grep -rl --include=errors.txt "^no errors" "$out" | xargs -r rm -f
ls -R "$out"

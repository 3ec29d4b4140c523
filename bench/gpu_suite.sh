#!/usr/bin/env bash
# The GPU suite: everything worth measuring in one short window on one GPU, from a plain checkout.
#
#   bench/gpu_suite.sh OUT_DIR [--tiny]
#
# Needs only python with torch, triton, numpy and pytest: no install step (`mhar_kernels` comes
# from the checkout through the root shim), and every section runs through bench/plain_python.py,
# which blocks datasets / torchdata / tiktoken / wandb and ignores an editable install.
# Every section runs even when an earlier one fails; each has its own time budget (`timeout`),
# and the budgets add up to under 4 minutes, so the whole suite ends in time by construction.
# Each section writes OUT_DIR/<name>.md (its table) and OUT_DIR/<name>.log; OUT_DIR/summary.json
# lists every section's status, exit code, seconds and budget. --tiny: the same sections at toy
# sizes (the CI test runs it on CPU through the Triton interpreter).
set -uo pipefail
OUT=${1:?usage: bench/gpu_suite.sh OUT_DIR [--tiny]}
TINY=0
[[ "${2:-}" == "--tiny" ]] && TINY=1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
RUN=("$PY" bench/plain_python.py)

if (( TINY )); then
  COMPILE=(--shapes 512x8 --variants aligned)
  TESTS=(tests/test_kernels_op.py -k "bitwise or empty_token or non_contiguous")
  ROUTING=(--shapes toy --impls triton,eager --warmup 1 --iters 1 --group 2)
  THROUGHPUT=(--scales debug --batch 1 --seq 8 --vocab 256 --steps 1 --warmup 0 --ac none
              --families mhar,mhar-grouped --kernel triton)
else
  COMPILE=()  # every paper shape, both variants
  # The kernel tests on CUDA tensors (the FSDP test is CPU/gloo and needs torchrun: left to CI).
  TESTS=(tests/test_kernels_op.py tests/test_kernels_numerics.py tests/test_kernels_leaf.py tests/test_kernels_shared_grad.py
         tests/test_kernels_model.py tests/test_attention_mask.py::test_flex_attention_forward_and_backward_on_cuda
         -m "not distributed")
  # the step also with its sites in groups of 11 (grouped routing, the fused phase 1), last per shape
  ROUTING=(--shapes paper --impls triton,eager,compile --warmup 3 --iters 10 --group 11)
  # MHAR per call and grouped (g = "auto") against the baseline; AC none first at every scale; every
  # family with document masking and the chunked loss (compile is left out: its warm-up does not fit the budget).
  THROUGHPUT=(--steps 3 --warmup 1 --ac none,full --families mhar,mhar-grouped --kernel triton
              --mask block_causal --loss chunked)
fi

# Sections in order, each with its budget in seconds (the sum stays under 240).
SECTIONS=(env bytes compile tests routing throughput)
declare -A BUDGET=([env]=20 [bytes]=15 [compile]=25 [tests]=70 [routing]=45 [throughput]=60)

# section_cmd NAME: sets CMD to the section's command; it writes OUT/NAME.md.
section_cmd() {
  local stop_s=$(( BUDGET[$1] - 10 ))  # the benchmarks start no new work 10 s before the kill
  case $1 in
    env) CMD=("${RUN[@]}" bench/suite_report.py env "$OUT/env.md") ;;
    bytes) CMD=("${RUN[@]}" bench/routing.py --bytes --out "$OUT/bytes.md") ;;
    compile) CMD=(env -u TRITON_INTERPRET "${RUN[@]}" -m mhar_kernels.compile_report "${COMPILE[@]}"
                  --out "$OUT/compile.md") ;;
    tests) CMD=(env MHAR_SUITE_TESTS_TABLE="$OUT/tests.md" "${RUN[@]}" -m pytest -v -p no:cacheprovider
                -p bench.suite_report --continue-on-collection-errors "${TESTS[@]}") ;;
    routing) CMD=("${RUN[@]}" bench/routing.py "${ROUTING[@]}" --out "$OUT/routing.md" --budget-s "$stop_s") ;;
    throughput) CMD=("${RUN[@]}" bench/throughput.py "${THROUGHPUT[@]}" --out "$OUT/throughput.md"
                     --budget-s "$stop_s") ;;
  esac
}

total=0
for name in "${SECTIONS[@]}"; do total=$(( total + BUDGET[$name] )); done
{
  echo "GPU suite plan ($(date -u +%FT%TZ), tiny=$TINY): ${#SECTIONS[@]} sections, at most ${total} s in all"
  for name in "${SECTIONS[@]}"; do printf '  %-11s budget %3d s\n' "$name" "${BUDGET[$name]}"; done
  echo "  compile: sm_90 registers/spills/vector width ${COMPILE[*]}"
  echo "  tests: ${TESTS[*]}"
  echo "  routing: ${ROUTING[*]}"
  echo "  throughput: ${THROUGHPUT[*]}"
} | tee "$OUT/plan.txt"

: > "$OUT/sections.tsv"
for name in "${SECTIONS[@]}"; do
  echo "== $name (budget ${BUDGET[$name]} s)"
  start=$(date +%s)
  section_cmd "$name"
  timeout --kill-after=5 "${BUDGET[$name]}" "${CMD[@]}" > "$OUT/$name.log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  tail -n 3 "$OUT/$name.log"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$seconds" "${BUDGET[$name]}" >> "$OUT/sections.tsv"
  echo "== $name: exit $rc after ${seconds} s"
done
"$PY" bench/plain_python.py bench/suite_report.py summary "$OUT" "$TINY"
echo "tables, logs and summary.json in $OUT"

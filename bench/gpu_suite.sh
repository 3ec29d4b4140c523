#!/usr/bin/env bash
# The GPU suite: everything worth measuring in one short window on one GPU, from a plain checkout.
#
#   bench/gpu_suite.sh OUT_DIR [--tiny]     # run the plan
#   bench/gpu_suite.sh --plan [--tiny]      # print the plan only
#
# Needs only python with torch, triton, numpy and pytest: no install step (`mhar_kernels` comes
# from the checkout through the root shim), and every row runs through bench/plain_python.py,
# which blocks datasets / torchdata / tiktoken / wandb and ignores an editable install.
#
# The plan is a list of rows (section, scale, family, impl, AC, budget), printed row by row before
# anything runs and run in that order, most valuable first: the isolated 1b routing timing, the
# real trainer (train.py under torchrun on 100m MHAR and the baseline with local data, CUDA graphs
# and document masking, a checkpoint, a SIGKILL and a bitwise resume; then 20 steps of 1b at
# micro-batch 4, AC full, on the fused routing kernels, per call and grouped, with and without
# training.cuda_graphs, losses bitwise and host-inclusive step times), then
# per scale 1b before 100m the throughput rows (AC none and full side by side) and the Triton
# routing rows, with after 1b's one timed step of every depth connection at 350m (baseline,
# DenseFormer, MUDDFormer, Hyper-Connections and mHC on their eager code, MHAR and AttnRes fused),
# then the kernel tests, the eager routing rows, the sm_90 compile report, the
# host-time row, and torch.compile last at one shape (1b). (The counted bytes are a CPU count:
# `bench/routing.py --bytes` runs anywhere. 350m is left out to fit the window but for the connections
# row, and so is the 1b
# graphs comparison with per-block compile: up to one graph per depth (36 at 1b, parallel.py) per
# family, compiled twice on a fresh machine, is minutes by estimate (not measured); run it on its
# own: `python bench/trainer_row.py graphs --scale 1b
# --families mhar,mhar-grouped --kernel triton --compile --out TABLE.md`.) The trainer rows
# need .whl/ carried (bench/gpu_wheels.sh), data/shakespeare and .cache/tiktoken. Each row is its own process
# under its own `timeout`, writes OUT_DIR/NN-<row>.md (its table, rewritten as its measurements
# finish) and OUT_DIR/NN-<row>.log, and is appended to OUT_DIR/rows.tsv as soon as it ends, so a
# cut-off window keeps every finished row. Every row runs even when an earlier one fails. The
# budgets add up to at most 360 s (the machine takes minutes to start: a rerun must fit in a
# 15-minute window); OUT_DIR/summary.json lists every row's status, exit code, seconds and budget.
# --tiny: the same sections at toy sizes (the CI test runs it on CPU through the Triton
# interpreter; no row of it times anything against a deadline). MHAR_SUITE_BUDGET_SCALE=K
# multiplies every row's time limit by K (default 1; the CPU test sets a large K, so that a loaded
# machine cannot turn a budget into a failure).
set -uo pipefail
OUT="" TINY=0 PLAN_ONLY=0
for arg in "$@"; do
  case $arg in
    --tiny) TINY=1 ;;
    --plan) PLAN_ONLY=1 ;;
    -*) echo "unknown option $arg; usage: bench/gpu_suite.sh OUT_DIR [--tiny] | --plan [--tiny]" >&2; exit 2 ;;
    *) OUT=$arg ;;
  esac
done
if (( ! PLAN_ONLY )) && [[ -z $OUT ]]; then
  echo "usage: bench/gpu_suite.sh OUT_DIR [--tiny] | --plan [--tiny]" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
SCALE=${MHAR_SUITE_BUDGET_SCALE:-1}
[[ $SCALE =~ ^[1-9][0-9]*$ ]] || { echo "MHAR_SUITE_BUDGET_SCALE must be a positive integer, got $SCALE" >&2; exit 2; }
RUN=("$PY" bench/plain_python.py)
FAMILIES=baseline,mhar,mhar-grouped
CONNECTIONS=baseline,dense,mudd,hyper,mhc,mhar,attnres  # the depth connections: the eager mixing of DenseFormer,
                          # MUDDFormer, Hyper-Connections and mHC (n = 4), then MHAR (H = 8 = KV heads at 350m) and AttnRes fused

# section scale family impl ac budget_s   (one row per line; "-": not applicable)
if (( TINY )); then
  PLAN="env - - - - 10
isolated toy mhar,mhar-grouped triton none 30
trainer debug mhar,baseline torchrun none 300
graphs debug mhar,mhar-grouped torchrun full 150
throughput debug $FAMILIES triton none 40
throughput debug $FAMILIES triton full 40
routing toy mhar,mhar-grouped triton none 30
connections debug $CONNECTIONS triton none 40
tests - - triton - 60
routing toy mhar,mhar-grouped eager none 20
compile sm_90 - triton - 30
host 1b mhar,mhar-grouped stubbed none 30
bytes 100m,350m,1b mhar,mhar-grouped model none,full 20"
else
  PLAN="env - - - - 6
isolated 1b mhar,mhar-grouped triton none 28
trainer 100m mhar,baseline torchrun none 69
graphs 1b mhar,mhar-grouped torchrun full 78
throughput 1b $FAMILIES triton none 23
throughput 1b $FAMILIES triton full 21
routing 1b mhar,mhar-grouped triton none 11
connections 350m $CONNECTIONS triton none 30
throughput 100m $FAMILIES triton none 15
throughput 100m $FAMILIES triton full 14
routing 100m mhar,mhar-grouped triton none 9
tests - - triton - 20
routing 1b mhar,mhar-grouped eager none 7
routing 100m mhar,mhar-grouped eager none 5
compile sm_90 - triton - 8
host 1b mhar,mhar-grouped stubbed none 9
routing 1b mhar compile none 7"
fi

# row_cmd SECTION SCALE FAMILY IMPL AC BUDGET TABLE: sets CMD to the row's command; it writes TABLE.
row_cmd() {
  local section=$1 scale=$2 family=$3 impl=$4 ac=$5 budget=$6 table=$7
  local stop_s=$(( budget * 3 / 4 ))  # the benchmarks start no new measurement after this
  local shapes=(--shapes paper) sizes=(--warmup 3 --iters 10)
  (( TINY )) && shapes=(--shapes toy) && sizes=(--warmup 1 --iters 1)
  case $section in
    env) CMD=("${RUN[@]}" bench/suite_report.py env "$table") ;;
    # the real trainer under torchrun (not plain_python: it needs torchdata and tiktoken; the wheels
    # the GPU image lacks come from .whl/, bench/gpu_wheels.sh)
    trainer)
      local t_sizes=()
      (( TINY )) && t_sizes=(--tiny --steps 8 --checkpoint-at 3)
      # with CUDA graphs (where CUDA is) and document masking: the resumed run captures afresh
      CMD=("$PY" bench/trainer_row.py resume --scale "$scale" --families "$family" --graphs --mask block_causal
           "${t_sizes[@]}" --budget-s "$stop_s" --out "$table") ;;
    graphs)
      local g_sizes=()
      (( TINY )) && g_sizes=(--tiny --steps 5)
      # per family eager, then graphs: the fused routing kernels in both (the paper's 1b recipe)
      CMD=("$PY" bench/trainer_row.py graphs --scale "$scale" --families "$family" --ac "$ac" --kernel triton
           "${g_sizes[@]}" --budget-s "$stop_s" --out "$table") ;;
    isolated) CMD=("${RUN[@]}" bench/routing.py --isolated "${shapes[@]}" --scales "$scale" --group auto
                   "${sizes[@]}" --out "$table") ;;
    throughput)
      local sizes_t=(--steps 3 --warmup 1)
      (( TINY )) && sizes_t=(--batch 1 --seq 8 --vocab 256 --steps 1 --warmup 0)
      # every family with document masking and the chunked loss, the baseline's best configuration
      # (whole-model compile is left out: its warm-up does not fit a row's budget)
      CMD=("${RUN[@]}" bench/throughput.py --scales "$scale" --ac "$ac" --families "$family" --kernel "$impl"
           --mask block_causal --loss chunked "${sizes_t[@]}" --out "$table" --budget-s "$stop_s") ;;
    connections)
      local sizes_c=(--steps 1 --warmup 1)
      (( TINY )) && sizes_c=(--batch 1 --seq 8 --vocab 256 --steps 1 --warmup 0)
      # one timed step per depth connection (the paper's 350m micro-batch, 4 x 1024), as the throughput
      # rows: DenseFormer, MUDDFormer, Hyper-Connections and mHC on their eager code, MHAR and AttnRes on
      # the fused kernels; the fused ones last, their kernels compile at this width on their first step
      CMD=("${RUN[@]}" bench/throughput.py --scales "$scale" --ac "$ac" --families "$family" --kernel "$impl"
           --mask block_causal --loss chunked "${sizes_c[@]}" --out "$table" --budget-s "$stop_s") ;;
    routing)
      local scope=(--group auto)
      [[ $impl == compile ]] && scope=(--no-step)  # one call at one shape: compiling 73 site shapes is minutes
      CMD=("${RUN[@]}" bench/routing.py "${shapes[@]}" --scales "$scale" --impls "$impl" "${scope[@]}" "${sizes[@]}"
           --out "$table" --budget-s "$stop_s") ;;
    tests)
      local tests=(tests/test_kernels_op.py tests/test_kernels_numerics.py tests/test_kernels_leaf.py
                   tests/test_kernels_shared_grad.py tests/test_kernels_model.py
                   tests/test_attention_mask.py::test_flex_attention_forward_and_backward_on_cuda
                   tests/test_cuda_graphs_gpu.py -m "not distributed")
      (( TINY )) && tests=(tests/test_kernels_op.py -k "bitwise or empty_token or non_contiguous")
      CMD=(env MHAR_SUITE_TESTS_TABLE="$table" "${RUN[@]}" -m pytest -v -p no:cacheprovider
           -p bench.suite_report --continue-on-collection-errors "${tests[@]}") ;;
    compile)
      local kernels=()
      (( TINY )) && kernels=(--shapes 512x8 --variants aligned)
      CMD=(env -u TRITON_INTERPRET "${RUN[@]}" bench/compile_report.py "${kernels[@]}" --out "$table") ;;
    host)
      local iters=200
      (( TINY )) && iters=3
      CMD=("${RUN[@]}" bench/routing.py --host --iters "$iters" --out "$table") ;;
    bytes) CMD=("${RUN[@]}" bench/routing.py --bytes --out "$table") ;;
    *) echo "unknown section $section" >&2; return 1 ;;
  esac
}

total=0 rows=0
while read -r _ _ _ _ _ budget; do total=$(( total + budget )); rows=$(( rows + 1 )); done <<< "$PLAN"
print_plan() {
  echo "GPU suite plan ($(date -u +%FT%TZ), tiny=$TINY): $rows rows, at most ${total} s in all"
  printf '  %-3s %-11s %-12s %-42s %-8s %-9s %s\n' row section scale family impl AC budget
  local n=0
  while read -r section scale family impl ac budget; do
    n=$(( n + 1 ))
    printf '  %-3s %-11s %-12s %-42s %-8s %-9s %3d s\n' "$n" "$section" "$scale" "$family" "$impl" "$ac" "$budget"
  done <<< "$PLAN"
}
if (( PLAN_ONLY )); then
  print_plan
  exit 0
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
print_plan | tee "$OUT/plan.txt"

: > "$OUT/rows.tsv"
n=0
while read -r section scale family impl ac budget; do
  n=$(( n + 1 ))
  id=$(printf '%02d-%s' "$n" "$section")
  [[ $scale != - ]] && id+="-${scale//,/+}"
  [[ $impl != - ]] && id+="-$impl"
  [[ $ac != - ]] && id+="-${ac//,/+}"
  echo "== row $n: $section $scale $family $impl AC $ac (budget $budget s)"
  start=$(date +%s)
  row_cmd "$section" "$scale" "$family" "$impl" "$ac" "$(( budget * SCALE ))" "$OUT/$id.md"
  timeout --kill-after=5 "$(( budget * SCALE ))" "${CMD[@]}" > "$OUT/$id.log" 2>&1 < /dev/null
  rc=$?
  seconds=$(( $(date +%s) - start ))
  tail -n 3 "$OUT/$id.log"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$id" "$section" "$scale" "$family" "$impl" "$ac" "$rc" "$seconds" \
    "$budget" >> "$OUT/rows.tsv"
  echo "== row $n: exit $rc after ${seconds} s"
done <<< "$PLAN"
"$PY" bench/plain_python.py bench/suite_report.py summary "$OUT" "$TINY"
echo "tables, logs and summary.json in $OUT"

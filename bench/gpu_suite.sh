#!/usr/bin/env bash
# GPU checks for the fused routing kernels (issue 6), one script, about 5 minutes on one H200:
#   1. CUDA correctness tests of the kernels (numerics vs eager + fp64 oracle, edge cases, op tests
#      including bitwise repeatability of two calls);
#   2. bench/routing.py at the paper's shapes (eager, torch.compile, Triton);
#   3. bench/throughput.py for baseline / AttnRes / MHAR at 100m, 350m, 1b, AC off and on.
# The GPU machine has torch, triton and numpy only: every step runs with the data stack
# (datasets, torchdata, tiktoken, wandb) blocked, so an accidental import fails loudly.
#
# Usage: bench/gpu_suite.sh LOG_DIR [--append BENCHMARKS.md]
set -euo pipefail
LOG_DIR=${1:?usage: bench/gpu_suite.sh LOG_DIR [--append BENCHMARKS.md]}
shift
APPEND=()
if [[ "${1:-}" == "--append" ]]; then APPEND=(--append "${2:?--append needs a path}"); fi
cd "$(dirname "$0")/.."
mkdir -p "$LOG_DIR"
PY=${PYTHON:-python}

# run_py NAME SCRIPT_OR_-m ARGS...: python with the data stack made unimportable.
run_py() {
  local name=$1; shift
  echo "== $name: $*" | tee "$LOG_DIR/$name.log"
  "$PY" - "$@" <<'PYEOF' 2>&1 | tee -a "$LOG_DIR/$name.log"
import runpy, sys
for mod in ("datasets", "torchdata", "tiktoken", "wandb"):
    sys.modules[mod] = None  # ImportError on any import
sys.path.insert(0, ".")
args = sys.argv[1:]
if args[0] == "-m":
    sys.argv = [args[1], *args[2:]]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")
PYEOF
}

"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  | tee "$LOG_DIR/versions.log"
run_py tests -m pytest -q -x -p no:cacheprovider tests/test_kernels_numerics.py tests/test_kernels_op.py \
  -k "not opcheck and not reference_path"
run_py routing bench/routing.py --shapes paper --warmup 5 --iters 20 "${APPEND[@]}"
run_py throughput bench/throughput.py --steps 5 --warmup 2 "${APPEND[@]}"
echo "logs in $LOG_DIR"

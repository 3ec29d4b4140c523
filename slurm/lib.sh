# shellcheck shell=bash
# Helpers shared by the launchers (sourced, not run): slurm/torchrun_node.sh and scripts/run_train.sh.

# count_gpus: print how many GPUs this process may use, first match wins:
#   1. SLURM_GPUS_ON_NODE (set inside a SLURM step that holds GPUs), when it is a number;
#   2. the entries of CUDA_VISIBLE_DEVICES when it is set (empty or -1 hides every GPU: 0);
#   3. the devices `nvidia-smi -L` lists;
#   4. 0 (no GPU, no nvidia-smi).
count_gpus() {
  if [[ "${SLURM_GPUS_ON_NODE:-}" =~ ^[0-9]+$ ]]; then
    echo "$SLURM_GPUS_ON_NODE"
  elif [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    local -a ids=()
    if [[ "$CUDA_VISIBLE_DEVICES" != "-1" ]]; then
      IFS=',' read -r -a ids <<<"$CUDA_VISIBLE_DEVICES"
    fi
    echo "${#ids[@]}"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

# python_for REPO: print the interpreter the launchers run (and take torchrun from, as
# `"$python" -m torch.distributed.run`), first match wins:
#   1. PYTHON when it is set;
#   2. REPO/.venv/bin/python, the project's virtual environment, when it exists;
#   3. python3 from PATH.
python_for() {
  if [[ -n "${PYTHON:-}" ]]; then
    echo "$PYTHON"
  elif [[ -x "$1/.venv/bin/python" ]]; then
    echo "$1/.venv/bin/python"
  else
    echo python3
  fi
}

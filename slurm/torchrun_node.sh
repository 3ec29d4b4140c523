#!/usr/bin/env bash
# One torchrun per node: slurm/train.sbatch runs this through `srun` (one task per node).
#
#   slurm/torchrun_node.sh CONFIG [--section.key=value ...]
#
# Everything torchrun needs comes from the environment, so the same script works under
# SLURM and, with the variables set by hand, on any machine (the tests run two "nodes" on
# loopback this way):
#
#   RDZV_ENDPOINT    host:port of the c10d rendezvous (required; train.sbatch uses the first node)
#   NNODES           number of nodes            (default: SLURM_JOB_NUM_NODES, else SLURM_NNODES, else 1)
#   NODE_RANK        this node's index          (default: SLURM_NODEID, else 0; c10d may reorder nodes)
#   NPROC_PER_NODE   worker processes here      (default: GPUs on this node, see below; 1 without GPUs)
#   RDZV_ID          rendezvous id              (default: SLURM_JOB_ID, else "mhar-titan")
#   PYTHON           interpreter with torch     (default: <repo>/.venv/bin/python if present, else python3)
#   TRAIN_SCRIPT     training entry point       (default: <repo>/train.py)
#   TORCHRUN_LOG_DIR per-rank stdout/stderr files (default: none, output goes to this task's log)
#   SHUTDOWN_TIMEOUT seconds workers get to save after SIGTERM before SIGKILL (default 100)
#   PRINT_CMD=1      print the torchrun command line and exit
#   DRY_RUN=1        instead of training, check the config for NNODES x NPROC_PER_NODE ranks
#                    (python -m mhar_titan.dryrun: model on the meta device, no data, no network)
#
# GPUs on this node: count_gpus in slurm/lib.sh (SLURM_GPUS_ON_NODE, else the entries of
# CUDA_VISIBLE_DEVICES, else the devices `nvidia-smi -L` lists). LOCAL_WORLD_SIZE and
# CUDA_VISIBLE_DEVICES may differ between nodes; workers map LOCAL_RANK to a device with
# mhar_titan.launch_env.
#
# Signals: SIGTERM sent to this process reaches torchrun itself (this script execs it);
# torchrun forwards it to its workers, which save a checkpoint and exit 0, and kills them
# only after SHUTDOWN_TIMEOUT seconds.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"

if [[ $# -lt 1 ]]; then
  echo "usage: $0 CONFIG.toml [--section.key=value ...]" >&2
  exit 2
fi
config="$1"
shift

# shellcheck source=slurm/lib.sh
source "$here/lib.sh"

nnodes="${NNODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}"
node_rank="${NODE_RANK:-${SLURM_NODEID:-0}}"
gpus="$(count_gpus)"
nproc="${NPROC_PER_NODE:-$gpus}"
if [[ -z "$nproc" || "$nproc" == 0 ]]; then
  nproc=1
fi
rdzv_id="${RDZV_ID:-${SLURM_JOB_ID:-mhar-titan}}"
python="$(python_for "$repo")"
train_script="${TRAIN_SCRIPT:-$repo/train.py}"

for name in nnodes node_rank nproc; do
  if ! [[ "${!name}" =~ ^[0-9]+$ ]]; then
    echo "$0: $name must be a non-negative integer, got '${!name}'" >&2
    exit 2
  fi
done

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  device=cuda
  if [[ -z "$gpus" || "$gpus" == 0 ]]; then
    device=cpu
  fi
  exec "$python" -m mhar_titan.dryrun --config "$config" --world-size "$((nnodes * nproc))" \
    --device "$device" "$@"
fi

# torchrun reads the grace period from this variable since pytorch#172596 (early 2026);
# older versions always give workers 30 s.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${SHUTDOWN_TIMEOUT:-${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}}"

rdzv_endpoint="${RDZV_ENDPOINT:?RDZV_ENDPOINT (host:port of the rendezvous, the first node) is not set}"
cmd=(
  "$python" -m mhar_titan.torchrun
  --nnodes="$nnodes"
  --node_rank="$node_rank"
  --nproc_per_node="$nproc"
  --rdzv_backend=c10d
  --rdzv_endpoint="$rdzv_endpoint"
  --rdzv_id="$rdzv_id"
  --max_restarts=0
  --role=rank
  --tee=3
)
if [[ -n "${TORCHRUN_LOG_DIR:-}" ]]; then
  cmd+=(--log-dir="$TORCHRUN_LOG_DIR")
fi
cmd+=("$train_script" --config "$config" "$@")

printf '[%s node_rank=%s]' "$(hostname -s)" "$node_rank" >&2
printf ' %q' "${cmd[@]}" >&2
echo >&2
if [[ "${PRINT_CMD:-0}" == 1 ]]; then
  exit 0
fi
exec "${cmd[@]}"

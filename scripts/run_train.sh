#!/usr/bin/env bash
# Single-node launcher: torchrun with NGPU workers on this machine.
#
#   NGPU=8 CONFIG=train_configs/mhar_1b.toml scripts/run_train.sh [--section.key=value ...]
#   DRY_RUN=1 NGPU=8 CONFIG=train_configs/mhar_1b.toml scripts/run_train.sh
#
#   CONFIG     TOML job file            (default: train_configs/debug_mhar.toml)
#   NGPU       worker processes         (default: the GPUs visible here, counted by count_gpus
#              in slurm/lib.sh; 1 without GPUs)
#   LOG_RANK   ranks whose output is shown, comma-separated (default: all; ranks other than 0 print
#              only errors, and a user's error only where it differs from rank 0's: mhar_titan/say_once.py)
#   PYTHON     interpreter with torch   (default: <repo>/.venv/bin/python if present, else python3)
#   DRY_RUN=1  do not train: build the model on the meta device, validate the whole config
#              for NGPU ranks, print parameter counts, a memory estimate and the resolved
#              config, and exit (python -m mhar_titan.dryrun; no data, no network, no GPU).
#
# Overrides after the script name are passed to train.py unchanged. For several nodes use
# slurm/train.sbatch (or slurm/torchrun_node.sh on each node).
#
# Exit code: the trainer's own (0 after training or a clean preemption save, 2 for bad input:
# its one line, without torchrun's traceback (python -m mhar_titan.torchrun, the torchrun it
# runs), 1 for a health stop), read from the exit status it writes (mhar_titan/exit_status.py),
# since torchrun exits 1 after a SIGTERM even when every worker saved and exited 0; torchrun's
# exit code when the trainer wrote no status (a crash). SIGTERM or SIGUSR1 sent to this script
# is passed to torchrun as SIGTERM (workers finish the step, save and exit); Ctrl-C reaches the
# workers directly.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
# shellcheck source=slurm/lib.sh
source "$repo/slurm/lib.sh"

config="${CONFIG:-train_configs/debug_mhar.toml}"
python="$(python_for "$repo")"
if [[ -z "${NGPU:-}" ]]; then
  NGPU="$(count_gpus)"
  if [[ -z "$NGPU" || "$NGPU" == 0 ]]; then
    NGPU=1
  fi
fi
if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
  echo "$0: NGPU must be a positive integer, got '$NGPU'" >&2
  exit 2
fi

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  exec "$python" -m mhar_titan.dryrun --config "$config" --world-size "$NGPU" "$@"
fi

export PYTORCH_ALLOC_CONF="${PYTORCH_ALLOC_CONF:-expandable_segments:True}"
MHAR_EXIT_STATUS_FILE="$(mktemp "${TMPDIR:-/tmp}/mhar-exit-status.XXXXXX")"
export MHAR_EXIT_STATUS_FILE
rm -f "$MHAR_EXIT_STATUS_FILE"
trap 'rm -f "$MHAR_EXIT_STATUS_FILE"' EXIT
ranks_filter=()
if [[ -n "${LOG_RANK:-}" ]]; then
  ranks_filter=(--local-ranks-filter="$LOG_RANK")
fi
"$python" -m mhar_titan.torchrun \
  --nnodes=1 --nproc_per_node="$NGPU" \
  --rdzv_backend=c10d --rdzv_endpoint=localhost:0 \
  ${ranks_filter[@]+"${ranks_filter[@]}"} --role=rank --tee=3 \
  train.py --config "$config" "$@" &
child=$!
# shellcheck disable=SC2317  # called by the traps
forward_term() { kill -TERM "$child" 2>/dev/null || true; }
# shellcheck disable=SC2317
ctrl_c() { :; }  # the terminal sent Ctrl-C to torchrun and the workers too
trap forward_term TERM USR1
trap ctrl_c INT
rc=0
while kill -0 "$child" 2>/dev/null; do
  wait "$child" || true  # returns early when a trapped signal arrives
done
wait "$child" || rc=$?
status="$(exit_status_field "$MHAR_EXIT_STATUS_FILE" status)"
case "$status" in
  completed | preempted) exit 0 ;;
  bad_input) exit 2 ;;
  health) exit 1 ;;
  *) exit "$rc" ;;
esac

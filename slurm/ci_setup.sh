#!/usr/bin/env bash
# Installs what the launch tests need on a Debian/Ubuntu CI runner (as root): the
# linter shellcheck (for slurm/ and scripts/), slurm-wlm and munge (a one-node SLURM cluster that
# tests/test_slurm_requeue.py starts and stops itself; no service is enabled here).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends shellcheck slurm-wlm munge

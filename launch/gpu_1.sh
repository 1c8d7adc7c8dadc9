#!/usr/bin/env bash
# Cluster: 1 GPU, one rank (the tiny recipes, debugging a real recipe with --set overrides).
# Usage: launch/gpu_1.sh [--dry-run] RECIPE CONFIG [train.py args ...]
# Example: launch/gpu_1.sh recipes/tiny_mixtral.yaml ds_configs/zero3.json --steps 300
#   runs deepspeed --num_gpus 1 launch/train.py --config ds_configs/zero3.json --recipe recipes/tiny_mixtral.yaml \
#   --steps 300
NUM_NODES=1
NPROC_PER_NODE=1
# shellcheck source=launch/common.sh
source "$(dirname "$0")/common.sh"
launch_deepspeed "$@"

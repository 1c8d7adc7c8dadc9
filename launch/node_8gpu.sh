#!/usr/bin/env bash
# Cluster: 1 node x 8 GPUs (NVLink), 8 ranks.
# Usage: launch/node_8gpu.sh [--dry-run] RECIPE CONFIG [train.py args ...]
# Example: launch/node_8gpu.sh recipes/dense_1p3b.yaml ds_configs/zero2.json
#   runs deepspeed --num_gpus 8 launch/train.py --config ds_configs/zero2.json --recipe recipes/dense_1p3b.yaml
NUM_NODES=1
NPROC_PER_NODE=8
# shellcheck source=launch/common.sh
source "$(dirname "$0")/common.sh"
launch_deepspeed "$@"

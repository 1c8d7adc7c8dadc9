#!/usr/bin/env bash
# Cluster: this machine's CPUs, NPROC ranks (default 2; 2-4 fit a laptop) over gloo, no GPU used.
# Usage: launch/cpu_local.sh [--dry-run] RECIPE CONFIG [train.py args ...]
# Example: NPROC=4 launch/cpu_local.sh recipes/tiny_mixtral.yaml ds_configs/zero3.json --steps 50
#   runs torchrun --standalone --nnodes 1 --nproc_per_node 4 launch/train.py --config ... --recipe ...
NUM_NODES=1
NPROC_PER_NODE=${NPROC:-2}
# shellcheck source=launch/common.sh
source "$(dirname "$0")/common.sh"
launch_torchrun_cpu "$@"

#!/usr/bin/env bash
# Cluster: 8 nodes x 8 GPUs, 64 ranks, from a DeepSpeed hostfile ("HOST slots=8" per line; the first 8
#   hosts are used). Run it on one of them; it needs passwordless ssh to every host, pdsh, and the repo
#   at the same path on every node. Under SLURM use launch/slurm_8x8.sbatch instead.
# Usage: launch/multinode_8x8.sh [--dry-run] HOSTFILE RECIPE CONFIG [train.py args ...]
# Example: launch/multinode_8x8.sh hostfile recipes/mixtral_8x7b.yaml ds_configs/zero1.json
#   runs deepspeed --hostfile hostfile --num_nodes 8 --num_gpus 8 launch/train.py --config ... --recipe ...
NUM_NODES=8
NPROC_PER_NODE=8
# shellcheck source=launch/common.sh
source "$(dirname "$0")/common.sh"
launch_deepspeed_hostfile "$@"

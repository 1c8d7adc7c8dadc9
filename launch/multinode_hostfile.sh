#!/usr/bin/env bash
# Cluster: 2 nodes x 8 GPUs, 16 ranks, from a DeepSpeed hostfile ("HOST slots=8" per line; the first 2
#   hosts are used); NUM_NODES=N in the environment takes the first N (the 256-node recipes). Run it on
#   one of them; it needs passwordless ssh to every host, pdsh, and the repo at the same path on every node.
# Usage: launch/multinode_hostfile.sh [--dry-run] HOSTFILE RECIPE CONFIG [train.py args ...]
# Example: launch/multinode_hostfile.sh hostfile recipes/switch_base_128.yaml ds_configs/zero2.json
#   runs deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 launch/train.py --config ... --recipe ...
NUM_NODES=${NUM_NODES:-2}
NPROC_PER_NODE=8
# shellcheck source=launch/common.sh
source "$(dirname "$0")/common.sh"
[[ $NUM_NODES =~ ^[1-9][0-9]*$ ]] || die "NUM_NODES ($NUM_NODES) must be a positive integer"
launch_deepspeed_hostfile "$@"

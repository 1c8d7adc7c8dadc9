#!/usr/bin/env bash
# Cluster: 2 nodes x 8 GPUs, 16 ranks, from a DeepSpeed hostfile ("HOST slots=8" per line; the first 2
#   hosts are used). Run it on one of them; it needs passwordless ssh to every host, pdsh, and the repo
#   at the same path on every node.
# Usage: launch/multinode_hostfile.sh [--dry-run] HOSTFILE RECIPE CONFIG [train.py args ...]
# Example: launch/multinode_hostfile.sh hostfile recipes/switch_base_128.yaml ds_configs/zero2.json
#   runs deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 launch/train.py --config ... --recipe ...
NUM_NODES=2
NPROC_PER_NODE=8
# shellcheck source=launch/common.sh
source "$(dirname "$0")/common.sh"
launch_deepspeed_hostfile "$@"

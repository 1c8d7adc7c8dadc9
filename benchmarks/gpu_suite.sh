#!/usr/bin/env bash
# Kept at this path for the commands that name it (the GPU machine's instructions among them):
# runs benchmarks/gpu/gpu_suite.sh with the same arguments, from the repository root.
cd "$(dirname "$0")/.." && exec bash benchmarks/gpu/gpu_suite.sh "$@"

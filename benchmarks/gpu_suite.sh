#!/usr/bin/env bash
# The whole GPU check in one short run, for a one-H200 session of minutes:
#   1. the GPU-marked tests;
#   2. 40 bf16 steps of recipes/dense_1p3b.yaml and of recipes/gpu_mixtral_1b_active.yaml (same
#      active FLOPs per token) on one GPU, both on the same local corpus (Python's standard
#      library: the device machine has no network and dense_1p3b's data path is a placeholder):
#      tokens/s, MFU, peak memory, next to the estimator;
#   3. the MoE layer benchmark against transformers (bf16, cuda), and the end-to-end step of our
#      trainer against transformers' Mixtral (bf16 ZeRO-1, benchmarks/end_to_end.py);
#   4. 30 fp16 steps with dynamic loss scaling (ds_configs/fp16.json);
#   5. an NCCL all-reduce/all-to-all check on the GPU (one rank per GPU present);
#   6. the device contract: 2 ranks on the one GPU over gloo bound to CUDA (parallel.backend=cuda:gloo).
# Figures go to $OUT/gpu_figures.md (copy them into docs/PERFORMANCE.md with the date and GPU).
# Needs a Python with a CUDA torch, deepspeed and requirements.txt installed (the device machine
# cannot reach a package index: carry an environment, or pip install from a carried wheel dir).
# Usage: OUT=out bash benchmarks/gpu_suite.sh [STEPS]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; STEPS=${1:-40}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python -m pytest -q -m gpu tests 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
DATA=(data.source=stdlib data.max_bytes=32000000 tokenizer.train_bytes=8000000)
for recipe in dense_1p3b gpu_mixtral_1b_active; do
  mkdir -p "$OUT/runs/$recipe"
  python launch/train.py --config ds_configs/zero1.json --recipe "recipes/$recipe.yaml" \
    --steps "$STEPS" --run-dir "$OUT/runs/$recipe" --set train.log_every=10 eval.every=0 "${DATA[@]}" \
    2>&1 | grep -v Warning | tail -6
  python launch/estimate_memory.py --recipe "recipes/$recipe.yaml" --config ds_configs/zero1.json \
    --gpus 1 --gpu h200-141gb --json > "$OUT/runs/$recipe/estimate.json"
done
python benchmarks/moe_layer.py --device cuda --dtype bf16 --json "$OUT/moe_layer.json" | tee "$OUT/moe_layer.md"
python benchmarks/end_to_end.py --config ds_configs/zero1.json --steps 22 2>&1 | grep -v Warning \
  | tee "$OUT/end_to_end.md"
python launch/train.py --config ds_configs/fp16.json --steps 30 --run-dir "$OUT/runs/fp16" \
  --set train.log_every=10 eval.every=0 2>&1 | grep -v Warning | tail -4
python -m torch.distributed.run --nproc_per_node "$(nvidia-smi -L | wc -l)" benchmarks/nccl_check.py \
  | tee "$OUT/nccl.txt"
# The device contract with 2 ranks on this one GPU: gloo bound to CUDA only (parallel.backend
# cuda:gloo) refuses a CPU tensor in any collective, as NCCL does; data parallel 2 with fp32 ZeRO-0
# clipping and an evaluation. Each rank is started by hand with LOCAL_RANK 0 (both use GPU 0).
pids=()
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 \
    python launch/train.py --config ds_configs/zero0_fp32.json --recipe recipes/tiny_mixtral.yaml \
    --steps 4 --run-dir "$OUT/runs/device_contract" --set parallel.backend=cuda:gloo eval.every=4 \
    train.log_every=2 > "$OUT/device_contract.rank$r.log" 2>&1 &
  pids+=($!)
done
if wait "${pids[0]}" && wait "${pids[1]}"; then
  echo "device contract (cuda:gloo, 2 ranks): OK" | tee "$OUT/device_contract.txt"
else
  echo "device contract (cuda:gloo, 2 ranks): FAILED" | tee "$OUT/device_contract.txt"
  tail -20 "$OUT"/device_contract.rank*.log
fi
python benchmarks/gpu_figures.py "$OUT" | tee "$OUT/gpu_figures.md"

#!/usr/bin/env bash
# The GPU day: what this repo measures on one lent H200, sized to that machine as it is (see
# docs/performance/gpu-suite.md, "The GPU suite"): Python 3.12 with torch, transformers, tokenizers and the
# rest of its image, but no deepspeed, pydantic, hjson, wandb or datasets, no package index, a
# 10-minute limit per command, at most 8 files back from $OUT, 2 folders deep.
#
# Here, before the GPU session (CPU; a minute):
#   bash benchmarks/gpu_suite.sh --prepare     # .gpu-wheels/ (the kit) and .gpu-cache/ (tokenizers, prepared data)
#   (--prepare --python-version 3.11: the kit for another Python, as the rehearsal makes it)
# On the device, two commands on one warm machine (both carry .gpu-wheels and .gpu-cache):
#   bash benchmarks/gpu_suite.sh --part 1      # kit install, device contract, dense, MoE, microbench: <= 6 min
#   bash benchmarks/gpu_suite.sh --part 2      # MoE layer, end to end, compile, NCCL check, overlap_comm, gpu tests: <= 5 min
# Here, the rehearsal (CI runs it: tests/benchmarks/gpu/test_gpu_suite.py):
#   bash benchmarks/gpu_suite.sh --rehearsal   # both parts on this CPU, tiny sizes, in an emulated image
#
# Every step runs under its own time cap (part 1's caps sum to 330 s, part 2's to 255 s, each part
# has 30 s more for the kit's install) and appends its section to $OUT/summary.md as it finishes,
# so a kill keeps what was done. $OUT holds summary.md, part1.log, part2.log and nothing else; run
# directories live under $GPU_SUITE_WORK (default /tmp/gpu_suite), no checkpoint is saved
# (train.save_every=0), W&B is off, and the tokenizers and prepared data come from .gpu-cache,
# made here. No DeepSpeed op is JIT-built: every ds_configs JSON uses torch's AdamW.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

# The device image's Python packages (the device tool's KINDS.md, read 2026-11-17), by the names
# pip gives them; the rehearsal's emulated image holds those of them installed here, and no other.
IMAGE_PACKAGES="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions
nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp"

# Steps of each part, in order of value: name:cap_seconds.
PART1="device_contract:50 dense:110 moe:150 gpu_microbench:20"
PART2="moe_layer:30 end_to_end:60 compile:60 nccl_check:20 overlap_comm:45 gpu_tests:40"
KIT_CAP=30
# The summary's section titles, which the rehearsal checks.
declare -A TITLE=([device_contract]="device contract" [dense]="dense" [moe]="MoE" [moe_layer]="MoE layer"
                  [end_to_end]="end to end" [compile]="compile" [nccl_check]="NCCL check" [overlap_comm]="overlap_comm"
                  [gpu_tests]="gpu tests" [gpu_microbench]="GPU microbench")

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
PY=${GPU_SUITE_PYTHON:-python3}
SIZE=${GPU_SUITE_SIZE:-gpu}               # gpu | tiny (the rehearsal)
KIT=${GPU_SUITE_KIT:-$ROOT/.gpu-wheels}
CACHE=${GPU_SUITE_CACHE:-$ROOT/.gpu-cache}
WORK=${GPU_SUITE_WORK:-/tmp/gpu_suite}
SITE=${GPU_SUITE_SITE:-/tmp/site}
OUT=${OUT:-$ROOT/gpu_out}

die() { echo "error: gpu_suite.sh: $*" >&2; exit 2; }

caps_sum() { local s=0 x; for x in $1; do s=$((s + ${x#*:})); done; echo $s; }

# ---------------------------------------------------------------------------------------------
# The steps. Each runs in a child (bash gpu_suite.sh --step NAME) under `timeout`, writes its log
# to stdout and its figures (markdown) to $FIG.

if [ "$SIZE" = gpu ]; then
  DENSE=recipes/dense_1p3b.yaml MOE=recipes/gpu_mixtral_1b_active.yaml
  DS=ds_configs/zero1.json STEPS=30 WARMUP=10 BIG_VOCAB=50304 BACKEND=cuda:gloo
  MOE_LAYER_ARGS="--device cuda --dtype bf16 --experts 8,64 --repeats 3"
  E2E_ARGS="--config ds_configs/zero1.json --sizes mid --steps 12"
  NCCL_ARGS="--nproc_per_node $(nvidia-smi -L 2>/dev/null | wc -l)"
  MICROBENCH_ARGS="--device cuda --size gpu --budget-s 14"
else
  DENSE=recipes/tiny_dense.yaml MOE=recipes/tiny_mixtral.yaml
  DS=ds_configs/zero1_fp32.json STEPS=3 WARMUP=1 BIG_VOCAB=4096 BACKEND=gloo
  MOE_LAYER_ARGS="--device cpu --tokens 128 --hidden 64 --ffn 64 --experts 4 --iters 1 --repeats 1 --warmup 0"
  E2E_ARGS="--config ds_configs/zero1_fp32.json --sizes tiny --steps 3 --warmup 1"
  NCCL_ARGS="--nproc_per_node 2"
  MICROBENCH_ARGS="--device cpu --size tiny --budget-s 6"
fi
# Prepared data and tokenizer for a recipe's vocabulary (made by --prepare).
data_sets() { echo "data.source=$CACHE/data$1/stdlib_text_document tokenizer.path=$CACHE/tok$1"; }
COMMON_SETS="eval.every=0 train.save_every=0 tracking.wandb=false"

free_port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

step_device_contract() {
  # 2 ranks on the one GPU, both LOCAL_RANK 0, over gloo bound to CUDA only (parallel.backend
  # cuda:gloo), which refuses a CPU tensor in any collective, as NCCL does: data parallel 2, fp32
  # ZeRO-0 with clipping and an evaluation. (The rehearsal runs plain gloo on the CPU.)
  local run=$WORK/runs/device_contract port pids=() r ok=1 threads=()
  port=$(free_port)
  rm -rf "$run"
  [ "$SIZE" = gpu ] || threads=(OMP_NUM_THREADS=1)    # two ranks on the rehearsal's cores
  for r in 0 1; do
    env "${threads[@]}" RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port "$PY" launch/train.py --config ds_configs/zero0_fp32.json \
      --recipe recipes/tiny_mixtral.yaml --steps 3 --run-dir "$run" --set parallel.backend=$BACKEND \
      parallel.timeout_minutes=2 eval.every=3 eval.batches=2 train.log_every=1 train.save_every=0 \
      tracking.wandb=false $(data_sets 4096) \
      > "$WORK/device_contract.rank$r.log" 2>&1 &
    pids+=($!)
  done
  for r in 0 1; do wait "${pids[$r]}" || ok=0; done
  for r in 0 1; do sed "s/^/rank $r: /" "$WORK/device_contract.rank$r.log" | tail -8; done
  if [ $ok = 1 ]; then
    echo "held: 2 ranks, parallel.backend=$BACKEND, 3 steps and an evaluation, no CPU tensor in a collective" >> "$FIG"
    "$PY" -m benchmarks.gpu.gpu_figures "$run" --warmup 0 >> "$FIG"
  else
    echo "FAILED: a rank exited non-zero (logs in part1.log)" >> "$FIG"
    return 1
  fi
}

train_recipe() {   # NAME RECIPE: bf16 steps of a recipe on one GPU, then its figures beside the estimator
  local name=$1 recipe=$2 run=$WORK/runs/$1 estimate
  rm -rf "$run" && mkdir -p "$WORK/runs"
  # The estimate (host work) while the run trains.
  "$PY" launch/estimate_memory.py --recipe "$recipe" --config "$DS" --gpus 1 --gpu h200-141gb --json \
    > "$WORK/$name.estimate.json" &
  estimate=$!
  "$PY" launch/train.py --config "$DS" --recipe "$recipe" --steps "$STEPS" --run-dir "$run" \
    --set train.log_every=5 $COMMON_SETS $(data_sets $BIG_VOCAB) ${GPU_SUITE_SETS:-} || { wait $estimate; return 1; }
  wait $estimate || return 1
  {
    echo "\`launch/train.py --config $DS --recipe $recipe --steps $STEPS\` (estimator: \`--gpus 1 --gpu h200-141gb\`)"
    echo
    "$PY" -m benchmarks.gpu.gpu_figures "$run" --estimate "$WORK/$name.estimate.json" --warmup "$WARMUP"
  } >> "$FIG"
}
step_dense() { train_recipe dense "$DENSE"; }
step_moe() { train_recipe moe "$MOE"; }

step_gpu_microbench() {
  # Matmul TFLOP/s by dtype (fp32, tf32, bf16, fp16, fp8) and copy/add bandwidth beside the
  # datasheet peaks; --budget-s skips what would end past the cap (docs/gpu.md).
  "$PY" -m benchmarks.gpu.gpu_microbench $MICROBENCH_ARGS --json "$WORK/gpu_microbench.json" | tee -a "$FIG"
  return "${PIPESTATUS[0]}"
}

step_moe_layer() {
  # Our MoELayer against transformers' Mixtral block (grouped GEMM), forward+backward.
  "$PY" -m benchmarks.peers.moe_layer $MOE_LAYER_ARGS --json "$WORK/moe_layer.json" | tee -a "$FIG"
}

step_end_to_end() {
  # Our trainer's step against transformers' Mixtral in the same DeepSpeed JSON.
  "$PY" -m benchmarks.peers.end_to_end $E2E_ARGS 2>&1 | grep -v Warning | tee -a "$FIG"
}

step_compile() {
  # train.compile on against off, the same model and tokens (benchmarks/peers/end_to_end.py --compile).
  "$PY" -m benchmarks.peers.end_to_end $E2E_ARGS --compile 2>&1 | grep -v Warning | tee -a "$FIG"
}

step_nccl_check() {
  local extra=()
  [ "$SIZE" = gpu ] || extra=(--backend gloo --device cpu --mb 16)
  "$PY" -m torch.distributed.run --standalone $NCCL_ARGS -m benchmarks.gpu.nccl_check --sweep "${extra[@]}" \
    | tee -a "$FIG"
}

step_overlap_comm() {
  # DeepSpeed's overlap_comm on and off at ZeRO 1 and 2, 2 ranks on the one GPU over gloo bound to
  # CUDA (NCCL refuses two ranks on one GPU), one launch running the four trainings.
  local port pids=() r ok=1 threads=() args
  port=$(free_port)
  if [ "$SIZE" = gpu ]; then
    args="--recipe recipes/dense_125m.yaml --config ds_configs/zero1.json --steps 8 --warmup 3"
  else
    args="--recipe recipes/tiny_dense.yaml --config ds_configs/zero1_fp32.json --steps 2 --warmup 1"
    threads=(OMP_NUM_THREADS=1)
  fi
  for r in 0 1; do
    env "${threads[@]}" RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port "$PY" -m benchmarks.systems.overlap_comm --backend $BACKEND $args \
      --set $(data_sets $BIG_VOCAB) > "$WORK/overlap_comm.rank$r.log" 2>&1 &
    pids+=($!)
  done
  for r in 0 1; do wait "${pids[$r]}" || ok=0; done
  if [ $ok = 1 ]; then
    sed -n '/^`overlap_comm`/,$p' "$WORK/overlap_comm.rank0.log" | tee -a "$FIG"
  else
    tail -20 "$WORK/overlap_comm.rank0.log" "$WORK/overlap_comm.rank1.log"
    echo "FAILED: a rank exited non-zero (logs in part2.log)" >> "$FIG"
    return 1
  fi
}

step_gpu_tests() {
  "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/model/test_moe.py \
    tests/model/test_document_masking.py 2>&1 | tail -15 | tee -a "$FIG"
  return "${PIPESTATUS[0]}"
}

# ---------------------------------------------------------------------------------------------

step_kit() {
  # The kit into $SITE with pip's offline line; skipped when this kit is already there.
  compgen -G "$KIT/*.whl" >/dev/null || die "no wheels in $KIT: run bash benchmarks/gpu_suite.sh --prepare here first"
  local stamp
  stamp=$(ls "$KIT"/*.whl | xargs -n1 basename | sort | tr '\n' ' ')
  if [ "$(cat "$SITE/.kit" 2>/dev/null)" != "$stamp" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$KIT"/*.whl || return 1
    echo "$stamp" > "$SITE/.kit"
  fi
  "$PY" -c "import deepspeed, pydantic, hjson; print('kit: deepspeed', deepspeed.__version__, 'pydantic', pydantic.VERSION)"
}

run_part() {
  local part=$1 steps t0=$SECONDS log
  [ "$part" = 1 ] && steps=$PART1 || steps=$PART2
  mkdir -p "$OUT" "$WORK" || die "cannot create $OUT or $WORK"
  log=$OUT/part$part.log
  : > "$log"
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  if [ "$part" = 1 ] || [ ! -f "$OUT/summary.md" ]; then
    {
      echo "# GPU suite ($SIZE sizes), $(date -u '+%Y-%m-%d %H:%M UTC')"
      echo
      if command -v nvidia-smi >/dev/null; then
        echo "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
      else
        echo "GPU: none (CPU rehearsal)"
      fi
      echo "Python $("$PY" -c 'import sys; print(sys.version.split()[0])'), torch $("$PY" -c 'import torch; print(torch.__version__)')"
      echo
    } > "$OUT/summary.md"
  fi
  timeout -k 5 $KIT_CAP bash "$0" --step kit >> "$log" 2>&1 \
    || { echo "## part $part: kit install FAILED (see part$part.log)" >> "$OUT/summary.md"; tail -20 "$log"; return 1; }
  local failed=0 x name cap s0 rc status
  for x in $steps; do
    name=${x%%:*} cap=${x#*:} s0=$SECONDS
    export FIG=$WORK/$name.fig.md
    : > "$FIG"
    echo "=== $name (cap $cap s)" >> "$log"
    timeout -k 5 "$cap" bash "$0" --step "$name" >> "$log" 2>&1
    rc=$?
    case $rc in
      0) status=ok ;;
      124|137) status="TIMED OUT at its cap"; failed=1 ;;
      *) status="FAILED (exit $rc)"; failed=1 ;;
    esac
    {
      echo "## ${TITLE[$name]}"
      echo
      echo "status: $status, $((SECONDS - s0)) s of a $cap s cap"
      echo
      cat "$FIG"
      if [ "$status" != ok ]; then
        echo; echo '```'; sed -n "/^=== $name /,\$p" "$log" | tail -15; echo '```'
      fi
      echo
    } >> "$OUT/summary.md"
    echo "$name: $status ($((SECONDS - s0)) s)"
  done
  echo "part $part: $((SECONDS - t0)) s in all" | tee -a "$OUT/summary.md"
  return $failed
}

prepare() {
  # Here: the kit for the device's Python and the cache the suite reads (tokenizers trained and
  # data prepared on this CPU, so the GPU's minutes go to the GPU).
  local pyver=${1:-3.12} vocab
  bash benchmarks/gpu_kit.sh --python-version "$pyver" --dest "$KIT" || return 1
  for vocab in $(printf '%s\n' 4096 $BIG_VOCAB | sort -u); do
    [ -d "$CACHE/tok$vocab" ] || python launch/prepare_data.py --input stdlib --train-tokenizer "$CACHE/tok$vocab" \
      --vocab-size "$vocab" --sample-bytes 4000000 --no-progress || return 1
    [ -f "$CACHE/data$vocab/stdlib_text_document.manifest.json" ] || python launch/prepare_data.py --input stdlib \
      --output-prefix "$CACHE/data$vocab/stdlib" --tokenizer "$CACHE/tok$vocab" --append-eod \
      --max-bytes 4000000 --no-progress || return 1
  done
  local kb
  kb=$(( $(du -sk "$KIT" | cut -f1) + $(du -sk "$CACHE" | cut -f1) + $(git ls-files -z | du -ck --files0-from=- | tail -1 | cut -f1) ))
  [ $kb -le $((64 * 1024)) ] || die "the tree, kit and cache are ${kb} KiB, over the 64 MiB the device tool carries"
  echo "prepared: $KIT and $CACHE; with the tree ${kb} KiB of the 64 MiB the device tool carries"
}

rehearsal() {
  # Both parts on this CPU at tiny sizes, in a fresh venv that sees only torch and the packages of
  # the device image installed here (benchmarks/gpu/device_image.py), with a kit built by gpu_kit.sh
  # for this machine's Python and installed by the same --no-index line.
  local r=${GPU_SUITE_REHEARSAL_DIR:-$(mktemp -d /tmp/gpu_rehearsal.XXXXXX)} t0=$SECONDS pyver
  pyver=$(python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  export GPU_SUITE_SIZE=tiny GPU_SUITE_KIT=$r/kit GPU_SUITE_CACHE=$r/cache GPU_SUITE_WORK=$r/work \
         GPU_SUITE_SITE=$r/site OUT=$r/out GPU_SUITE_PYTHON=$r/venv/bin/python
  rm -rf "$r/out" "$r/work" "$r/site"
  python -m venv --without-pip "$r/venv" || die "python -m venv failed"
  python -m benchmarks.gpu.device_image "$r/venv" $IMAGE_PACKAGES || die "building the emulated image failed"
  "$GPU_SUITE_PYTHON" -c "import deepspeed" 2>/dev/null && die "the emulated image has deepspeed: it must not"
  "$GPU_SUITE_PYTHON" -c "import torch, transformers, tokenizers" || die "the emulated image lacks torch/transformers/tokenizers"
  # Made in one folder, then moved: the device finds the cache under another root than here.
  GPU_SUITE_CACHE=$r/cache.made bash "$0" --prepare --python-version "$pyver" || die "preparing the kit and cache failed"
  rm -rf "$r/cache" && mv "$r/cache.made" "$r/cache"
  local part rc=0
  for part in 1 2; do bash "$0" --part $part || rc=1; done
  # The checks: every step ok, every section there, the caps and $OUT's file limits hold.
  local bad=0 x name f
  for x in $PART1 $PART2; do
    name=${x%%:*}
    grep -q "^## ${TITLE[$name]}\$" "$OUT/summary.md" || { echo "rehearsal: no section '${TITLE[$name]}'"; bad=1; }
  done
  grep -q "^status: " "$OUT/summary.md" && ! grep "^status: " "$OUT/summary.md" | grep -vq "^status: ok," \
    || { echo "rehearsal: a step did not finish ok"; bad=1; }
  [ "$(caps_sum "$PART1")" -le 330 ] || { echo "rehearsal: part 1's caps sum to $(caps_sum "$PART1") s, over 330"; bad=1; }
  [ "$(caps_sum "$PART2")" -le 255 ] || { echo "rehearsal: part 2's caps sum to $(caps_sum "$PART2") s, over 255"; bad=1; }
  local n deep
  n=$(find "$OUT" -type f | wc -l) deep=$(find "$OUT" -mindepth 3 -type f | wc -l)
  [ "$n" -le 8 ] && [ "$deep" = 0 ] || { echo "rehearsal: $n files in \$OUT ($deep deeper than 2 folders); at most 8"; bad=1; }
  for f in $(find "$OUT" -type f); do
    [[ "$(basename "$f")" =~ ^[A-Za-z0-9._-]+$ ]] || { echo "rehearsal: $f: a name the device tool does not return"; bad=1; }
  done
  cat "$OUT/summary.md"
  if [ $rc = 0 ] && [ $bad = 0 ]; then
    echo "rehearsal: ok, both parts, every section, caps $(caps_sum "$PART1") s + $(caps_sum "$PART2") s, $n files in \$OUT, $((SECONDS - t0)) s in all ($r)"
  else
    echo "rehearsal: FAILED ($r)"; return 1
  fi
}

case "${1:-}" in
  --part) [ "${2:-}" = 1 ] || [ "${2:-}" = 2 ] || die "--part takes 1 or 2"; run_part "$2" ;;
  --step) [ -n "${2:-}" ] && declare -F "step_$2" >/dev/null || die "--step: no step ${2:-}"; FIG=${FIG:-/dev/null}; "step_$2" ;;
  --prepare) [ "${2:-}" != --python-version ] || [ -n "${3:-}" ] || die "--python-version takes X.Y"
             prepare "${3:-3.12}" ;;
  --rehearsal) rehearsal ;;
  *) sed -n 2,21p "$0"; exit 2 ;;
esac

#!/usr/bin/env bash
# The wheel kit for the GPU machine: the Python packages the GPU path imports that the device
# image lacks (DeepSpeed and what it needs beyond the image), one version of each, for the
# device's Python, in .gpu-wheels/ (git-ignored; the device tool carries it).
#
#   bash benchmarks/gpu_kit.sh                      # for the device image's Python 3.12
#   bash benchmarks/gpu_kit.sh --python-version 3.11 --dest DIR   # for this machine (the rehearsal)
#
# The image has torch, transformers, tokenizers, safetensors, pyarrow, numpy, pyyaml, einops,
# msgpack, ninja, psutil, py-cpuinfo, tqdm, packaging, nvidia-ml-py, typing-extensions and pytest
# (the package list IMAGE_PACKAGES in benchmarks/gpu/gpu_suite.sh). It lacks
# deepspeed, hjson and pydantic (with pydantic-core, annotated-types, typing-inspection), and
# wandb and datasets, which the suite does not need: every import of them is lazy and it runs
# with W&B off on prepared data. DeepSpeed is published as source only: its wheel is built here
# with no ops prebuilt (DS_BUILD_OPS=0); the suite uses torch's AdamW ("torch_adam": true in
# every ds_configs JSON), so no DeepSpeed op is JIT-built on the GPU. Versions follow the ones
# installed here (requirements.txt's ranges), so the GPU runs what CI tests.
#
# Installed on the device (and in the rehearsal) with pip's offline line:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .gpu-wheels/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/../.."
PYVER=3.12 DEST=.gpu-wheels
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYVER=$2; shift 2 ;;
    --dest) DEST=$2; shift 2 ;;
    -h|--help) sed -n 2,20p "$0"; exit 0 ;;
    *) echo "error: gpu_kit.sh: unknown argument $1 (use --python-version X.Y, --dest DIR)" >&2; exit 2 ;;
  esac
done
case "$PYVER" in 3.[0-9]|3.[0-9][0-9]) ;; *) echo "error: --python-version: $PYVER is not X.Y, e.g. 3.12" >&2; exit 2 ;; esac

version() {   # the version installed here, else requirements.txt's floor is not enough: refuse
  python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null \
    || { echo "error: gpu_kit.sh: $1 is not installed here; run pip install -r requirements.txt first" >&2; exit 2; }
}
DS=$(version deepspeed) PYD=$(version pydantic) CORE=$(version pydantic_core)
HJSON=$(version hjson) ANN=$(version annotated_types) INSP=$(version typing_inspection)
mkdir -p "$DEST"
want=("deepspeed-$DS" "hjson-$HJSON" "pydantic-$PYD" "pydantic_core-$CORE" "annotated_types-$ANN"
      "typing_inspection-$INSP")
tag="cp${PYVER/./}"
have_all=1
for w in "${want[@]}"; do
  compgen -G "$DEST/$w-*.whl" >/dev/null || have_all=0
done
if [ "$have_all" = 1 ] && compgen -G "$DEST/pydantic_core-$CORE-$tag-*.whl" >/dev/null; then
  echo "gpu kit: $DEST is complete for Python $PYVER ($(du -sh "$DEST" | cut -f1))"
  exit 0
fi
rm -f "$DEST"/*.whl
started=$SECONDS
# Binary wheels for the target Python and manylinux x86_64 (pydantic-core is the only compiled one).
python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "hjson==$HJSON" "pydantic==$PYD" "pydantic-core==$CORE" "annotated-types==$ANN" \
  "typing-inspection==$INSP" 2>&1 | { grep -v "is ignored" || true; }
# DeepSpeed: its source distribution, built into a pure-Python wheel against this machine's torch
# (no build isolation: an isolated build would fetch a CUDA torch), no ops compiled; one pip call
# (a separate download would run its setup.py, importing torch, once more).
log=$(mktemp)
trap 'rm -f "$log"' EXIT
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation --no-binary=deepspeed -w "$DEST" \
  "deepspeed==$DS" > "$log" 2>&1 \
  || { grep -v "is ignored" "$log" | tail -20 >&2; echo "error: gpu_kit.sh: building the deepspeed wheel failed" >&2; exit 1; }
for w in "${want[@]}"; do
  compgen -G "$DEST/$w-*.whl" >/dev/null || { echo "error: gpu_kit.sh: no wheel $w in $DEST" >&2; exit 1; }
done
n=$(ls "$DEST"/*.whl | wc -l)
[ "$n" = "${#want[@]}" ] || { echo "error: gpu_kit.sh: $n wheels in $DEST, expected ${#want[@]} (one version of each)" >&2; exit 1; }
size_kb=$(du -sk "$DEST" | cut -f1)
[ "$size_kb" -le $((40 * 1024)) ] || { echo "error: gpu_kit.sh: the kit is ${size_kb} KiB, over 40 MiB" >&2; exit 1; }
echo "gpu kit: $n wheels for Python $PYVER in $DEST, ${size_kb} KiB, $((SECONDS - started)) s"
ls "$DEST"

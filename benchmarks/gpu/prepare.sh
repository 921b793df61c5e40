#!/usr/bin/env bash
# Collect, as wheels in .whl/ at the repository root (git-ignored), the Python packages the prepared GPU run
# (benchmarks/gpu/run.sh) needs and a bare CUDA machine with torch lacks: pydantic and its own needs (the machine has
# torch, transformers, accelerate, safetensors, huggingface_hub, click, rich, tqdm, matplotlib, pyyaml, numpy,
# tokenizers). The run reads only pydoc text and local files, so datasets, gguf and the embedded checkpoints are
# not needed (run.sh --cpu proves it: it blocks their imports). Needs pip and PyPI; at most 40 MB in all.
#
#   bash benchmarks/gpu/prepare.sh            # then carry .whl to the GPU machine and run benchmarks/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
WHL=.whl
LIMIT_BYTES=$((40 * 1024 * 1024))
# one version of each, cp312 / manylinux x86_64 (the GPU machine: Python 3.12, x86-64)
PACKAGES=(
  "pydantic==2.13.4"
  "pydantic-core==2.46.4"
  "annotated-types==0.7.0"
  "typing-inspection==0.4.2"
  "typing-extensions==4.15.0"
)
PYTHON=${PYTHON:-python3}
mkdir -p "$WHL"
rm -f "$WHL"/*.whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHL" "${PACKAGES[@]}"
count=$(ls "$WHL"/*.whl | wc -l)
if [ "$count" -ne "${#PACKAGES[@]}" ]; then
  echo "prepare.sh: expected ${#PACKAGES[@]} wheels in $WHL, found $count" >&2
  exit 1
fi
total=$(cat "$WHL"/*.whl | wc -c)
if [ "$total" -gt "$LIMIT_BYTES" ]; then
  echo "prepare.sh: the wheels in $WHL take $total bytes, over the 40 MB the run may carry" >&2
  exit 1
fi
ls -l "$WHL"
echo "prepare.sh: $count wheels, $total bytes in $WHL; on the GPU machine: bash benchmarks/gpu/run.sh (carry .whl)"

#!/usr/bin/env bash
# The prepared GPU run (issue 38): every step of benchmarks/gpu/steps.py, each in a process of its own with a time
# limit, results in OUT/summary.md and OUT/results.json. At most 9.5 minutes on one H100 (GPU_RUN_BUDGET=seconds
# for less), without network; the wheels that benchmarks/gpu/prepare.sh put in .whl/ are installed first (into
# $GPU_RUN_SITE, default /tmp/site).
#
#   bash benchmarks/gpu/run.sh [--cpu] [--out DIR] [--only STEP,STEP]    (DIR defaults to $OUT)
#
# A GPU session: `bash benchmarks/gpu/prepare.sh` where PyPI is reachable, then on the device machine, carrying
# .whl: `bash benchmarks/gpu/run.sh` (timeout 600 s); $OUT brings back summary.md, results.json and logs.txt.
#
# --cpu: the same steps at tiny shapes on the CPU (FSDP over gloo), importing as if the packages the GPU machine
# lacks were absent; the default test suite runs it (tests/benchmarks/test_gpu_run.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
PYTHON=${PYTHON:-python3}
CPU=()
ONLY=()
DIR=${OUT:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CPU=(--cpu); shift ;;
    --out) DIR=${2:?--out needs a folder}; shift 2 ;;
    --only) ONLY=(--only "${2:?--only needs step names}"); shift 2 ;;
    -h|--help) sed -n 2,13p "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$DIR" ]; then
  echo "run.sh: no output folder: pass --out DIR or set OUT" >&2
  exit 2
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ ${#CPU[@]} -eq 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
  SITE=${GPU_RUN_SITE:-/tmp/site}
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "run.sh: installing .whl/*.whl failed" >&2; exit 1; }
  export PYTHONPATH="$REPO:$SITE${PYTHONPATH#$REPO}"
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu/driver.py run --out "$DIR" "${CPU[@]}" "${ONLY[@]}"

#!/usr/bin/env bash
# The GPU check, on one H100/H200 in at most 8 minutes: the GPU tests (fused kernels against
# float64 in fp32 and bf16, a CUDA run's MFU and peak memory, bit-exact deterministic resume,
# the tier-0 period over NCCL, NCCL's flight record of a stalled collective, NVML against
# nvidia-smi), then the figures (tests/gpu/figures.py). Output: the terminal, and $OUT (or
# /tmp/lazarus-gpu) for the logs and figures.txt. GPU_TESTS=... runs only those tests,
# SKIP_FIGURES=1 skips the figures, FIGURES_ARGS passes arguments to figures.py.
#
# The GPU machine has torch, triton and most of our dependencies, and no package index: the
# wheels it lacks (built for its Python 3.12) travel in tests/gpu/wheels, with etcd's binary
# and TorchTitan's venv's wheels, which tests/gpu/fetch-wheels.sh fills on a machine with one.
# The project goes in with --no-deps.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/lazarus-gpu}
mkdir -p "$OUT"
export LAZARUS_CACHE=${LAZARUS_CACHE:-/tmp/lazarus-cache} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
started=$SECONDS

missing() {  # LIST DIR: the wheels of LIST not in DIR (a wheel's name has _ for - and .)
    tr -d ' ' <"$1" | grep -v '^#' | grep -v '^$' | while read -r w; do
        n=${w%%==*}; ls "$2/${n//[-.]/_}-${w##*==}"-*.whl >/dev/null 2>&1 \
            || ls "$2/$n-${w##*==}"-*.whl >/dev/null 2>&1 || echo "$w"; done
}
missing=$( (missing tests/gpu/wheels.txt tests/gpu/wheels
    missing tests/gpu/titan-wheels.txt tests/gpu/wheels/titan) | tr '\n' ' ')
[ -x tests/gpu/wheels/bin/etcd ] || command -v etcd >/dev/null || missing="$missing etcd"
if [ -n "${missing// /}" ]; then
    echo "run.sh: missing from tests/gpu/wheels: $missing (run tests/gpu/fetch-wheels.sh)" >&2
    exit 2
fi
export PATH=$PATH:$PWD/tests/gpu/wheels/bin
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/lazarus-site \
    tests/gpu/wheels/*.whl || exit 2
export PYTHONPATH=/tmp/lazarus-site${PYTHONPATH:+:$PYTHONPATH}
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv | tee "$OUT/card.txt"

echo "=== GPU tests ==="
$PY -m pytest ${GPU_TESTS:-tests/gpu} -q -p no:cacheprovider -o addopts="" --timeout 150 -rA \
    --durations=10 -s 2>&1 | tee "$OUT/pytest.log"
tests=${PIPESTATUS[0]}

figures=0
if [ -z "${SKIP_FIGURES:-}" ]; then
    echo "=== figures ==="
    $PY tests/gpu/figures.py "$OUT" ${FIGURES_ARGS:-} 2>&1 | tee "$OUT/figures.log"
    figures=${PIPESTATUS[0]}
fi
echo "run.sh: GPU tests exit $tests, figures exit $figures, $((SECONDS - started)) s"
[ "$tests" -eq 0 ] && [ "$figures" -eq 0 ]

#!/usr/bin/env bash
# The one command a lent GPU runs: the device checks and every figure, offline, inside 8 minutes.
#
#   benchmarks/device/run.sh [OUT_DIR] [-- bench_device options]
#
# Runs on the machine's own python3 (SDCGUARD_DEVICE_PYTHON to choose another) with the repository on PYTHONPATH.
# The packages that python lacks (benchmarks/device/wheels.txt) travel as wheels in .whl/ (`./dev device wheels`
# downloads them here) and are installed with --no-index into a folder of their own: nothing is fetched. It checks
# the imports and the GPU first and says exactly what is missing; then benchmarks.bench_device runs, its rows
# streamed, its table and device.json written to OUT_DIR ($OUT, else ./device-out) whatever happens, under two
# watchdogs: the bench's own (SDCGUARD_DEVICE_BUDGET_S, default 420 s: it writes what it has and stops) and
# `timeout` 30 s later. Without a GPU it runs the CPU smoke run (--smoke), which is how the tests keep it working.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
OUT_DIR=${OUT:-device-out}
if [[ $# -gt 0 && $1 != -* ]]; then OUT_DIR=$1; shift; fi
[[ ${1:-} == -- ]] && shift
PY=${SDCGUARD_DEVICE_PYTHON:-python3}
WHEELS=${SDCGUARD_DEVICE_WHEELS:-$ROOT/.whl}
SITE=${SDCGUARD_DEVICE_SITE:-/tmp/sdcguard-device-site}
BUDGET=${SDCGUARD_DEVICE_BUDGET_S:-420}
mkdir -p "$OUT_DIR"
log=$OUT_DIR/log.txt
exec > >(tee -a "$log") 2>&1
echo "device run: $(date -u +%FT%TZ), python $("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1)"

# Offline: pip may look at no index, whatever the environment says.
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$WHEELS"/*.whl; then
        echo "device run: installing the carried wheels from $WHEELS failed (above); nothing ran"
        exit 4
    fi
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# The imports and the device first: one line naming everything that is missing (exit 5); exit 10 without a GPU.
"$PY" - <<'PY'
import importlib, importlib.util, sys
missing = []
for name in ("torch", "pydantic", "pydantic_core"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # an ImportError, or a package that fails on import
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
for name in ("sdcguard.agent", "benchmarks.bench_device"):
    if importlib.util.find_spec(name) is None:
        missing.append(f"{name} (not on PYTHONPATH: run from the repository)")
try:
    import triton
    triton_says = f"triton {triton.__version__}"
except Exception as exc:
    triton_says = f"triton missing ({exc}): the Triton rows fail, the others run"
if missing:
    print("device run: cannot start; missing: " + "; ".join(missing)
          + ". Carry wheels for them in .whl/ (./dev device wheels) or fix the import named.")
    sys.exit(5)
import torch
gpu = torch.cuda.is_available()
print(f"device run: torch {torch.__version__}, {triton_says}, pydantic {importlib.import_module('pydantic').VERSION}, "
      + (f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})" if gpu else "no GPU: the CPU smoke run"))
sys.exit(0 if gpu else 10)
PY
checked=$?
args=("$@")
case $checked in
    0) ;;
    10) args=(--smoke "${args[@]}") ;;
    *) exit "$checked" ;;
esac
SDCGUARD_DEVICE_BUDGET_S=$BUDGET timeout -k 10 $((${BUDGET%.*} + 30)) \
    "$PY" -m benchmarks.bench_device --out "$OUT_DIR" --budget-s "$BUDGET" "${args[@]}"
status=$?
echo "device run: exit $status; files in $OUT_DIR: $(ls "$OUT_DIR" | tr '\n' ' ')"
exit $status

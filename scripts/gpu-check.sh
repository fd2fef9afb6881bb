#!/usr/bin/env bash
# Validates a GPU host in one command (docs/guides/gpu.md): builds the C core and the CUDA library for this host's
# architecture, holds the CUDA library to the C core, runs every CUDA-gated Python test, and times a packed-vs-naive
# training step at 8k and 32k tokens on a Qwen3-0.6B-shaped model in bf16.
#
#   OUT=DIR bash scripts/gpu-check.sh          on a GPU host: no node, no network
#   OUT=DIR bash scripts/gpu-check.sh --dry    on any host: what runs without a device, the rest marked NEEDS-DEVICE
#
# Writes DIR/summary.txt (one line per step: PASS, FAIL or NEEDS-DEVICE, its seconds and figures) and DIR/<step>.log
# (each step's whole output). Exit 0 when no step FAILs. Each step runs under `timeout`, within what is left of the
# whole run's budget (TREEPACK_GPU_CHECK_BUDGET_S, default 540 s: 9 minutes); a step it no longer reaches FAILs.
# Environment: PYTHON (default python3; TREEPACK_PYTHON is taken too) with torch and transformers (and on a GPU host
# CUDA torch and triton), cmake and a C++ compiler; nvcc on a GPU host (PATH, CUDACXX or /usr/local/cuda/bin).
# FLA's pure-Python wheels, where the host lacks the packages, come from .cache/gpu-wheels (scripts/gpu-wheels.sh).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

DRY=0
case "${1:-}" in
  --dry) DRY=1 ;;
  "") ;;
  *) echo "usage: OUT=DIR bash scripts/gpu-check.sh [--dry]" >&2; exit 2 ;;
esac
if [ -z "${OUT:-}" ]; then echo "gpu-check: set OUT to the folder for summary.txt and the logs" >&2; exit 2; fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-${TREEPACK_PYTHON:-python3}}
BUDGET=${TREEPACK_GPU_CHECK_BUDGET_S:-540}
WHEELS=${TREEPACK_GPU_WHEELS:-$ROOT/.cache/gpu-wheels}
# Build outputs and installed wheels stay out of OUT (it is what comes back from a lent machine: keep it small).
WORK=$(mktemp -d "${TMPDIR:-/tmp}/treepack-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
BUILD=$WORK/build
SUMMARY=$OUT/summary.txt
STARTED=$SECONDS
FAILED=0
PASSED=0
NEEDS=0

# The freshly built libraries, and the source tree's treepack (no install needed).
export TREEPACK_CORE_LIB=$BUILD/core/libtreepack_core.so TREEPACK_CUDA_LIB=$BUILD/cuda/libtreepack_cuda.so
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH} PYTHONDONTWRITEBYTECODE=1
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi

line() { # NAME STATUS SECONDS FIGURES
  printf '%-24s %-13s %7s  %s\n' "$1" "$2" "$3" "$4" | tee -a "$SUMMARY"
}

# step NAME LIMIT_S CMD...: runs CMD under timeout (LIMIT_S, or what is left of the budget), its output in
# OUT/NAME.log; the figures are its last "SUMMARY: " line, else its last line.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - (SECONDS - STARTED)))
  if [ "$left" -lt 10 ]; then
    line "$name" FAIL 0 "not started: the ${BUDGET} s budget is spent"
    FAILED=$((FAILED + 1))
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local log=$OUT/$name.log t0=$SECONDS rc
  echo "\$ $*" >"$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  local took=$((SECONDS - t0)) figures
  figures=$(grep '^SUMMARY: ' "$log" | tail -n 1 | sed 's/^SUMMARY: //')
  [ -z "$figures" ] && figures=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-300)
  if [ "$rc" -eq 0 ]; then
    line "$name" PASS "${took}s" "$figures"
    PASSED=$((PASSED + 1))
    return 0
  fi
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then figures="timed out after ${limit} s; $figures"; else figures="exit $rc; $figures"; fi
  line "$name" FAIL "${took}s" "$figures"
  FAILED=$((FAILED + 1))
  return 1
}

needs_device() { # NAME WHAT: a step that only a device runs
  line "$1" NEEDS-DEVICE - "$2"
  NEEDS=$((NEEDS + 1))
}

# device NAME WHAT LIMIT CMD...: a device step; in --dry marked NEEDS-DEVICE, without a device a FAIL.
device() {
  local name=$1 what=$2
  shift 2
  if [ "$DRY" = 1 ]; then needs_device "$name" "$what"; return 0; fi
  if [ -z "$ARCH" ]; then line "$name" FAIL 0 "no CUDA device found (on a CPU host run --dry)"; FAILED=$((FAILED + 1)); return 1; fi
  step "$name" "$@"
}

: >"$SUMMARY"
ARCH=""
DEVICE_NAME="none"
if [ "$DRY" = 0 ]; then
  # The architecture to compile for: nvidia-smi's compute capability, else torch's.
  cap=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null | head -n 1)
  DEVICE_NAME=${cap%,*}
  ARCH=$(echo "${cap##*,}" | tr -d ' .')
  if ! [[ $ARCH =~ ^[0-9]+$ ]]; then
    cap=$("$PY" -c 'import torch; d = torch.cuda.get_device_capability(); print(torch.cuda.get_device_name(), f"{d[0]}{d[1]}", sep="|")' \
      2>/dev/null | tail -n 1)
    DEVICE_NAME=${cap%|*}
    ARCH=${cap##*|}
  fi
  if ! [[ $ARCH =~ ^[0-9]+$ ]]; then ARCH=""; DEVICE_NAME="none found"; fi
fi
{
  mode=$([ "$DRY" = 1 ] && echo "dry run (no device used)" || echo "device: $DEVICE_NAME${ARCH:+, sm_$ARCH}")
  echo "treepack gpu-check, $(date -u '+%Y-%m-%d %H:%M UTC'), $mode"
  echo "commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown), budget ${BUDGET} s; each step's output: <step>.log"
  printf '%-24s %-13s %7s  %s\n' step status seconds figures
} | tee "$SUMMARY"

step env 60 "$PY" - "$DRY" <<'EOF'
import importlib, platform, shutil, subprocess, sys
dry = sys.argv[1] == "1"
found, missing = [f"python {platform.python_version()}"], []
for name in ("torch", "transformers", "numpy", "safetensors") + (() if dry else ("triton",)):
    try:
        found.append(f"{name} {importlib.import_module(name).__version__}")
    except Exception as e:  # noqa: BLE001: any import failure is reported
        missing.append(f"{name} ({e})")
import torch
if not dry:
    found.append(f"cuda {torch.version.cuda}, {torch.cuda.device_count()} device(s)")
    if not torch.cuda.is_available():
        missing.append("a CUDA device torch can use")
for tool in ("cmake",) + (() if dry else ("nvcc",)):
    path = shutil.which(tool) or (shutil.which("/usr/local/cuda/bin/nvcc") if tool == "nvcc" else None)
    if path:
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()
        found.append(next((l for l in out if "release" in l), out[-1]) if tool == "nvcc" else out[0])
    else:
        missing.append(tool)
print("SUMMARY: " + ", ".join(found) + ("; MISSING " + ", ".join(missing) if missing else ""))
sys.exit(1 if missing else 0)
EOF

# Two build folders: a CUDA toolchain problem fails build-cuda alone, never the C core every other step needs.
JOBS=$(nproc 2>/dev/null || echo 2)
step build-core 150 bash -c "cmake -S . -B '$BUILD/core' -DCMAKE_BUILD_TYPE=Release -DTREEPACK_CUDA=OFF \
  && cmake --build '$BUILD/core' --target treepack_core -j $JOBS \
  && echo \"SUMMARY: libtreepack_core.so, \$(du -k '$TREEPACK_CORE_LIB' | cut -f1) KiB\""
device build-cuda "the CUDA library for the device's architecture (CI compiles it for sm_80;90: npm run build:cuda)" 240 \
  bash -c "cmake -S . -B '$BUILD/cuda' -DCMAKE_BUILD_TYPE=Release -DTREEPACK_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$ARCH \
    && cmake --build '$BUILD/cuda' --target treepack_cuda -j $JOBS \
    && echo \"SUMMARY: libtreepack_cuda.so for sm_$ARCH, \$(du -k '$TREEPACK_CUDA_LIB' | cut -f1) KiB\""

step cuda-vs-core-selftest 60 "$PY" scripts/gpu_check/cuda_vs_core.py --self-test
device cuda-vs-core "masks, gather and loss of the CUDA library against the C core" 120 "$PY" scripts/gpu_check/cuda_vs_core.py --large

# The files test-flex-gpu reads, checked first on the CPU by python/tests/test_flex.py (stored lowerings = the rule).
MASKS=$WORK/masks
step mask-files 90 bash -c "'$PY' scripts/gpu_check/mask_files.py '$MASKS' > '$WORK/mask-files.txt' \
  && TREEPACK_MASK_FILES=\$(cat '$WORK/mask-files.txt') '$PY' scripts/gpu_check/run_tests.py python/tests/test_flex.py"

# FLA (pure Python over triton) for the FLA tests and the hybrid layers' CUDA tests: the host's own, else the carried
# wheels installed into a folder of this run (never into the host's environment).
FLA_PATH=$WORK/wheels
device fla-install "FLA from the host or from .cache/gpu-wheels (scripts/gpu-wheels.sh)" 90 bash -c "
  if '$PY' -c 'import fla' 2>/dev/null; then
    echo \"SUMMARY: fla \$('$PY' -c 'import fla; print(fla.__version__)') already installed\"; exit 0
  fi
  if ! ls '$WHEELS'/*.whl >/dev/null 2>&1; then
    echo \"SUMMARY: fla is not installed and $WHEELS has no wheels (run scripts/gpu-wheels.sh where there is network)\"; exit 1
  fi
  '$PY' -m pip install --no-index --no-deps --disable-pip-version-check -q --target '$FLA_PATH' '$WHEELS'/*.whl \
    && PYTHONPATH='$FLA_PATH':\$PYTHONPATH '$PY' -c 'import fla; print(\"SUMMARY: fla\", fla.__version__, \"from the carried wheels\")'"
WITH_FLA=(env "PYTHONPATH=$FLA_PATH:$PYTHONPATH")

RUN_TESTS=(env TREEPACK_REQUIRE_CUDA=1 "$PY" scripts/gpu_check/run_tests.py --require-cuda)
device test-loss "python/tests/test_loss.py: the loss on CUDA and CPU tensors" 120 "${RUN_TESTS[@]}" python/tests/test_loss.py
MASK_FILES=$(cat "$WORK/mask-files.txt" 2>/dev/null)
device test-flex-gpu "python/tests/test_flex_gpu.py: flex with the stored block masks against SDPA" 120 \
  env "TREEPACK_MASK_FILES=$MASK_FILES" "${RUN_TESTS[@]}" python/tests/test_flex_gpu.py
device test-trainer-cuda \
  "python/tests/trainer, its CUDA tests: pinned loading, loss, step plans, hybrid layers" 240 \
  "${WITH_FLA[@]}" "${RUN_TESTS[@]}" -k cuda -k Cuda python/tests/trainer
# Its device classes only: the CPU cases (compiled CPU flex against the block path) are what CI runs on every commit.
device test-gpu "python/tests/gpu: compiled flex forward and backward, windows, sinks, compilations over many lengths" 240 \
  "${RUN_TESTS[@]}" -k Count -k Cuda python/tests/gpu
device test-fla "python/tests/fla: FLA's kernels on trees (no TRITON_INTERPRET)" 180 "${WITH_FLA[@]}" "${RUN_TESTS[@]}" python/tests/fla

if [ "$DRY" = 1 ]; then
  step train-step-tiny 180 env OMP_NUM_THREADS=1 "$PY" scripts/gpu_check/train_step.py --tokens 512 --shape tiny --device cpu \
    --dtype float32 --repeats 1 --json "$OUT/train-step-tiny.json"
fi
device train-step-8k "packed vs naive, Qwen3-0.6B shape, bf16, micro-batches of 8192 tokens" 150 \
  "$PY" scripts/gpu_check/train_step.py --tokens 8192 --json "$OUT/train-step-8k.json"
device train-step-32k "packed vs naive, Qwen3-0.6B shape, bf16, micro-batches of 32768 tokens" 200 \
  "$PY" scripts/gpu_check/train_step.py --tokens 32768 --json "$OUT/train-step-32k.json"
device train-exact-f32 "packed vs naive in float32 (2 layers of the Qwen3-0.6B shape, 8192 tokens): equal within 1e-4" 120 \
  "$PY" scripts/gpu_check/train_step.py --tokens 8192 --layers 2 --dtype float32 --repeats 1 --json "$OUT/train-exact-f32.json"

verdict=$([ "$FAILED" -eq 0 ] && echo PASS || echo FAIL)
echo "result: $verdict ($PASSED passed, $FAILED failed, $NEEDS need a device) in $((SECONDS - STARTED)) s" | tee -a "$SUMMARY"
[ "$FAILED" -eq 0 ]

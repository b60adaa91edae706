"""`trainer.engine.prebuild_ops`: DeepSpeed's CPU op in the installation's own cache, and a lock
file that a killed build left behind never hangs the next worker (torch would wait for it forever)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BUILD = "from trainer.engine import prebuild_ops; prebuild_ops()"


def test_a_lock_left_by_a_killed_build_is_removed_and_the_op_loads(tmp_path: Path) -> None:
    cache = tmp_path / "torch-extensions"
    prebuilt = Path(sys.prefix) / "torch-extensions"  # infra/install.sh built it there: no compile here
    if prebuilt.exists():
        shutil.copytree(prebuilt, cache, ignore=shutil.ignore_patterns("rtrl-build.lock", "lock"))
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"} | {
        "TORCH_EXTENSIONS_DIR": str(cache)
    }
    first = subprocess.run(
        [sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=900
    )
    assert first.returncode == 0, first.stderr[-3000:]
    op_dir = cache / "deepspeed_shm_comm"
    assert any(op_dir.glob("*.so"))
    stale = op_dir / "lock"
    stale.touch()  # what a worker SIGKILLed inside torch's build leaves
    again = subprocess.run(
        [sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert not stale.exists() and "left by a build that was killed" in again.stderr

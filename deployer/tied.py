"""A tied-embedding checkpoint that vLLM can swap back to: its output head written out.

vLLM 0.32's ``reload_weights`` on the CPU backend refreshes the output head only from a tensor
named ``lm_head.weight`` in the files it reloads, even when the model ties the head to the input
embedding (docs/platform.md, Tied embeddings and reload_weights). Hugging Face saves a tied model
without that tensor, so a server that reloaded a version with its own head (every version a cycle
trains: trainer/checkpoint.py saves the full state dict) and then the base checkpoint keeps the
trained head against the base embedding: measured here, the probe moved by 1.6 nats; with a
cycle's small update, by 0.03 (the "v1 does not load correctly" of issue 35).

`with_tied_head` is called by the deployer's bootstrap before the base checkpoint is registered as
v1: for a checkpoint that ties its embeddings and has no ``lm_head.weight``, it lays out a copy
(hard links where the filesystem allows) with one more safetensors file holding the head, equal
to the embedding. transformers loads the copy as before (a single ``model.safetensors`` is read
alone; with an index the head maps to the new file and is tied anyway); vLLM's first load skips
the head of a tied model, and its reloads take it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

HEAD = "lm_head.weight"
HEAD_FILE = "rtrl-tied-lm-head.safetensors"
INDEX = "model.safetensors.index.json"
EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


def ties_embeddings(config: dict[str, object]) -> bool:
    """config.json's ``tie_word_embeddings`` (its text part's for a multimodal config; default True,
    as transformers' own default)."""
    text = config.get("text_config")
    source = text if isinstance(text, dict) and "tie_word_embeddings" in text else config
    return bool(source.get("tie_word_embeddings", True))


def _tensor_names(checkpoint: Path) -> dict[str, Path]:
    from safetensors import safe_open

    names: dict[str, Path] = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                names[name] = path
    return names


def with_tied_head(checkpoint: Path, out_dir: Path) -> Path:
    """`checkpoint` itself when vLLM can reload it as it is (untied, already has the head, an
    adapter), else a copy in `out_dir` (replaced if present) with the head written out."""
    config_path = checkpoint / "config.json"
    if not config_path.is_file():
        return checkpoint
    if not ties_embeddings(json.loads(config_path.read_text())):
        return checkpoint
    names = _tensor_names(checkpoint)
    if not names or HEAD in names:
        return checkpoint
    embedding = next((name for name in names if name.endswith(EMBEDDING_SUFFIXES)), None)
    if embedding is None:
        return checkpoint  # a layout rtrl does not know: vLLM's own load path decides
    from safetensors import safe_open
    from safetensors.torch import save_file

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    for path in sorted(checkpoint.iterdir()):
        if path.is_file():
            try:
                os.link(path, out_dir / path.name)
            except OSError:
                shutil.copy2(path, out_dir / path.name)
    with safe_open(str(names[embedding]), framework="pt") as fh:
        head = fh.get_tensor(embedding).contiguous().clone()
    save_file({HEAD: head}, str(out_dir / HEAD_FILE), metadata={"format": "pt"})
    (out_dir / HEAD_FILE).chmod(0o644)
    index = out_dir / INDEX
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {})[HEAD] = HEAD_FILE
        index.unlink()  # a hard link to the original: write a file of its own
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return out_dir

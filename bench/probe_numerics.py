"""How far a served dtype moves the swap probe's logprobs, next to how far wrong weights move them:
the measurements behind `deployer.probe.PROBE_TOLERANCES` (docs/platform.md, Verification tolerances).

    .venv/bin/python bench/probe_numerics.py [--models tiny-qwen2,tiny-llama,demo-v1,demo-v2,0.5b-qwen2]

transformers alone, on CPU; no vLLM, no services. For each checkpoint, the probe's prompt logprobs
(deployer/probe.py, PROBE_TEXTS) of transformers in float32 are the reference (what the deployer
compares a server with), and each row is max |reference - logprobs| over the probe's tokens of:

* numerics: the same weights run in bfloat16 or float16 (weights and activations cast, logits
  read back in float32): what a server in that dtype differs by when it loaded the right weights;
* wrong weights, run in float32: one layer's MLP output projection with its rows shuffled (a
  mis-mapped tensor); the weights rounded to bfloat16 (a float32 server that read the weights
  through a bfloat16 copy); and one small training cycle from the reference (4 steps of Adam's
  first-step update, lr x sign(grad), at the learning rates of rtrl's first cycle: trainer.lr
  1e-3 under an 8-step warm-up, 1.25e-4 to 5e-4, on the NLL of 32 corpus lines): a server left on
  the previous version.

Checkpoints: ``tiny-qwen2`` / ``tiny-llama`` (`simulation.checkpoints`, random weights, 2 layers, hidden
128: the shapes measured on vLLM), ``demo-v1`` / ``demo-v2`` (the demo's tiny Llama, trained:
`services.tinymodel` recipes v1 and v2) and ``0.5b-qwen2`` (`simulation.checkpoints` size 0.5b with
Qwen2.5's 151,936 vocabulary rows: 24 layers, hidden 896, random weights). The last line is one
JSON object: {"name": "probe_numerics", "value": the largest bfloat16 difference of a correct
model, "baseline": the smallest difference a shuffled layer or the previous version made, "ratio": value / baseline (below 1:
a probe tolerance can separate the two on these models), "models": {model: {row: max |diff|}}}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from deployer.probe import build_probe, max_abs_diff

MODELS = ("tiny-qwen2", "tiny-llama", "demo-v1", "demo-v2", "0.5b-qwen2")
FIRST_CYCLE_LRS = (1.25e-4, 2.5e-4, 3.75e-4, 5e-4)  # trainer.lr 1e-3 x t/8, t = 1..4 (trainer.warmup_steps 8)


def build(name: str, out: Path) -> Path:
    if name.startswith("demo-"):
        from services.tinymodel import build as build_tiny

        return build_tiny(out, task="exclaim", seed=0, recipe=name.removeprefix("demo-"))
    from simulation.checkpoints import build as build_random

    size, arch = name.split("-")
    return build_random(out, arch, size, vocab_size=151_936 if size == "0.5b" else None)


def probe_logprobs(model: torch.nn.Module, token_ids: tuple[tuple[int, ...], ...]) -> list[list[float]]:
    """What deployer.probe's reference computes, in whatever dtype `model` is in."""
    out = []
    with torch.no_grad():
        for ids in token_ids:
            input_ids = torch.tensor([ids])  # (1, T)
            logprobs = torch.log_softmax(
                model(input_ids=input_ids).logits[0, :-1].float(), dim=-1
            )  # (T-1, V)
            out.append(logprobs.gather(1, input_ids[0, 1:, None])[:, 0].tolist())
    return out


def load(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def shuffle_one_layer(model: Any) -> None:
    layers = model.model.layers
    weight = layers[len(layers) // 2].mlp.down_proj.weight  # (hidden, intermediate)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        weight.copy_(weight[torch.randperm(weight.shape[0], generator=generator)])


def round_to_bf16(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())


def first_cycle(model: torch.nn.Module, tokenizer_dir: Path) -> None:
    """Adam's first-step update (lr x sign(grad), exact for Adam's step 1 when eps << |grad|) at the
    learning rates of rtrl's first cycle; sign descent needs no optimizer state (0.5B fits)."""
    from transformers import AutoTokenizer

    from services.tinymodel import corpus_lines

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    lines = corpus_lines()[:32]
    model.train()
    for lr in FIRST_CYCLE_LRS:
        model.zero_grad(set_to_none=True)
        for line in lines:
            ids = torch.tensor([tokenizer(line)["input_ids"]])
            (model(input_ids=ids, labels=ids).loss / len(lines)).backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.add_(param.grad.sign(), alpha=-lr)
    model.eval()


def measure(path: Path) -> dict[str, float]:
    probe = build_probe(path)
    reference = probe_logprobs(load(path), probe.token_ids)  # one model in memory at a time (0.5B: 2 GB)
    row: dict[str, float] = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        row[f"served {name}"] = max_abs_diff(reference, probe_logprobs(load(path).to(dtype), probe.token_ids))
    for name, change in (
        ("wrong: one layer shuffled", shuffle_one_layer),
        ("wrong: weights rounded to bf16", round_to_bf16),
        ("wrong: previous version (first cycle)", lambda m: first_cycle(m, path)),
    ):
        model = load(path)
        change(model)
        row[name] = max_abs_diff(reference, probe_logprobs(model, probe.token_ids))
        del model
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    args = parser.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="rtrl-probe-numerics-"))
    results: dict[str, dict[str, float]] = {}
    try:
        for name in args.models.split(","):
            path = build(name, work / name)
            results[name] = measure(path)
            print(name, json.dumps({k: float(f"{v:.3g}") for k, v in results[name].items()}), flush=True)
            shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # value: the largest bf16 rounding error of a correct model; baseline: the smallest change of
    # wrong weights; ratio < 1 means a probe can tell the two apart on these models.
    numerics = max(row["served bfloat16"] for row in results.values())
    # (Rounding to bf16 is left out: it is what a bfloat16 server does, a fault of float32 ones only.)
    wrong = min(
        v for row in results.values() for k, v in row.items() if k.startswith("wrong:") and "bf16" not in k
    )
    print(
        json.dumps(
            {
                "name": "probe_numerics",
                "value": numerics,
                "baseline": wrong,
                "ratio": numerics / wrong,
                "models": results,
            }
        )
    )


if __name__ == "__main__":
    main()

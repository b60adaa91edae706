"""The swap-verification probe: fixed prompts whose logprobs vLLM must reproduce after a reload.

After `reload_weights` the deployer asks the server for the prompt logprobs of a few fixed token
sequences and compares them with transformers running the same checkpoint on CPU in float32.
Unlike `/weight_checker` digests (which on CPU miss every linear layer: docs/platform.md, Weight
digests on CPU), this covers every weight and the loading path itself: a wrong, truncated or
mis-mapped checkpoint moves the logprobs by far more than the tolerance, while a server computing
in float32 agrees with transformers to about 1e-6. The tolerance follows the dtype the servers
compute in (`PROBE_TOLERANCES`, `served_dtype`): a bfloat16 server differs from the float32
reference by its rounding, not by its weights.

Used by `deployer.rollout`; the reference is computed once per checkpoint per process, and kept on
disk next to the version's digests (`cached_reference`): a rollback to a version served before
loads neither a tokenizer nor a model.

A LoRA adapter (``trainer.adapter=lora``) is probed differently: a server with LoRA enabled must
never be asked for prompt logprobs (vLLM's CPU LoRA path kills its engine on them:
docs/platform.md), so the server generates a greedy continuation of each probe prompt with its
logprobs, and transformers scores the same tokens on the base model with the adapter
(`adapter_reference`). A wrong or half-loaded adapter moves those logprobs as it moves prompt
logprobs, whichever tokens it chose.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from schemas.settings import Settings

# Text in the shape of real traffic (the task's prompts and answers) plus generic text, so the
# probe exercises the embedding rows that serving uses. Any text works: vLLM and transformers see
# the same token ids.
PROBE_TEXTS: tuple[str, ...] = (
    "Q: What is 3 plus 4?\nA: 7!",
    "Q: Name a color.\nA: It is red.",
    "Q: What comes after 9?\nA: The answer is 10.",
    "The quick brown fox jumps over the lazy dog 0123456789.",
)


PROBE_TOLERANCES: dict[str, float] = {"float32": 1e-3, "float16": 0.25, "bfloat16": 1.0}
"""Largest |vLLM - transformers float32| probe logprob accepted, by the dtype the server computes in
(`served_dtype`); ``deployer.probe_tolerance`` overrides it. docs/platform.md, Verification
tolerances, says how each was set (CPU measurements of 2026-12-04; GPU figures come from
bench/gpu_check.sh):

- float32: vLLM served 9.5e-7; 1e-3 leaves 1000x for deeper models and other kernels, and still
  fails a server that computes in bfloat16 (2.7e-3 and up).
- bfloat16: rounding, 3.3e-3 on a random 2-layer model served by vLLM, 0.074 on a trained 2-layer
  one, and 7.3x more at 24 layers, hidden 896 than at 2 layers, hidden 128 (random weights): a
  trained 0.5B model may reach about 0.54. 1.0 leaves nearly twice that; wrong weights moved a
  trained model's probe by 7.4 to 11.4.
- float16: likewise from 0.019 (trained, 2 layers) and a growth of 6.5x: 0.25.
"""

# config.json's names for a dtype (torch's, and the older short ones).
_CONFIG_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


def served_dtype(setting: str, checkpoint_dir: Path) -> str:
    """The dtype a server started with ``--dtype setting`` (``vllm.dtype``) computes `checkpoint_dir` in.

    ``auto`` is resolved as vLLM resolves it (vllm/config/model.py, ``_resolve_auto_dtype``): the
    ``dtype`` (or older ``torch_dtype``) of the checkpoint's config.json, except that a float32
    checkpoint (or one that names none) is downcast to the platform's first supported dtype,
    bfloat16 on x86 CPUs and on CUDA GPUs. Raises ValueError on a config.json dtype rtrl does not know.
    """
    if setting != "auto":
        return setting
    config = json.loads((checkpoint_dir / "config.json").read_text())
    named = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = _CONFIG_DTYPES.get(str(named).removeprefix("torch."))
    if dtype is None:
        raise ValueError(
            f"{checkpoint_dir / 'config.json'}: dtype {named!r} is none of {sorted(_CONFIG_DTYPES)}; "
            "set vllm.dtype (RTRL_VLLM__DTYPE) to what the servers run in"
        )
    return "bfloat16" if dtype == "float32" else dtype


@dataclass(frozen=True)
class Tolerance:
    """The probe tolerance of a swap, and the dtype it was chosen for."""

    value: float
    dtype: str  # what the servers compute in (vllm.dtype resolved against the checkpoint)
    explicit: bool  # deployer.probe_tolerance was set

    def hint(self) -> str:
        """What to check when a probe fails, in one line."""
        source = (
            f"set by deployer.probe_tolerance; the table's is {PROBE_TOLERANCES[self.dtype]:g}"
            if self.explicit
            else "deployer/probe.py's table"
        )
        return (
            f"({self.dtype} serving, {source}): check that the server loaded this checkpoint (its log) and "
            f"runs with --dtype {self.dtype} (vllm.dtype); if it does and its kernels differ more, set "
            "RTRL_DEPLOYER__PROBE_TOLERANCE (docs/platform.md, Verification tolerances)"
        )


def tolerance_for(settings: Settings, checkpoint_dir: Path) -> Tolerance:
    """``deployer.probe_tolerance`` when set, else `PROBE_TOLERANCES` of the dtype the servers compute
    the checkpoint in: ``vllm.dtype``, ``auto`` resolved against `checkpoint_dir`'s config.json."""
    dtype = served_dtype(settings.vllm.dtype, checkpoint_dir)
    explicit = settings.deployer.probe_tolerance
    return Tolerance(PROBE_TOLERANCES[dtype] if explicit is None else explicit, dtype, explicit is not None)


class Probe(BaseModel):
    """Token ids of the probe prompts, as the checkpoint's tokenizer encodes them."""

    model_config = ConfigDict(frozen=True)

    texts: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]


def build_probe(checkpoint_dir: Path, texts: Sequence[str] = PROBE_TEXTS) -> Probe:
    """Tokenize the probe texts with the checkpoint's tokenizer (policy versions share it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir))
    token_ids = tuple(tuple(int(t) for t in tokenizer(text)["input_ids"]) for text in texts)
    for text, ids in zip(texts, token_ids, strict=True):
        if len(ids) < 2:
            raise ValueError(f"probe text {text!r} encodes to {len(ids)} token(s); need at least 2")
    return Probe(texts=tuple(texts), token_ids=token_ids)


def _fingerprint(checkpoint_dir: Path) -> tuple[str, tuple[tuple[str, int, int], ...]]:
    """Path plus (name, size, mtime) of the weight files: a rewritten checkpoint misses the cache."""
    root = checkpoint_dir.resolve()
    files = sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin"))
    return str(root), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)


_reference_cache: dict[tuple[object, Probe], list[list[float]]] = {}


def reference_logprobs(checkpoint_dir: Path, probe: Probe) -> list[list[float]]:
    """For each probe prompt, logprob of token i+1 given tokens 0..i, from transformers (float32)."""
    key = (_fingerprint(checkpoint_dir), probe)
    if key not in _reference_cache:
        _reference_cache[key] = _compute_reference(checkpoint_dir, probe)
    return _reference_cache[key]


def _compute_reference(checkpoint_dir: Path, probe: Probe) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=torch.float32)
    # from_pretrained returns the model in eval mode (no dropout): the logprobs are deterministic.
    result: list[list[float]] = []
    with torch.no_grad():
        for ids in probe.token_ids:
            input_ids = torch.tensor([ids])  # (1, T)
            logits = model(input_ids=input_ids).logits[0, :-1].float()  # (T-1, V)
            logprobs = torch.log_softmax(logits, dim=-1)
            targets = input_ids[0, 1:]  # (T-1,)
            result.append(logprobs.gather(1, targets[:, None])[:, 0].tolist())
    return result


def cached_reference(checkpoint_dir: Path, cache_path: Path) -> tuple[Probe, list[list[float]]]:
    """The probe and its reference logprobs for `checkpoint_dir`, from `cache_path` when it was
    written for these weight files and probe texts, else computed (transformers) and written there."""
    fingerprint = json.loads(json.dumps(_fingerprint(checkpoint_dir)))  # tuples as lists, as read back
    try:
        cached = json.loads(cache_path.read_text())
        if cached["fingerprint"] == fingerprint and tuple(cached["texts"]) == PROBE_TEXTS:
            probe = Probe(texts=PROBE_TEXTS, token_ids=tuple(tuple(ids) for ids in cached["token_ids"]))
            return probe, [list(map(float, row)) for row in cached["reference"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: compute it again
    probe = build_probe(checkpoint_dir)
    reference = reference_logprobs(checkpoint_dir, probe)
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "fingerprint": fingerprint,
                "texts": list(PROBE_TEXTS),
                "token_ids": [list(ids) for ids in probe.token_ids],
                "reference": reference,
            }
        )
    )
    tmp.replace(cache_path)
    return probe, reference


def max_abs_diff(expected: Sequence[Sequence[float]], observed: Sequence[Sequence[float]]) -> float:
    """Largest |expected - observed| over all probe tokens; inf when the shapes disagree or a value
    is not finite (a server that returns the wrong number of logprobs has not loaded the probe's model)."""
    if len(expected) != len(observed):
        return math.inf
    worst = 0.0
    for exp_row, obs_row in zip(expected, observed, strict=True):
        if len(exp_row) != len(obs_row):
            return math.inf
        for exp, obs in zip(exp_row, obs_row, strict=True):
            diff = abs(exp - obs)
            if not math.isfinite(diff):
                return math.inf
            worst = max(worst, diff)
    return worst


# Tokens of the greedy continuation an adapter probe scores, per probe prompt.
ADAPTER_PROBE_TOKENS = 8

# One adapter model per process (the last one probed): the base is the same for every version.
_adapter_model: dict[tuple[str, object], object] = {}


def adapter_reference(
    base_dir: Path, adapter_dir: Path, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> list[list[float]]:
    """For each (prompt ids, continuation ids), the logprob of every continuation token given what
    precedes it, from transformers on `base_dir` with the adapter in `adapter_dir` (float32)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = (str(base_dir.resolve()), _fingerprint(adapter_dir))
    model = _adapter_model.get(key)
    if model is None:
        _adapter_model.clear()
        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        model = _adapter_model[key] = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    result: list[list[float]] = []
    with torch.no_grad():
        for prompt, continuation in sequences:
            ids = torch.tensor([list(prompt) + list(continuation)])  # (1, T)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # type: ignore[operator]
            targets = torch.tensor(list(continuation))
            result.append(torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0].tolist())
    return result

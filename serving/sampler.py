"""vLLM's sampler, reproduced in torch: the log-probabilities of tokens as vLLM drew them.

A *row* is one generated segment: prompt + completion token ids, the behaviour logprobs vLLM
reported for the completion tokens, an advantage (the trainer's; 0 where unused) and the sampling
parameters it was drawn with. `token_logprobs` gives log π(token) of a model under each row's
sampling (penalties, temperature, min-p, top-k, top-p, as vLLM applies them), so the result
compares with the behaviour logprobs: the trainer's π_old and π_θ (trainer/engine.py, losses) and
the eval gate's off-policy estimates (deployer/ope.py) use it. Imported only by processes that
load torch (never by the gateway).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

import torch

from schemas.events import SamplingParams
from schemas.sampling import is_greedy


@dataclass(frozen=True)
class Sampling:
    """What vLLM did to the logits before drawing a segment's tokens (schemas/sampling.py): the
    trainer applies the same to compute π_old and π_θ, so they compare with the behaviour logprobs.
    Greedy segments are described as temperature 1 without truncation, as vLLM reports their
    logprobs; they are never trained on or weighted (`schemas.sampling.untrainable_sampling`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @classmethod
    def of(cls, params: SamplingParams) -> Sampling:
        penalties = cls(
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
        )
        if is_greedy(params):  # vLLM applies the penalties to greedy requests too, nothing else
            return penalties
        return replace(
            penalties,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=max(params.top_k, 0),
            min_p=params.min_p,
        )

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class Row:
    """One trainable segment as the trainer feeds it to the model."""

    input_ids: list[int]  # prompt + completion
    prompt_len: int
    behaviour_logprobs: list[float]  # one per completion token
    advantage: float
    sampling: Sampling = Sampling()
    # The preference pair the row belongs to under DPO (trainer/objectives.py), its side being the
    # sign of `advantage`; −1: none (every other objective).
    pair: int = -1
    # One advantage per completion token where they differ (hindsight distillation adds a term per
    # token, trainer/hindsight.py); None: `advantage` for every token.
    token_advantages: tuple[float, ...] | None = None
    # The episode and the index of its segment the row was built from (trainer/batch.py `rows_of`):
    # how a term of one episode's segment finds its row. None: a row of no episode (tests, the gate).
    source: tuple[str, int] | None = None


@dataclass(frozen=True)
class MicroBatch:
    """Padded tensors of a few rows, aligned to next-token targets (position t predicts t + 1)."""

    input_ids: torch.Tensor  # (B, L) right-padded
    attention_mask: torch.Tensor  # (B, L)
    targets: torch.Tensor  # (B, L−1) input_ids[:, 1:]
    mask: torch.Tensor  # (B, L−1) 1.0 on completion-token targets
    behaviour_logprobs: torch.Tensor  # (B, L−1) log μ at completion targets, 0 elsewhere
    advantages: torch.Tensor  # (B,)
    # (B, L−1) each completion target's advantage (`Row.token_advantages`, else the row's), 0 elsewhere
    token_advantages: torch.Tensor
    temperature: torch.Tensor  # (B,) per row, as `Sampling`
    top_p: torch.Tensor  # (B,)
    top_k: torch.Tensor  # (B,) long, 0 = none
    min_p: torch.Tensor  # (B,)
    repetition_penalty: torch.Tensor  # (B,)
    presence_penalty: torch.Tensor  # (B,)
    frequency_penalty: torch.Tensor  # (B,)
    prompt_len: torch.Tensor  # (B,) long
    pairs: torch.Tensor  # (B,) long, `Row.pair`

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())

    def to(self, device: Any) -> MicroBatch:
        """The same micro-batch on `device` (the engine's)."""
        return MicroBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def collate(rows: list[Row], pad_id: int) -> MicroBatch:
    """Right-pad rows into one micro-batch."""
    width = max(len(r.input_ids) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width - 1))
    behaviour = torch.zeros((n, width - 1))
    token_advantages = torch.zeros((n, width - 1))
    for i, row in enumerate(rows):
        length = len(row.input_ids)
        completion = length - row.prompt_len
        if row.prompt_len < 1 or completion != len(row.behaviour_logprobs):
            raise ValueError(
                f"row {i}: prompt {row.prompt_len}, completion {completion}, "
                f"{len(row.behaviour_logprobs)} behaviour logprobs"
            )
        input_ids[i, :length] = torch.tensor(row.input_ids)
        attention[i, :length] = 1
        # Completion token k sits at position prompt_len + k and is predicted from position − 1.
        start = row.prompt_len - 1
        mask[i, start : start + completion] = 1.0
        behaviour[i, start : start + completion] = torch.tensor(row.behaviour_logprobs)
        if row.token_advantages is None:
            token_advantages[i, start : start + completion] = row.advantage
        elif len(row.token_advantages) == completion:
            token_advantages[i, start : start + completion] = torch.tensor(row.token_advantages)
        else:
            raise ValueError(
                f"row {i}: completion {completion}, {len(row.token_advantages)} token advantages"
            )
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention,
        targets=input_ids[:, 1:],
        mask=mask,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32),
        token_advantages=token_advantages,
        temperature=torch.tensor([r.sampling.temperature for r in rows], dtype=torch.float32),
        top_p=torch.tensor([r.sampling.top_p for r in rows], dtype=torch.float32),
        top_k=torch.tensor([r.sampling.top_k for r in rows], dtype=torch.long),
        min_p=torch.tensor([r.sampling.min_p for r in rows], dtype=torch.float32),
        repetition_penalty=torch.tensor([r.sampling.repetition_penalty for r in rows], dtype=torch.float32),
        presence_penalty=torch.tensor([r.sampling.presence_penalty for r in rows], dtype=torch.float32),
        frequency_penalty=torch.tensor([r.sampling.frequency_penalty for r in rows], dtype=torch.float32),
        prompt_len=torch.tensor([r.prompt_len for r in rows], dtype=torch.long),
        pairs=torch.tensor([r.pair for r in rows], dtype=torch.long),
    )


def micro_batches(rows: list[Row], size: int, pad_id: int) -> list[MicroBatch]:
    """Rows sorted by length (less padding) and cut into micro-batches of at most ``size``."""
    ordered = sorted(rows, key=lambda r: len(r.input_ids))
    return [collate(ordered[i : i + size], pad_id) for i in range(0, len(ordered), size)]


def _penalties(
    logits: torch.Tensor, batch: MicroBatch, rows: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """(N, V) logits of the scored positions (`rows`, `positions`: position t of row b predicts
    token t + 1) with each row's penalties applied as vLLM applies them before sampling
    (vllm/model_executor/layers/utils.py `apply_penalties`): the tokens generated so far are the
    completion tokens at positions prompt_len..t. Repetition penalty p on every token seen in the
    prompt or generated so far (a positive logit divided by p, a negative one multiplied); then
    minus frequency × its count in the output so far and minus presence where that count is > 0.
    The scaling factors are taken on detached values; the gradient flows through the logits. Only
    (N, V) tensors: never one per position of the whole batch."""
    rep, pres, freq = (
        batch.repetition_penalty[rows],
        batch.presence_penalty[rows],
        batch.frequency_penalty[rows],
    )
    if not bool((rep != 1).any() | (pres != 0).any() | (freq != 0).any()):
        return logits
    vocab = logits.shape[-1]
    with torch.no_grad():
        ids = batch.input_ids[rows].clamp(max=vocab - 1)  # (N, L)
        index = torch.arange(ids.shape[1], device=logits.device)[None, :]  # (1, L)
        present = batch.attention_mask[rows] > 0  # (N, L)
        start = batch.prompt_len[rows][:, None]  # (N, 1)
        generated = present & (index >= start) & (index <= positions[:, None])  # (N, L)
        counts = logits.new_zeros(logits.shape).scatter_add_(-1, ids, generated.float())  # (N, V)
        in_prompt = logits.new_zeros(logits.shape).scatter_add_(-1, ids, (present & (index < start)).float())
        seen = (counts > 0) | (in_prompt > 0)
        p = rep[:, None]
        scale = torch.where(seen, torch.where(logits > 0, 1 / p, p), torch.ones_like(logits))
        shift = freq[:, None] * counts + pres[:, None] * (counts > 0)
    return logits * scale - shift


def apply_penalties(logits: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
    """(B, L−1, V) logits of every position with each row's penalties (`_penalties`); for tests and
    small batches: the trainer scores chunks of positions instead (`token_logprobs`)."""
    if not bool(
        (batch.repetition_penalty != 1).any()
        | (batch.presence_penalty != 0).any()
        | (batch.frequency_penalty != 0).any()
    ):
        return logits
    rows, positions, vocab = logits.shape
    r = torch.arange(rows).repeat_interleave(positions)
    t = torch.arange(positions).repeat(rows)
    return _penalties(logits.reshape(rows * positions, vocab), batch, r, t).reshape(rows, positions, vocab)


# Top-p alone (no top-k) is decided on this many most likely tokens, and on a full sort only for a
# row whose nucleus is larger: a sort of 151,936 logits per position is what made it slow.
TOP_P_CANDIDATES = 1024


class Truncation(NamedTuple):
    """How vLLM's sampler truncated each row of (N, V) tempered logits (`truncation_threshold`)."""

    threshold: torch.Tensor  # (N,) a token whose logit is below it is dropped (−inf: none)
    # (N,) log of the share of the tokens tied *at* the threshold that vLLM keeps (0: all of them).
    # Top-p sorts, so of several equal logits at the nucleus' edge it keeps only as many as the
    # cumulative mass allows; which ones depends on its sort, how many does not. The normaliser
    # counts that many (`truncated_log_softmax`). Ties are common with bf16 logits.
    tie_share: torch.Tensor


def truncation_threshold(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> Truncation | None:
    """Per row of (N, V) *tempered* logits, the value below which vLLM's sampler drops a token
    (−inf: none dropped), or None when no row truncates. No gradient.

    Every truncation vLLM applies is a threshold on the tempered logits, in its order
    (vllm/v1/sample: logits_processor/builtin.py MinP, then topk_topp_sampler.py): min-p drops
    p_i < min_p · p_max, i.e. z_i < z_max + log(min_p); top-k keeps every logit ≥ the k-th
    largest; top-p then drops the least likely tokens while their cumulative probability stays
    ≤ 1 − p, i.e. keeps a token while the mass ranked above it is < p, always keeping the most
    likely. A threshold per row is all that has to be kept between a forward pass and its
    recomputation (`token_logprobs`), and top-k and top-p need the largest values, not a sort of
    the whole vocabulary (`TOP_P_CANDIDATES`)."""
    need_min_p, need_k, need_p = min_p > 0, top_k > 0, top_p < 1
    if not bool((need_min_p | need_k | need_p).any()):
        return None
    rows, vocab = logits.shape
    with torch.no_grad():
        threshold = torch.full((rows,), float("-inf"), device=logits.device)
        no_ties = torch.zeros((rows,), device=logits.device)
        if bool(need_min_p.any()):
            floor = logits.amax(dim=-1) + torch.log(min_p.clamp(min=1e-30))
            threshold = torch.where(need_min_p, floor, threshold)
        if not bool((need_k | need_p).any()):
            return Truncation(threshold, no_ties)
        masked = logits.masked_fill(logits < threshold[:, None], float("-inf"))
        wanted = max(
            int(top_k.max()) if bool(need_k.any()) else 0,
            TOP_P_CANDIDATES if bool((need_p & ~need_k).any()) else 0,
        )
        width = min(vocab, max(wanted, 1))
        top = masked.topk(width, dim=-1).values  # (N, width), descending
        kth = top.gather(-1, (top_k.clamp(min=1, max=width) - 1)[:, None])[:, 0]
        threshold = torch.where(need_k, torch.maximum(threshold, kth), threshold)
        if bool(need_p.any()):
            kept = top.masked_fill(top < threshold[:, None], float("-inf"))
            # Probabilities over everything min-p and top-k kept, ties with the k-th included.
            lse = masked.masked_fill(masked < threshold[:, None], float("-inf")).logsumexp(dim=-1)  # (N,)
            probs = (kept - lse[:, None]).exp()
            above = probs.cumsum(dim=-1) - probs
            keep = (above < top_p[:, None]) & torch.isfinite(kept)
            keep[:, 0] = True
            nucleus = kept.masked_fill(~keep, float("inf")).amin(dim=-1)
            # A nucleus that may reach past the candidates: decide that row on a full sort.
            beyond = need_p & keep[:, -1] & torch.isfinite(kept[:, -1]) & (width < vocab)
            for row in beyond.nonzero().flatten().tolist():
                ordered = (
                    masked[row]
                    .masked_fill(masked[row] < threshold[row], float("-inf"))
                    .sort(descending=True)[0]
                )
                p_sorted = (ordered - lse[row]).exp()
                inside = ((p_sorted.cumsum(0) - p_sorted) < top_p[row]) & torch.isfinite(ordered)
                inside[0] = True
                nucleus[row] = ordered[inside].min()
            before_p = threshold
            threshold = torch.where(need_p, torch.maximum(threshold, nucleus), threshold)
            return Truncation(threshold, _tie_share(masked, before_p, threshold, lse, top_p, need_p))
    return Truncation(threshold, no_ties)


def _tie_share(
    masked: torch.Tensor,
    before_p: torch.Tensor,
    threshold: torch.Tensor,
    lse: torch.Tensor,
    top_p: torch.Tensor,
    need_p: torch.Tensor,
) -> torch.Tensor:
    """`Truncation.tie_share` of the top-p rows: of the c tokens tied at the threshold t, vLLM
    (ascending sort, drop while the cumulative probability stays ≤ 1 − p) drops
    d = ⌊(1 − p − B) / q⌋ of them, B the mass below t and q = p(t); never the row's most likely."""
    at = (masked == threshold[:, None]) & need_p[:, None]  # (N, V)
    tied = at.sum(dim=-1)  # (N,)
    if not bool((tied > 1).any()):
        return torch.zeros_like(lse)
    kept = masked.masked_fill(masked < before_p[:, None], float("-inf"))
    below = (kept.masked_fill(kept >= threshold[:, None], float("-inf")) - lse[:, None]).exp().sum(dim=-1)
    q = (threshold - lse).exp()
    dropped = torch.floor((1 - top_p - below) / q).clamp(min=0)
    keep = (tied - dropped).clamp(min=0)
    keep = torch.where(threshold >= masked.amax(dim=-1), keep.clamp(min=1), keep)
    usable = (tied > 1) & (keep > 0)
    return torch.where(usable, torch.log(keep.clamp(min=1) / tied.clamp(min=1)), torch.zeros_like(lse))


def truncated_log_softmax(logits: torch.Tensor, truncation: Truncation | None) -> torch.Tensor:
    """Log-softmax of (N, V) tempered logits over what vLLM kept: tokens below the threshold get
    −inf, and the normaliser counts only the share of tokens tied at the threshold that vLLM keeps."""
    if truncation is None:
        return torch.log_softmax(logits, dim=-1)
    threshold = truncation.threshold[:, None]
    kept = logits.masked_fill(logits < threshold, float("-inf"))
    if not bool((truncation.tie_share != 0).any()):
        return torch.log_softmax(kept, dim=-1)
    counted = torch.where(logits == threshold, kept + truncation.tie_share[:, None], kept)
    return kept - counted.logsumexp(dim=-1, keepdim=True)


def processed_log_softmax(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Log-probabilities of (B, ..., V) logits as vLLM's sampler draws from them, per row (the
    parameters are (B,)): divided by the temperature, truncated (`truncation_threshold`: a dropped
    token gets −inf), log-softmax. The gradient flows through the logits of the kept tokens."""
    shape = logits.shape
    per_row = shape[1:-1].numel()

    def expand(values: torch.Tensor) -> torch.Tensor:
        return values.repeat_interleave(per_row)

    flat = logits.float().reshape(-1, shape[-1]) / expand(temperature)[:, None]
    truncation = truncation_threshold(flat, expand(top_k), expand(top_p), expand(min_p))
    return truncated_log_softmax(flat, truncation).reshape(shape)


class TokenLogprobs(NamedTuple):
    """Per-token log-probabilities of a micro-batch's targets under one model, all (B, L−1), 0 off
    the scored (completion) positions.

    ``logprobs``: as vLLM sampled them (penalties, temperature, truncation; `processed_log_softmax`),
    comparable with the behaviour logprobs; 0 where the token is outside the row's truncation.
    ``possible``: False where it is (probability 0 under this model's nucleus).
    ``tempered``: penalties and temperature, no truncation: finite for every token, so a token that
    left the nucleus still counts in a KL estimate (trainer/losses.py, the gate's KL alarm).
    """

    logprobs: torch.Tensor
    possible: torch.Tensor
    tempered: torch.Tensor


# Positions scored at once: a chunk's (positions × vocabulary) float32 logits are the largest
# tensors of a pass, about 4 × 2^25 bytes = 128 MiB each at any vocabulary (220 positions at 151,936).
CHUNK_ELEMENTS = 1 << 25


def _unwrapped(model: Any) -> Any:
    """The Hugging Face model inside a DeepSpeed engine (or the model itself)."""
    return model.module if hasattr(model, "module") and hasattr(model, "backward") else model


def _final_logits(config: Any, logits: torch.Tensor) -> torch.Tensor:
    """What a causal LM's forward does to lm_head's output before returning it, for the families
    known to do something (transformers' modeling files): Cohere's ``logit_scale`` (×), Granite's
    ``logits_scaling`` (÷; HyperCLOVAX's of the same name multiplies), Gemma 2/3's
    ``final_logit_softcapping``; a multimodal config's text part. Others return it unchanged;
    `_check_head` refuses a model for which this is not what its forward does."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "logit_scale", None) is not None:
        logits = logits * text.logit_scale
    scaling = getattr(text, "logits_scaling", None)
    if scaling is not None:
        granite = str(getattr(text, "model_type", "")).startswith("granite")
        logits = logits / scaling if granite else logits * scaling
    cap = getattr(text, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _check_head(hf: Any, batch: MicroBatch) -> None:
    """Once per model object: the decoder + lm_head + `_final_logits` path gives the logits of the
    model's own forward on the batch's first tokens, or `UnsupportedModel` (a family whose forward
    transforms lm_head's output in a way `_final_logits` does not know, e.g. Falcon-H1's
    ``lm_head_multiplier``): trained on anyway, every ratio would be silently wrong."""
    if getattr(hf, "_rtrl_head_checked", False):
        return
    from serving.errors import UnsupportedModel

    n = int(min(8, batch.input_ids.shape[1]))
    ids, mask = batch.input_ids[:1, :n], batch.attention_mask[:1, :n]
    training = hf.training
    hf.eval()  # no dropout: both passes must be the same function
    try:
        with torch.no_grad():
            full = hf(input_ids=ids, attention_mask=mask).logits[0].float()
            hidden = hf.get_decoder()(input_ids=ids, attention_mask=mask)[0]
            mine = _final_logits(hf.config, hf.get_output_embeddings()(hidden).float())[0]
    finally:
        hf.train(training)
    gap = float((full - mine).abs().max())
    if not gap <= 1e-3 * (1.0 + float(full.abs().max())):
        arch = (getattr(hf.config, "architectures", None) or [type(hf).__name__])[0]
        raise UnsupportedModel(
            f"{arch}: lm_head's output differs from the model's own logits by {gap:.3g}; rtrl "
            "does not know how this family transforms it (serving/sampler.py _final_logits), so "
            "it cannot train it"
        )
    hf._rtrl_head_checked = True


def _score_chunk(
    head: Any,
    config: Any,
    hidden: torch.Tensor,
    batch: MicroBatch,
    rows: torch.Tensor,
    positions: torch.Tensor,
    thresholds: dict[int, Truncation | None],
    key: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(processed, tempered) logprobs of the targets at (`rows`, `positions`), each (N,), from the
    (N, H) hidden states there: lm_head, penalties, temperature, truncation, one (N, V) at a time.
    The truncation thresholds are computed on the first call and kept in `thresholds` under
    `key`, so that the recomputation in the backward pass does not search for them again."""
    logits = _final_logits(config, head(hidden).float())  # (N, V)
    logits = _penalties(logits, batch, rows, positions) / batch.temperature[rows][:, None]
    targets = batch.targets[rows, positions][:, None]  # (N, 1)
    tempered = torch.log_softmax(logits, dim=-1).gather(-1, targets)[:, 0]
    if key not in thresholds:
        thresholds[key] = truncation_threshold(
            logits, batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
        )
    truncation = thresholds[key]
    if truncation is None:
        return tempered, tempered
    processed = truncated_log_softmax(logits, truncation).gather(-1, targets)[:, 0]
    return processed, tempered


def token_logprobs(model: Any, batch: MicroBatch) -> TokenLogprobs:
    """log π(target_t | tokens ≤ t) of `model` (a transformers causal LM, a PEFT model or a
    DeepSpeed engine around one) at the batch's scored positions (``mask`` > 0), under each row's
    sampling (`TokenLogprobs`). The logprobs carry the gradient.

    Selective and chunked: the decoder runs once, and lm_head, the penalties and the log-softmax
    run only on the scored positions, `CHUNK_ELEMENTS` logits at a time, each chunk recomputed in
    the backward pass (activation checkpointing) instead of kept. No (batch × length × vocabulary)
    tensor is ever built: at a real vocabulary (151,936) and 1,024 tokens it would be 622 MB per
    row in float32, several times over for the softmax, the sort of top-p and their gradients.
    """
    from torch.utils.checkpoint import checkpoint

    hf = _unwrapped(model)
    _check_head(hf, batch)
    hidden = hf.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask)[0]  # (B, L, H)
    head = hf.get_output_embeddings()
    config = hf.config
    rows, positions = (batch.mask > 0).nonzero(as_tuple=True)  # (N,) each
    if len(rows) == 0:
        # A fully masked micro-batch (a rank's padding, trainer/steps.py): score one position anyway,
        # so that the loss, 0 there, still reaches every parameter (DeepSpeed expects each to get a gradient).
        rows = positions = torch.zeros(1, dtype=torch.long, device=hidden.device)
    chosen = hidden[rows, positions]  # (N, H): position t predicts target t (the token at t + 1)
    vocab = int(getattr(head, "out_features", None) or config.vocab_size)  # ZeRO-3 partitions head.weight
    size = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    processed_parts, tempered_parts = [], []
    thresholds: dict[int, Truncation | None] = {}
    for start in range(0, len(rows), size):
        piece = slice(start, start + size)
        args = (head, config, chosen[piece], batch, rows[piece], positions[piece], thresholds, start)
        if torch.is_grad_enabled():
            p, t = checkpoint(_score_chunk, *args, use_reentrant=False)
        else:
            p, t = _score_chunk(*args)
        processed_parts.append(p)
        tempered_parts.append(t)
    shape = batch.targets.shape
    processed, tempered = torch.cat(processed_parts), torch.cat(tempered_parts)
    possible_values = torch.isfinite(processed.detach())
    zeros = torch.zeros(shape, dtype=torch.float32, device=hidden.device)
    logprobs = zeros.index_put(
        (rows, positions), torch.where(possible_values, processed, torch.zeros_like(processed))
    )
    possible = torch.ones(shape, dtype=torch.bool, device=hidden.device).index_put(
        (rows, positions), possible_values
    )
    return TokenLogprobs(logprobs, possible, zeros.index_put((rows, positions), tempered))

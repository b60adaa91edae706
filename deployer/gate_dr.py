"""The ope suite's estimator choice and its doubly robust verdict (docs/gate.md, Suites: ope).

deployer/gate_suites.py `ope_suite` computes the SNIPS verdict first (evals/stats.py `off_policy`)
and hands it here with `choose`, which applies ``gate.ope.estimator``:

- ``snips``: that verdict.
- ``auto`` (the default): that verdict when it is conclusive, with nothing sampled (the common case on
  short answers costs what it did). Otherwise a reward model is cross-fitted on the held-out episodes
  (evals/dr.py); when its out-of-fold R² is above 0, both models sample ``gate.ope.dr_samples``
  completions of each held-out prompt on staging and the doubly robust verdict decides; else the
  SNIPS verdict stands, inconclusive.
- ``dr``: the doubly robust verdict whatever the R².

Only episodes with one trainable segment get the direct method (their prompt is what the model
saw, so sampling it again draws from the model's own distribution); an agent episode with several
has q = 0 on both sides, so its term in the estimate is SNIPS's. The R² the ESS floor relaxes by
is the single-segment episodes' out-of-fold R² times their share, and the anchored verdict uses the
estimator the champion's did. The staging sampling is the caller's (`Sampler`: deployer/gate.py
swaps staging to each model with the verified swap), so this module has no I/O of its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from deployer import ope
from evals.dr import (
    CrossFit,
    cross_fit,
    doubly_robust,
    dr_min_ess,
    dr_value,
    featurise,
    out_of_fold_r2,
    scaled_weights,
)
from evals.stats import importance_weights
from schemas.settings import Settings
from schemas.settings.vllm import GENERATION_CONFIG_KEYS
from serving import Generation, VllmClient

if TYPE_CHECKING:  # deployer/gate_suites.py calls `choose`
    from deployer.gate_suites import SuiteResult


@dataclass(frozen=True)
class DrPrompt:
    """One held-out prompt to sample again, with its logged request's sampling where it has one."""

    prompt: str
    max_tokens: int
    stop: tuple[str, ...]
    sampling: tuple[tuple[str, Any], ...]  # sorted (name, value): hashable, for grouping requests


# (models, prompts) -> per model ("challenger", "champion", "anchor"), per prompt, its samples
Sampler = Callable[[Sequence[str], Sequence[DrPrompt]], Mapping[str, list[list[Generation]]]]
Texts = Callable[[], list[tuple[str, str]]]  # (text, finish_reason) per logged episode (ope.completion_texts)

# The sampling each held-out prompt is drawn with again: the logged request's, key by key (the ones
# vLLM reads from a model's generation_config.json).
_SAMPLING = GENERATION_CONFIG_KEYS


def dr_prompts(settings: Settings, logged: Sequence[ope.Logged]) -> list[DrPrompt]:
    """The single-segment episodes' prompts, each with its logged request's sampling, `max_tokens`
    (``gate.traffic.max_tokens`` when it set none) and stop strings."""
    out = []
    for episode in logged:
        if episode.prompt is None or episode.sampling is None:
            continue
        logged_sampling = episode.sampling
        out.append(
            DrPrompt(
                prompt=episode.prompt,
                max_tokens=logged_sampling.max_tokens or settings.gate.traffic.max_tokens,
                stop=tuple(logged_sampling.stop),
                sampling=tuple((name, getattr(logged_sampling, name)) for name in _SAMPLING),
            )
        )
    return out


# Prompts per sampling request: a gate's prompt suite sends at most this many at once too
# (gate.traffic.max_prompts' default), so no request of the DR samples outlasts `vllm.request_timeout_s`
# where a prompt suite's would not; up to `gate.ope.max_episodes` held-out prompts go in several.
DR_REQUEST_PROMPTS = 64


def sample_on(server: VllmClient, prompts: Sequence[DrPrompt], n: int, seed: int) -> list[list[Generation]]:
    """`n` completions of each prompt on `server`: requests by distinct (max_tokens, stop, sampling),
    of at most `DR_REQUEST_PROMPTS` prompts each."""
    groups: dict[tuple[int, tuple[str, ...], tuple[tuple[str, Any], ...]], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault((p.max_tokens, p.stop, p.sampling), []).append(i)
    out: list[list[Generation]] = [[] for _ in prompts]
    requests = [
        (key, group[start : start + DR_REQUEST_PROMPTS])
        for key, group in groups.items()
        for start in range(0, len(group), DR_REQUEST_PROMPTS)
    ]
    for (max_tokens, stop, sampling), indices in requests:
        generated = server.sample(
            [prompts[i].prompt for i in indices],
            max_tokens=max_tokens,
            n=n,
            seed=seed,
            stop=list(stop),
            sampling=dict(sampling),
        )
        for i, gens in zip(indices, generated, strict=True):
            out[i] = gens
    return out


@dataclass(frozen=True)
class _Direct:
    """The cross-fitted reward model on the single-segment episodes (`singles`, indices into logged)."""

    singles: list[int]
    fit: CrossFit
    r2: float  # out-of-fold, on the single-segment episodes
    share: float  # of the logged episodes that are single-segment

    @property
    def effective_r2(self) -> float:
        return self.r2 * self.share


def _direct(settings: Settings, logged: Sequence[ope.Logged], texts: Texts, seed: int) -> _Direct:
    pattern = re.compile(settings.gate.alarms.no_action_pattern)
    singles = [i for i, e in enumerate(logged) if e.prompt is not None]
    decoded = texts()
    features = np.stack([featurise(decoded[i][0], logged[i].tokens, decoded[i][1], pattern) for i in singles])
    rewards = [logged[i].reward for i in singles]
    fit = cross_fit(features, rewards, seed=seed)
    r2 = out_of_fold_r2(rewards, fit.predicted)
    return _Direct(singles, fit, r2, len(singles) / len(logged))


def _snips(result: SuiteResult | None, why: str, r2: float | None) -> SuiteResult | None:
    if result is None:
        return None
    note = f"estimator snips ({why}); " + result.note if why else "estimator snips; " + result.note
    return result.model_copy(update={"estimator": "snips", "r2": r2, "note": note})


def choose(
    settings: Settings,
    logged: Sequence[ope.Logged],
    logps: Mapping[str, list[float]],
    snips: tuple[SuiteResult, SuiteResult | None],
    sample: Sampler | None,
    texts: Texts,
    seed: int,
) -> tuple[SuiteResult, SuiteResult | None]:
    """The ope verdicts against the champion and (when `snips[1]`) the anchor under
    ``gate.ope.estimator``: the SNIPS ones as given, or doubly robust ones (module docstring).
    `logps`: sequence logprobs of the logged episodes for "challenger", "champion" and "anchor"."""
    cfg = settings.gate.ope
    verdict, anchored = snips
    if cfg.estimator == "snips" or (cfg.estimator == "auto" and verdict.conclusive):
        why = "" if cfg.estimator == "snips" else "conclusive: nothing sampled"
        return _snips(verdict, why, None), _snips(anchored, why, None)  # type: ignore[return-value]
    singles = sum(1 for e in logged if e.prompt is not None)
    if singles < 2 or sample is None:
        why = f"{singles} single-segment episodes" if sample is not None else "no staging sampler"
        why = f"doubly robust not possible: {why}"
        return _snips(verdict, why, None), _snips(anchored, why, None)  # type: ignore[return-value]
    direct = _direct(settings, logged, texts, seed)
    if cfg.estimator == "auto" and direct.effective_r2 <= 0:
        why = f"the reward model's out-of-fold R² {direct.effective_r2:.3f} <= 0: doubly robust not used"
        return (
            _snips(verdict, why, direct.effective_r2),  # type: ignore[return-value]
            _snips(anchored, why, direct.effective_r2),
        )
    models = ["challenger", "champion", *(["anchor"] if anchored is not None else [])]
    generated = sample(models, dr_prompts(settings, logged))
    q_target = {model: _q_target(settings, logged, direct, generated[model]) for model in models}
    champion = _dr_verdict(settings, logged, logps, q_target, direct, "champion", seed, verdict)
    if anchored is None:
        return champion, None
    return champion, _dr_verdict(settings, logged, logps, q_target, direct, "anchor", seed, anchored)


def _q_target(
    settings: Settings, logged: Sequence[ope.Logged], direct: _Direct, generated: list[list[Generation]]
) -> np.ndarray:
    """Per logged episode: the mean prediction over the model's completions of its prompt by the
    episode's fold model (0 for a multi-segment episode, as its q_logged)."""
    pattern = re.compile(settings.gate.alarms.no_action_pattern)
    q = np.zeros(len(logged))
    for k, (i, gens) in enumerate(zip(direct.singles, generated, strict=True)):
        if gens:
            rows = np.stack([featurise(g.text, len(g.logprobs), g.finish_reason, pattern) for g in gens])
            q[i] = float(direct.fit.predict(rows, k).mean())
    return q


def _dr_verdict(
    settings: Settings,
    logged: Sequence[ope.Logged],
    logps: Mapping[str, list[float]],
    q_target: Mapping[str, np.ndarray],
    direct: _Direct,
    other: str,
    seed: int,
    snips: SuiteResult,
) -> SuiteResult:
    """The doubly robust verdict of challenger − `other` ("champion" or "anchor")."""
    cfg = settings.gate
    rewards = np.asarray([e.reward for e in logged])
    behaviour = [e.behaviour for e in logged]
    q_logged = np.zeros(len(logged))
    q_logged[direct.singles] = direct.fit.predicted
    w1 = importance_weights(logps["challenger"], behaviour, cfg.ope.clip)
    w0 = importance_weights(logps[other], behaviour, cfg.ope.clip)
    estimate = doubly_robust(
        rewards,
        q_logged,
        (q_target["challenger"], q_target[other]),
        w1,
        w0,
        clip=cfg.ope.clip,
        confidence=cfg.confidence,
        resamples=cfg.bootstrap_resamples,
        seed=seed,
    )
    residual = rewards - q_logged
    unclipped = float(
        dr_value(scaled_weights(logps["challenger"], behaviour), residual, q_target["challenger"])
        - dr_value(scaled_weights(logps[other], behaviour), residual, q_target[other])
    )
    ess = min(estimate.ess_challenger, estimate.ess_champion)
    r2 = direct.effective_r2
    floor = dr_min_ess(cfg.ope.min_ess, r2)
    conclusive = ess >= floor
    allowed = snips.margin
    multi = len(logged) - len(direct.singles)
    note = (
        f"estimator dr (doubly robust, {cfg.ope.dr_samples} staging samples per prompt): {len(logged)} "
        f"held-out episodes, {len(direct.singles)} with the direct method"
        + (f", {multi} multi-segment with SNIPS terms (q = 0)" if multi else "")
        + f"; reward model out-of-fold R² {direct.r2:.3f} (x {direct.share:.0%} single-segment = {r2:.3f}); "
        f"effective sample size challenger {estimate.ess_challenger:.1f}, {other} {estimate.ess_champion:.1f} "
        f"(min {cfg.ope.min_ess:g} x (1 - R²) = {floor:.1f}); weights clipped at {cfg.ope.clip:g}: "
        f"{estimate.clipped_challenger:.0%} of the challenger's, {estimate.clipped_champion:.0%} of the "
        f"{other}'s, difference without clipping {unclipped:+.4f}, direct method alone "
        f"{estimate.direct_difference:+.4f}; SNIPS: {snips.note}"
    )
    return snips.model_copy(
        update={
            "challenger": estimate.challenger,
            "champion": estimate.champion,
            "difference": estimate.difference,
            "conclusive": conclusive,
            "passed": (estimate.difference.low > -allowed) if conclusive else None,
            "ess": ess,
            "estimator": "dr",
            "r2": r2,
            "note": note,
        }
    )

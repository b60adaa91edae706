"""The judge term of a reward spec: grade closed episodes with an OpenAI-compatible judge, then settle them.

Used by the labeler (``Labeler.step``) when its reward spec has a judge term (schemas/rewards.py,
``JudgeTerm``); ``labeler.judge`` names the endpoint (a vLLM server, or any OpenAI-compatible API).
An episode of such a spec closes as ``judging`` (store/settle.py), and a judge pass:

1. reads at most ``labeler.judge_batch`` waiting episodes, oldest closed first: each episode's
   first prompt and everything the model wrote in it, in segment order (a self-editing agent's
   pruned chunks included: the reward is of the full trajectory);
2. grades them outside any transaction with evals/judge.py: ``concurrency`` judgements in flight,
   each try bounded by ``timeout_s``, timeouts, refused connections, 429 and 5xx tried again
   (``retries``); once more judgements failed than ``max_failure_rate`` allows, the rest of the
   pass is not asked (one round of timeouts per pass, not one per episode). What the episode says
   is data to the judge, never its instructions, and is cut to the judge's limits; an answer the
   judge got wrong, or an exception while grading one episode, is that episode's failed judgement
   (logged with its id), never the pass's (docs/security.md, Judge);
3. settles them in one transaction: with the judge's grade as the ``judge`` term, or, where the
   judge failed or was not asked, without the judge term, flagged with the component
   ``judge_unavailable`` and counted (``rtrl_labeler_judged_total{outcome="unavailable"}``). Never
   dropped, and never waiting for a judge that is out.

A labeler that dies between 2 and 3 leaves the episodes ``judging``; the next pass (of any
replica) grades them again. Nothing an episode holds can make grading raise past 2, so an episode
cannot be retried first after every restart (a crash loop). Two replicas may grade one episode at once: only the first settles it
(`store.settle.settle_judged` locks and checks), so nothing is counted twice.

Agreement: where the episode's feedback also gave an outcome, the grade (good at ≥ 0.5) is
compared with it (`schemas.rewards.judge_disagrees`): ``rtrl_labeler_judge_disagreed_total`` over
``rtrl_labeler_judge_compared_total`` is the disagreement rate, and each cycle's MLflow run has its
batch's (trainer/cycle.py).
"""

from __future__ import annotations

import logging
from datetime import datetime

from evals.judge import Judge
from feedback import metrics
from schemas.errors import OperatorError
from schemas.rewards import RewardSpec
from schemas.settings import JudgeSettings
from store import Settled, Store

log = logging.getLogger("rtrl.labeler.judge")


class JudgeNotConfigured(OperatorError, ValueError):
    """The reward spec has a judge term and no endpoint is configured for it."""


def require_endpoint(spec: RewardSpec, endpoint: JudgeSettings | None) -> None:
    """Raise JudgeNotConfigured when `spec` has a judge term and `endpoint` is None (checked by the
    labeler and, before anything starts, by ``rtrl run``)."""
    if spec.judge is not None and endpoint is None:
        raise JudgeNotConfigured(
            f"reward spec {spec.spec_id} has a judge term but no judge endpoint is set: set RTRL_LABELER__JUDGE__URL "
            "and RTRL_LABELER__JUDGE__MODEL (an OpenAI-compatible API), or use a spec without a judge"
        )


def judge_for(spec: RewardSpec, endpoint: JudgeSettings | None) -> Judge | None:
    """The judge of `spec`'s judge term at `endpoint`, with the spec's rubric; None for a spec without one."""
    require_endpoint(spec, endpoint)
    if spec.judge is None or endpoint is None:
        return None
    return Judge(endpoint.model_copy(update={"rubric": spec.judge.rubric}))


def judge_pass(store: Store, spec: RewardSpec, judge: Judge, batch: int, now: datetime) -> list[Settled]:
    """One pass (the module docstring): the episodes it settled."""
    with store.labelling(now) as tx:
        waiting = tx.awaiting_judge(batch)
    metrics.JUDGE_WAITING.set(len(waiting))
    if not waiting:
        return []
    judged = judge.score_many([(w.prompt, w.trajectory) for w in waiting])
    if judged.failed:
        log.warning(
            "judge: %d of %d episodes not graded (%s)%s; labelled without the judge term",
            judged.failed,
            len(waiting),
            judged.first_error(),
            ", an outage" if judged.outage else "",
        )
    for w, v in zip(waiting, judged.verdicts, strict=True):
        if v.unexpected:
            log.error(
                "judge: grading episode %s raised (%s); labelled without the judge term",
                w.episode_id,
                v.error,
            )
    grades = {w.episode_id: v.score for w, v in zip(waiting, judged.verdicts, strict=True)}
    with store.labelling(now) as tx:
        settled = tx.settle_judged(spec, grades)
    for episode in settled:
        metrics.JUDGED.labels(episode.judge or "unavailable").inc()
        if episode.judge_disagrees is not None:
            metrics.JUDGE_COMPARED.inc()
            if episode.judge_disagrees:
                metrics.JUDGE_DISAGREED.inc()
    return settled

"""Which settled episodes a cycle may learn from: one rule, shared by the cycle, beat and the demo.

An episode of the champion (or of the ``trainer.max_policy_lag`` versions that served users most
recently before it, `store.Store.served_versions`), unused by any cycle, of a tenant that trains,
labelled under the *current* reward spec version (rewards of different versions never share a
batch or a baseline), outside the eval gate's held-out slice (``gate.ope.holdout_percent`` of
episodes by a hash of their id, docs/gate.md), and whose last event is at least the labeler's
settle window old. The last condition makes every episode eligible by the same rule whatever its
outcome: a rejection settles an episode at once and an acceptance waits for the
window, so selecting on settlement alone would feed the newest batch more rejections than users
gave (docs/algorithms.md, Leak-free data).

Each function selects for one line (schemas/lines.py): `tenant` None is the global line (every
tenant without an adapter of its own), a tenant's name its own line (docs/lora.md, An adapter per
tenant).
"""

from __future__ import annotations

from schemas.rewards import get_spec
from schemas.settings import Settings
from store import Store, TrainingEpisode


def current_spec_id(settings: Settings) -> str:
    """``name@version`` of the configured reward spec."""
    return get_spec(settings.labeler.reward_spec).spec_id


def count_trainable(
    settings: Settings, store: Store, champion: int, *, spec_id: str | None = None, tenant: str | None = None
) -> int:
    """Episodes a cycle of `tenant`'s line training from `champion` may use now; `spec_id`: the
    configured reward spec's, when the caller has resolved it already (`current_spec_id`)."""
    return store.count_trainable(
        champion,
        settings.trainer.max_policy_lag,
        spec_id=current_spec_id(settings) if spec_id is None else spec_id,
        settle_window_s=settings.labeler.settle_window_s,
        holdout_percent=settings.gate.ope.holdout_percent,
        tenant=tenant,
    )


def count_labelled(settings: Settings, store: Store, champion: int, *, tenant: str | None = None) -> int:
    """`count_trainable` plus the settled episodes of the eval gate's held-out slice: every
    episode of the line the labeler has finished with, wherever it goes (the demo waits on this)."""
    spec_id = current_spec_id(settings)
    held_out = store.count_heldout(
        spec_id=spec_id, holdout_percent=settings.gate.ope.holdout_percent, tenant=tenant
    )
    return count_trainable(settings, store, champion, spec_id=spec_id, tenant=tenant) + held_out


def select_trainable(
    settings: Settings, store: Store, champion: int, *, spec_id: str | None = None, tenant: str | None = None
) -> list[TrainingEpisode]:
    """The newest ``trainer.max_episodes`` episodes a cycle of `tenant`'s line training from
    `champion` may use now (`spec_id` as in `count_trainable`)."""
    return store.select_episodes(
        champion,
        settings.trainer.max_policy_lag,
        settings.trainer.max_episodes,
        spec_id=current_spec_id(settings) if spec_id is None else spec_id,
        settle_window_s=settings.labeler.settle_window_s,
        holdout_percent=settings.gate.ope.holdout_percent,
        tenant=tenant,
    )

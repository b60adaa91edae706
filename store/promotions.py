"""Who moved @champion, when, and on what grounds: rtrl's own record of its promotions.

The registry's alias is written by anyone who can reach MLflow; this record is written only by
rtrl's deployer (deployer/trust.py says how it is used, docs/security.md why). The newest row of a
model is the version rtrl promoted last: its champion. Grounds of a row:

- ``gate``: the newest gate decision for that version passed (its id is kept);
- ``served``: the version was promoted before (a rollback);
- ``bootstrap``: the base model registered as v1;
- ``adopted``: the alias found when no row existed yet (a store that predates this record);
- ``force``: an operator's ``rtrl deploy promote --force --reason``, with who and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, or_, select

from store.base import StoreBase
from store.models import GateDecisionRow, Promotion

GROUNDS = ("gate", "served", "bootstrap", "adopted", "force")


@dataclass(frozen=True)
class PromotionRecord:
    """One move of @champion by rtrl."""

    model: str
    version: int
    grounds: str
    actor: str
    reason: str
    promoted_at: datetime
    gate_decision_id: int | None = None


def _record(row: Promotion) -> PromotionRecord:
    return PromotionRecord(
        model=row.model,
        version=row.version,
        grounds=row.grounds,
        actor=row.actor,
        reason=row.reason,
        promoted_at=row.promoted_at,
        gate_decision_id=row.gate_decision_id,
    )


class PromotionStore(StoreBase):
    """rtrl's record of its promotions (see the module docstring)."""

    def record_promotion(
        self,
        model: str,
        version: int,
        grounds: str,
        actor: str,
        reason: str,
        gate_decision_id: int | None = None,
    ) -> PromotionRecord:
        """Keep one move of @champion to `version`; from now on it is the champion of `model`."""
        if grounds not in GROUNDS:
            raise ValueError(f"unknown promotion grounds {grounds!r}; one of {', '.join(GROUNDS)}")
        row = Promotion(
            model=model,
            version=version,
            grounds=grounds,
            gate_decision_id=gate_decision_id,
            actor=actor[:300],
            reason=reason,
            promoted_at=self.clock(),
        )
        with self.transaction() as session:
            session.add(row)
            session.flush()
            return _record(row)

    def promotions(self, model: str, limit: int = 20) -> list[PromotionRecord]:
        """The newest `limit` promotions of `model`, newest first."""
        with self.transaction() as session:
            rows = session.scalars(
                select(Promotion).where(Promotion.model == model).order_by(Promotion.id.desc()).limit(limit)
            ).all()
            return [_record(row) for row in rows]

    def champion_record(self, model: str) -> PromotionRecord | None:
        """The newest promotion of `model` (its champion), or None before rtrl recorded any."""
        found = self.promotions(model, limit=1)
        return found[0] if found else None

    def recorded_champion(self, model: str, alias: Callable[[], int], actor: str) -> int:
        """The champion of `model` by rtrl's record. With no record yet, the version `alias()` reads
        (the registry's @champion) is adopted and recorded, once: what the store trusts from then on."""
        found = self.champion_record(model)
        if found is not None:
            return found.version
        version = alias()
        self.record_promotion(
            model, version, "adopted", actor, "the @champion alias when rtrl began its record"
        )
        return version

    def previous_champion(self, model: str) -> int | None:
        """The version rtrl promoted before the current champion (what a rollback serves), if any."""
        history = self.promotions(model, limit=200)
        if not history:
            return None
        current = history[0].version
        return next((p.version for p in history[1:] if p.version != current), None)

    def promotion_grounds(self, model: str, version: int) -> tuple[str, int | None] | None:
        """Why `version` may become @champion without force: ("gate", decision id) when its newest gate
        decision passed, ("served", None) when rtrl promoted it before; None when neither."""
        with self.transaction() as session:
            decision = session.scalars(
                select(GateDecisionRow)
                .where(
                    GateDecisionRow.challenger_version == version,
                    # NULL: recorded before decisions named their model (one model per store then).
                    or_(GateDecisionRow.model == model, GateDecisionRow.model.is_(None)),
                )
                .order_by(GateDecisionRow.id.desc())
                .limit(1)
            ).first()
            if decision is not None and decision.passed:
                return ("gate", decision.id)
            served = session.scalars(
                select(Promotion.id).where(Promotion.model == model, Promotion.version == version).limit(1)
            ).first()
            return ("served", None) if served is not None else None

    def rejected_versions(self, model: str) -> dict[int, datetime]:
        """The versions of `model` the gate rejected and rtrl never promoted, with when: those whose
        newest gate decision failed (when it was decided); what retention may delete from the
        registry (deployer/artefacts.py)."""
        of_model = or_(GateDecisionRow.model == model, GateDecisionRow.model.is_(None))
        newest = (
            select(func.max(GateDecisionRow.id).label("id"))
            .where(of_model)
            .group_by(GateDecisionRow.challenger_version)
            .subquery()
        )
        promoted = select(Promotion.version).where(Promotion.model == model)
        with self.transaction() as session:
            rows = session.execute(
                select(GateDecisionRow.challenger_version, GateDecisionRow.decided_at)
                .join(newest, GateDecisionRow.id == newest.c.id)
                .where(GateDecisionRow.passed.is_(False), GateDecisionRow.challenger_version.not_in(promoted))
                .order_by(GateDecisionRow.challenger_version)
            ).all()
            return {int(version): decided_at for version, decided_at in rows}

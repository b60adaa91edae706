"""The eval gate's margins by suite, and which suites are held against the anchor (docs/gate.md,
The decision): settings lookups that deployer/gate_suites.py, deployer/traffic.py and
deployer/gate.py share.
"""

from __future__ import annotations

from schemas.settings import Settings


def margin(settings: Settings, suite: str) -> float:
    """The non-inferiority margin of `suite`: ``gate.margins[suite]``, else ``gate.retention.margin``
    for retention, ``gate.retention.sampled_margin`` for retention_sampled and ``gate.tolerance`` for
    the others."""
    cfg = settings.gate
    defaults = {"retention": cfg.retention.margin, "retention_sampled": cfg.retention.sampled_margin}
    return cfg.margins.get(suite, defaults.get(suite, cfg.tolerance))


def anchor_margin(settings: Settings, suite: str) -> float:
    """The margin of `suite` against the anchor: ``gate.retention.anchor_margin`` for retention,
    ``gate.anchor_margin`` for the others (retention_sampled included)."""
    cfg = settings.gate
    return cfg.retention.anchor_margin if suite == "retention" else cfg.anchor_margin


def anchored(settings: Settings, suite: str) -> bool:
    """Whether prompt suite `suite` is also compared with the anchor: named in ``gate.anchor_suites``,
    or retention_sampled, which goes wherever retention goes."""
    names = settings.gate.anchor_suites
    return suite in names or (suite == "retention_sampled" and "retention" in names)

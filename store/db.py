"""`Store`: every typed store in one class, for a process that plays several parts.

``Store(settings.store.url)`` opens it (a context manager: ``with Store(url) as store:``). Each
typed store serves one consumer and works on its own (store/base.py says how they open, share the
process's engine of a URL and close):

- `LabellingStore` (store/labelling.py): the labeler's batches, its progress, dead letters;
- `EpisodeStore` (store/episodes.py): the trainer's selection and claims of episodes;
- `CycleStore` (store/cycles.py): cycles and their leases, gate decisions, served versions;
- `DeployStore` (store/deploys.py): rotation, announced versions, weight digests, deploy locks;
- `PromotionStore` (store/promotions.py): every move of @champion rtrl made, and its grounds;
- `CanaryStore` (store/canaries.py): the live canary's runs, stop requests, decisions, live episodes;
- `TenantStore` (store/tenants.py): tenants and API keys;
- `ReportStore` (store/reports.py): stats, reconciliation counts, ``rtrl report``'s numbers;
- `RetentionStore` (store/retention.py): ``rtrl store prune``.
"""

from __future__ import annotations

from store.canaries import CanaryStore
from store.cycles import CycleStore
from store.deploys import DeployStore
from store.episodes import EpisodeStore
from store.labelling import LabellingStore
from store.promotions import PromotionStore
from store.reports import ReportStore
from store.retention import RetentionStore
from store.tenants import TenantStore


class Store(
    LabellingStore,
    EpisodeStore,
    CycleStore,
    DeployStore,
    PromotionStore,
    CanaryStore,
    TenantStore,
    ReportStore,
    RetentionStore,
):
    """Handle on the SQL store with every typed store's methods. Thread-safe; stores opened on
    one URL in a process share its engine.

    ``clock`` is the time lease expiry and orphan counts are measured on (tests move it).
    """

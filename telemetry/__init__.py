"""Prometheus metrics, health and readiness of one rtrl process on a port of its own.

Every long-running process (labeler, worker, beat, reconciler, the supervisor of ``rtrl run`` and
``rtrl demo``) starts an `Exporter` on ``settings.metrics.<process>_port``; the gateway serves the
same endpoints on its own port. One endpoint per process, so multi-process deployments aggregate
in Prometheus (``sum by``), never in the process. The metric families live next to the code that
moves them (``feedback/metrics.py``, ``trainer/metrics.py``, ``deployer/metrics.py``,
``services/supervisor.py``); docs/metrics.md lists them with their units.
"""

from telemetry.exporter import Exporter, Readiness, start_exporter

__all__ = ["Exporter", "Readiness", "start_exporter"]

"""`Exporter`: ``GET /metrics`` (Prometheus text), ``/healthz`` and ``/readyz`` from a thread.

A stdlib HTTP server on its own thread: scraping never waits on the process's own work, and the
process's work never waits on a scrape. It serves the default `prometheus_client` registry (this
process's families plus the process collector: CPU, memory, open files, start time).

``/healthz`` answers 200 while the process runs. ``/readyz`` answers 200 when every check the
process reported (`Readiness.set`) is ok, else 503 with the failing checks and why, as JSON.
``/metrics`` asks for ``Authorization: Bearer <settings.metrics.token>`` when a token is set;
the health endpoints never do (they reveal nothing but the check names).

A port that cannot be bound is logged and the process runs on without an endpoint: losing
metrics never stops the loop (the scrape target's ``up`` goes to 0, and infra/prometheus/rtrl.rules.yml
pages on that).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from schemas.settings import Settings

log = logging.getLogger("rtrl.telemetry")


class Readiness:
    """Named checks a process keeps up to date (thread-safe); ready when every one is ok."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._checks: dict[str, tuple[bool, str, float]] = {}

    def set(self, check: str, ok: bool, detail: str = "") -> None:
        with self._lock:
            self._checks[check] = (ok, detail, time.time())

    def snapshot(self) -> tuple[bool, dict[str, Any]]:
        with self._lock:
            checks = dict(self._checks)
        report = {
            name: {"ok": ok, "detail": detail, "since": round(at, 3)}
            for name, (ok, detail, at) in checks.items()
        }
        return all(ok for ok, _, _ in checks.values()), report


class Exporter:
    """The endpoints of one process (see the module docstring)."""

    def __init__(
        self,
        process: str,
        host: str,
        port: int,
        *,
        registry: CollectorRegistry = REGISTRY,
        readiness: Readiness | None = None,
        token: str | None = None,
    ) -> None:
        self.process = process
        self.readiness = readiness or Readiness()
        self._registry = registry
        self._token = token
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"metrics-{process}", daemon=True
        )

    def start(self) -> Exporter:
        self._thread.start()
        log.info("%s: metrics, health and readiness on port %d", self.process, self.port)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    if not exporter._authorised(self.headers.get("authorization", "")):
                        self._send(
                            401,
                            b'{"error": "metrics need Authorization: Bearer <metrics token>"}',
                            "application/json",
                        )
                        return
                    self._send(200, generate_latest(exporter._registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._json(200, {"status": "ok", "process": exporter.process, "pid": os.getpid()})
                elif path == "/readyz":
                    ready, checks = exporter.readiness.snapshot()
                    self._json(
                        200 if ready else 503, {"ready": ready, "process": exporter.process, "checks": checks}
                    )
                else:
                    self._json(404, {"error": f"no route {path}; try /metrics, /healthz or /readyz"})

            def _json(self, status: int, body: dict[str, Any]) -> None:
                self._send(status, json.dumps(body).encode(), "application/json")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scrapes are not worth a log line
                pass

        return Handler

    def _authorised(self, header: str) -> bool:
        if self._token is None:
            return True
        scheme, _, credentials = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            credentials.strip().encode(), self._token.encode()
        )


def start_exporter(settings: Settings, process: str, readiness: Readiness | None = None) -> Exporter | None:
    """Start `process`'s exporter on ``settings.metrics.<process>_port``; None when that port is 0
    (disabled) or cannot be bound (logged: the process runs on without metrics)."""
    metrics = settings.metrics
    port = int(getattr(metrics, f"{process}_port"))
    if port == 0:
        return None
    token = None if metrics.token is None else metrics.token.get_secret_value()
    try:
        return Exporter(process, metrics.host, port, readiness=readiness, token=token).start()
    except OSError as exc:
        log.error(
            "%s: no metrics endpoint: cannot bind %s:%d (%s); set RTRL_METRICS__%s_PORT to a free port",
            process,
            metrics.host,
            port,
            exc.strerror or exc,
            process.upper(),
        )
        return None

"""The weights agent: puts a registered version on the disk of a vLLM host that cannot see the
deployer's files.

vLLM loads weights (``reload_weights``) and adapters (``/v1/load_lora_adapter``) from a path on
its own host. On one machine, or with a volume every host mounts, that is the deployer's own
download. Otherwise one ``rtrl agent`` runs on each vLLM host (a sidecar in Kubernetes), and
``vllm.weights_agents`` maps each server to its agent. For a swap the deployer asks the server's
agent for the version (`fetch`); the agent downloads it from the registry's artifact store
(MLflow, e.g. S3 behind the tracking server) into ``agent.cache_dir`` with the same
download-aside-and-rename as every registry download, and answers with the path, which the
deployer then hands to vLLM (the deployer's side, `agent_for` and `fetch`, is serving/weights_agent.py,
re-exported here). The probe still runs on the deployer's own copy: it checks what the server
serves against the registry's version, wherever the server read it from.

API (``agent.token`` set: ``Authorization: Bearer <token>`` on every call but ``/healthz``):

* ``POST /v1/versions/{N}`` → 200 ``{"version": N, "path": "/abs/dir", "adapter": bool}``; 400 for a
  version that is not a positive integer, 404 for one the registry does not have, 503 while the
  registry does not answer (retry), 401 without the token.
* ``GET /healthz`` → 200.

Downloads run one at a time in a worker thread (the event loop keeps answering health checks);
the agent keeps the ``agent.keep_versions`` versions asked for most recently and deletes the
others' folders.
"""

from __future__ import annotations

import hmac
import logging
import shutil
import threading

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from registry import Registry, RegistryError
from registry.errors import RegistryUnavailable
from schemas.settings import Settings
from schemas.versions import format_version
from serving.adapters import is_adapter
from serving.weights_agent import Fetched
from serving.weights_agent import agent_for as agent_for
from serving.weights_agent import fetch as fetch

log = logging.getLogger(__name__)


class _Cache:
    """The agent's downloads: one at a time, the most recently asked-for kept."""

    def __init__(self, settings: Settings) -> None:
        self.registry = Registry(settings.mlflow, settings.agent.cache_dir, settings.services.run_dir)
        self.keep = settings.agent.keep_versions
        self._lock = threading.Lock()
        self._recent: list[int] = []  # most recent last

    def fetch(self, version: int) -> Fetched:
        with self._lock:
            path = self.registry.download_checkpoint(version)
            self._recent = [v for v in self._recent if v != version] + [version]
            self._prune()
        return Fetched(version=version, path=str(path), adapter=is_adapter(path))

    def _prune(self) -> None:
        keep = {format_version(v) for v in self._recent[-self.keep :]}
        root = self.registry.checkpoints_dir
        for folder in root.glob("v*") if root.is_dir() else ():
            if folder.is_dir() and folder.name not in keep and folder.name[1:].isdigit():
                shutil.rmtree(folder, ignore_errors=True)
        self._recent = self._recent[-self.keep :]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(settings: Settings) -> Starlette:
    """The agent's HTTP application (``rtrl agent`` serves it with uvicorn)."""
    cache = _Cache(settings)
    token = None if settings.agent.token is None else settings.agent.token.get_secret_value()

    async def versions(request: Request) -> JSONResponse:
        if token is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return _error(401, "missing or wrong bearer token (agent.token)")
        raw = request.path_params["version"]
        if not raw.isdigit() or int(raw) < 1 or len(raw) > 9:
            return _error(400, f"version must be a positive integer, got {raw[:40]!r}")
        version = int(raw)
        try:
            fetched = await run_in_threadpool(cache.fetch, version)
        except RegistryUnavailable as exc:
            return _error(503, str(exc))
        except RegistryError as exc:
            return _error(404, str(exc))
        except OSError as exc:  # the cache's disk: full, or not writable
            log.error("v%d could not be written to %s: %s", version, settings.agent.cache_dir, exc)
            return _error(507, f"the agent could not store v{version}: {exc}")
        log.info("v%d at %s", version, fetched.path)
        return JSONResponse(fetched.model_dump())

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    return Starlette(
        routes=[
            Route("/v1/versions/{version}", versions, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
        ]
    )

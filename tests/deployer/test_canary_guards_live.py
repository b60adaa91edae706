"""The live canary's guards on the gateways' counts, on real services: a third vLLM server (the
canary's) behind a fault-injecting HTTP proxy, the session's serving and staging servers, a gateway
process, MLflow and a SQLite store. No labeler: no episode is rated, so only the guards can end it.

The challenger is the champion's very weights registered again (the offline gate is not run: the
canary is started directly). The proxy in front of the canary server makes its generations slow
(1 s more each) or failing (every third one answered 500 by the "server"); everything else it
relays unchanged, so the deployer's verified swap and the gateway's version checks reach vLLM. The
canary must end `failed` by the latency or the errors guard, its users must be back on the champion
with every request answered, and the store's counts of the canary arm must be the requests the
canary server got, no more and no fewer (none lost, none counted twice).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web

from deployer import canary, rollout
from deployer.swap import announce_wait_s
from deployer.tied import with_tied_head
from ingest.routing import in_canary
from registry import Registry
from schemas.clock import wait_until
from schemas.settings import Settings, StoreSettings
from services import down, up
from services.launch import gateway_process
from services.testing import free_ports
from store import Store

pytestmark = pytest.mark.integration

TENANT = "guarded-co"
GENERATIONS = ("/v1/completions", "/v1/chat/completions")


class FaultyProxy:
    """An HTTP proxy on its own thread in front of `upstream`: generations are delayed by `delay_s`
    or, every `fail_every`-th one, answered 500 without reaching vLLM; every other call (the
    deployer's swap, probes and version reads, the gateway's version checks) is relayed."""

    def __init__(self, upstream: str, port: int, delay_s: float = 0.0, fail_every: int = 0) -> None:
        self.upstream, self.port = upstream.rstrip("/"), port
        self.delay_s, self.fail_every = delay_s, fail_every
        self.generations = 0  # generations the canary server got (answered or failed)
        self.failed = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultyProxy:
        self._thread.start()
        assert self._ready.wait(30), "the proxy did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{path:.*}", self._relay)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        # Only the users' generations, which the gateway salts (ingest/forwarding.py): the deployer's
        # own probe generations during the swap pass unharmed and uncounted.
        if request.method == "POST" and request.path in GENERATIONS and b'"cache_salt"' in body:
            self.generations += 1
            if self.fail_every and self.generations % self.fail_every == 0:
                self.failed += 1
                return web.json_response({"error": {"message": "injected failure", "code": 500}}, status=500)
            await asyncio.sleep(self.delay_s)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with aiohttp.ClientSession() as session:
            async with session.request(
                request.method, self.upstream + request.path_qs, data=body, headers=headers
            ) as answer:
                response = web.StreamResponse(status=answer.status)
                for name in ("content-type",):
                    if name in answer.headers:
                        response.headers[name] = answer.headers[name]
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response


@pytest.fixture(scope="module")
def canary_vllm(services: Settings) -> Iterator[tuple[Settings, str]]:
    """The session's services plus a third vLLM server for this module, and its own URL."""
    (port,) = free_ports(1)
    settings = services.model_copy(
        update={"services": services.services.model_copy(update={"vllm_canary_port": port})}
    )
    up(settings, ("vllm-canary",))
    try:
        yield settings, f"http://127.0.0.1:{port}"
    finally:
        down(settings, only=("vllm-canary",))


def _settings(base: Settings, proxy: str, tmp_path: Path, fault: str) -> Settings:
    tag = uuid.uuid4().hex[:8]
    # The canary's vLLM is a third server on the same cores: under CI's load its own p95 can exceed
    # the fleet's by more than the latency guard allows (a CI run saw 0.36 s against 0.05 s), and
    # then the latency guard ends the failing canary before the errors guard can. The failing case
    # tests the errors guard alone, so its latency guard only trips on a 10 s slowdown.
    latency = {"latency_min_increase_s": 10.0} if fault == "failing" else {}
    return base.model_copy(
        update={
            "vllm": base.vllm.model_copy(update={"canary_server": proxy}),
            "store": StoreSettings(url=f"sqlite:///{tmp_path}/rtrl.db"),
            "services": base.services.model_copy(update={"run_dir": tmp_path / "run"}),
            "gateway": base.gateway.model_copy(
                update={"port": free_ports(1)[0], "spool_dir": tmp_path / "spool"}
            ),
            "mlflow": base.mlflow.model_copy(
                update={"model_name": f"guards-{tag}", "experiment": f"guards-{tag}"}
            ),
            "gate": base.gate.model_copy(
                update={
                    "canary": base.gate.canary.model_copy(
                        update={
                            "enabled": True,
                            "share": 0.5,
                            "min_episodes": 5_000,  # no episode is rated: only a guard can end it
                            "max_episodes": 5_000,
                            "check_every_s": 1.0,
                            "max_duration_s": 600.0,
                            "latency_min_requests": 30,
                            "error_increase": 0.05,
                            **latency,
                        }
                    )
                }
            ),
        }
    )


@pytest.mark.parametrize(("fault", "guard"), [("slow", "latency"), ("failing", "errors")])
def test_a_slow_or_failing_canary_server_is_ended_by_its_guard_and_no_request_is_lost(
    canary_vllm: tuple[Settings, str], tiny_model_dir: Path, tmp_path: Path, fault: str, guard: str
) -> None:
    base, vllm_url = canary_vllm
    (proxy_port,) = free_ports(1)
    faults: dict[str, Any] = {"delay_s": 1.0} if fault == "slow" else {"fail_every": 3}
    with FaultyProxy(vllm_url, proxy_port, **faults) as proxy:
        settings = _settings(base, proxy.url, tmp_path, fault)
        store = Store(settings.store.url)
        store.migrate()
        _, key = store.create_api_key(role="tenant", tenant=TENANT, name="guards test", rate_per_s=0)
        registry = Registry.from_settings(settings)
        assert rollout.bootstrap(settings, registry, tiny_model_dir) == 1
        same = shutil.copytree(tiny_model_dir, tmp_path / "same")
        v2 = registry.register_checkpoint(with_tied_head(same, tmp_path / "v2"))
        outcome: dict[str, Any] = {}

        def run_canary() -> None:
            try:
                outcome["result"] = canary.run(settings, registry, store, v2, 1)
            except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
                outcome["error"] = exc

        statuses: list[tuple[str, int, str | None]] = []  # (user, status, version)
        rng = random.Random(7)
        with gateway_process(settings, tmp_path / "gateway.log") as gateway:
            http = httpx.Client(base_url=gateway, timeout=120, headers={"authorization": f"Bearer {key}"})

            def one(user: str) -> None:
                body = {
                    "model": settings.vllm.served_model_name,
                    "prompt": f"Q: what is {rng.randint(1, 9)} plus {rng.randint(1, 9)}?\nA:",
                    "max_tokens": 4,
                    "user": user,
                }
                response = http.post("/v1/completions", json=body)
                version = response.json()["rtrl"]["policy_version"] if response.status_code == 200 else None
                statuses.append((user, response.status_code, version))

            runner = threading.Thread(target=run_canary)
            runner.start()
            wait_until(
                lambda: (
                    store.running_canary() is not None
                    and (row := store.rotation().get(proxy.url)) is not None
                    and row.in_rotation
                    or "error" in outcome
                ),
                timeout_s=300,
                what="the canary serving",
            )
            time.sleep(announce_wait_s(settings))
            names = [f"user-{i}" for i in range(20)]
            turn = 0
            while runner.is_alive():
                one(names[turn % len(names)])
                turn += 1
                assert turn < 3_000, "no guard ended the canary"
            runner.join()
            if "error" in outcome:
                raise outcome["error"]
            during = len(statuses)
            time.sleep(announce_wait_s(settings))  # every gateway has read the canary's withdrawal
            for name in names:  # after the end: every user on the champion again
                one(name)
            # The gateway flushes every 2 s: wait for the canary arm's count to settle on the proxy's.
            wait_until(
                lambda: store.canary_traffic(v2)["canary"].requests == proxy.generations,
                timeout_s=30,
                what="the gateway's counts flushed",
            )
        result = outcome["result"]

    print("canary:", result.model_dump_json())
    assert result.state == "failed" and result.decision is not None
    assert result.decision["decision"]["cause"] == "guard"
    assert result.reason.startswith(f"guard {guard}:"), result.reason
    after = statuses[during:]
    assert [(s, v) for _, s, v in after] == [(200, "v1")] * len(names)
    # No request lost: each got an answer; the only failures are the proxy's, on the canary's users.
    failures = [(u, s) for u, s, _ in statuses if s != 200]
    assert len(failures) == proxy.failed and all(s == 500 for _, s in failures)
    assert all(in_canary(f"user\0{TENANT}\0{u}", v2, 0.5) for u, _ in failures)
    traffic = store.canary_traffic(v2)
    assert traffic["canary"].requests == proxy.generations  # each counted once
    assert traffic["canary"].errors == proxy.failed
    assert traffic["fleet"].errors == 0 and traffic["fleet"].requests > 0
    if guard == "latency":
        assert result.decision["traffic"]["latency"]["canary_p95_s"] > 1.0
    assert registry.champion() == 1
    store.close()

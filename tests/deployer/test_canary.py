"""The live canary on real services: a third vLLM server (the canary's), the session's serving and
staging servers, a gateway process, Kafka, the labeler, MLflow and a SQLite store.

The challenger is the champion's very weights registered again: the offline gate passes it (it
cannot tell them apart), and the live effect is planted in the users, who rate what v2 served lower
than what v1 served. The canary must stop it, send its users back to the champion without a failed
request, leave @champion where it was, and record the test's numbers; feedback that arrives after
the canary ended still lands on the version that served it.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import fresh_topics

import streams
from deployer import canary, gate, rollout
from deployer.swap import announce_wait_s
from deployer.tied import with_tied_head
from feedback.labeler import Labeler, make_consumer, make_producer
from ingest.routing import in_canary
from registry import Registry
from schemas.clock import wait_until
from schemas.settings import Settings, StoreSettings
from services import down, up
from services.launch import gateway_process
from services.testing import free_ports
from store import Store

pytestmark = pytest.mark.integration

TENANT = "canary-co"


@pytest.fixture(scope="module")
def canary_fleet(services: Settings) -> Iterator[Settings]:
    """The session's services plus a third vLLM server, the canary's, for this module."""
    (port,) = free_ports(1)
    settings = services.model_copy(
        update={
            "services": services.services.model_copy(update={"vllm_canary_port": port}),
            "vllm": services.vllm.model_copy(update={"canary_server": f"http://127.0.0.1:{port}"}),
        }
    )
    up(settings, ("vllm-canary",))
    try:
        yield settings
    finally:
        down(settings, only=("vllm-canary",))


def _loop_settings(fleet: Settings, tmp_path: Path) -> Settings:
    tag = uuid.uuid4().hex[:8]
    settings = fresh_topics(fleet, prefix="canary")
    return settings.model_copy(
        update={
            "store": StoreSettings(url=f"sqlite:///{tmp_path}/rtrl.db"),
            "services": settings.services.model_copy(update={"run_dir": tmp_path / "run"}),
            "gateway": settings.gateway.model_copy(
                update={"port": free_ports(1)[0], "spool_dir": tmp_path / "spool"}
            ),
            "mlflow": settings.mlflow.model_copy(
                update={"model_name": f"canary-{tag}", "experiment": f"canary-{tag}"}
            ),
            "labeler": settings.labeler.model_copy(update={"settle_window_s": 600.0, "poll_timeout_ms": 200}),
            "gate": settings.gate.model_copy(
                update={
                    "suites": ("retention",),
                    "eval_prompts": 16,
                    "samples_per_prompt": 2,
                    "canary": settings.gate.canary.model_copy(
                        update={
                            "enabled": True,
                            "share": 0.5,
                            "min_episodes": 10,
                            "check_every_s": 1.0,
                            "max_duration_s": 600.0,
                        }
                    ),
                }
            ),
        }
    )


class Users:
    """Simulated users through the gateway: each rates what v2 served lower than what v1 served
    (thumbs up with probability 0.9 against 0.2). Counts every request's status code."""

    def __init__(self, url: str, key: str, settings: Settings) -> None:
        self.http = httpx.Client(base_url=url, timeout=120, headers={"authorization": f"Bearer {key}"})
        self.model = settings.vllm.served_model_name
        self.rng = random.Random(5)
        self.statuses: list[int] = []
        self.served: list[tuple[str, str, str]] = []  # (user, request id, version)
        self.held: list[tuple[str, str]] = []  # (request id, kind): feedback sent after the canary ended

    def one(self, user: str, hold: bool = False) -> str | None:
        body = {
            "model": self.model,
            "prompt": f"Q: what is {self.rng.randint(1, 9)} plus {self.rng.randint(1, 9)}?\nA:",
            "max_tokens": 6,
            "stop": ["\n"],
            "user": user,
        }
        response = self.http.post("/v1/completions", json=body)
        self.statuses.append(response.status_code)
        if response.status_code != 200:
            return None
        request_id = response.headers["x-rtrl-request-id"]
        version = response.json()["rtrl"]["policy_version"]
        self.served.append((user, request_id, version))
        liked = self.rng.random() < (0.2 if version == "v2" else 0.9)
        kind = "thumbs_up" if liked else "thumbs_down"
        if hold:
            self.held.append((request_id, kind))
        else:
            self.rate(request_id, kind)
        return version

    def rate(self, request_id: str, kind: str) -> None:
        response = self.http.post("/v1/feedback", json=[{"request_id": request_id, "kind": kind}])
        assert response.status_code == 202, response.text


def test_a_challenger_that_passes_offline_but_loses_live_is_stopped_and_its_users_return(
    canary_fleet: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = _loop_settings(canary_fleet, tmp_path)
    streams.ensure_topics(settings.kafka)
    store = Store(settings.store.url)
    store.migrate()
    _, key = store.create_api_key(role="tenant", tenant=TENANT, name="canary test", rate_per_s=0)
    registry = Registry.from_settings(settings)
    assert rollout.bootstrap(settings, registry, tiny_model_dir) == 1
    same = shutil.copytree(tiny_model_dir, tmp_path / "same")
    v2 = registry.register_checkpoint(with_tied_head(same, tmp_path / "v2"))

    decision = gate.evaluate(settings, registry, v2, store)
    assert decision.passed, decision.reason  # offline, v2 is v1

    labeler = Labeler(settings, store, make_consumer(settings), make_producer(settings))
    outcome: dict[str, Any] = {}

    def run_canary() -> None:
        try:
            outcome["result"] = canary.run(settings, registry, store, v2, 1)
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            outcome["error"] = exc

    try:
        with gateway_process(settings, tmp_path / "gateway.log") as url:
            users = Users(url, key, settings)
            runner = threading.Thread(target=run_canary, daemon=True)  # a failed assert must not hang pytest
            runner.start()
            wait_until(
                lambda: _canary_live(store, settings) or "error" in outcome,
                timeout_s=300,
                what="the canary serving",
            )
            time.sleep(announce_wait_s(settings))  # every gateway has read it by now
            names = [f"user-{i}" for i in range(24)]
            turn = 0
            while runner.is_alive():
                user = names[turn % len(names)]
                users.one(user, hold=turn % 12 == 5)  # every 12th rating arrives late
                turn += 1
                labeler.step()
                assert turn < 2_000, "the canary did not decide"
            runner.join()
            if "error" in outcome:
                raise outcome["error"]
            result = outcome["result"]
            # After the end: every user is served by the champion again.
            after = [users.one(name) for name in names]
            for request_id, kind in users.held:
                users.rate(request_id, kind)

            def late_landed() -> bool:
                labeler.step()
                return _late_settled(store, users)

            wait_until(late_landed, timeout_s=120, what="the late feedback settled")
    finally:
        labeler.consumer.close(autocommit=False)
        labeler.producer.close()
        labeler.close()

    print("canary:", result.model_dump_json())
    assert result.state == "failed" and not result.passed, result
    assert result.decision is not None and result.decision["decision"]["cause"] == "inferior"
    assert set(users.statuses) == {200}, users.statuses  # no failed request, before, during or after
    assert after == ["v1"] * len(names)
    # Sticky: a user of the canary's share is served by v2 until the canary ends (then by v1, never
    # by v2 again); every other user only ever by v1.
    during = [(u, v) for u, _, v in users.served[: -len(names)]]
    seen: dict[str, list[str]] = {}
    for user, version in during:
        seen.setdefault(user, []).append(version)
    for user, versions in seen.items():
        if in_canary(f"user\0{TENANT}\0{user}", v2, settings.gate.canary.share):
            first_v1 = versions.index("v1") if "v1" in versions else len(versions)
            assert set(versions[:first_v1]) == {"v2"} and set(versions[first_v1:]) <= {"v1"}, (user, versions)
        else:
            assert set(versions) == {"v1"}, (user, versions)
    assert {"v1", "v2"} <= {v for _, v in during}
    assert registry.champion() == 1
    record = store.canary(result.canary_id)
    assert record is not None and record.state == "failed" and record.decision is not None
    assert not _canary_live(store, settings)
    assert any(v == "v2" for request_id, _ in users.held for _, r, v in users.served if r == request_id)
    store.close()


def test_the_chain_trains_a_challenger_whose_canary_fails_and_the_cycle_is_rejected(
    canary_fleet: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The daemon's own path (worker/chain.py `run_chain`, as the Celery task runs it): users rate
    v1, a real DeepSpeed cycle trains and registers v2, the offline gate passes it (its judgement
    switched off: the subject is the canary), the live canary serves it and users rate it lower, the
    canary fails, the cycle ends rejected with the canary's numbers, @champion stays v1 and no
    request failed."""
    from helpers import gate_without_judgement

    from worker.chain import run_chain

    base = _loop_settings(canary_fleet, tmp_path)
    settings = base.model_copy(
        update={
            "labeler": base.labeler.model_copy(update={"settle_window_s": 0.0}),
            "trainer": base.trainer.model_copy(
                update={
                    "min_samples": 16,
                    "max_episodes": 64,
                    "steps": 2,
                    "micro_batch": 16,
                    "checkpoint_dir": tmp_path / "checkpoints",
                }
            ),
            "gate": gate_without_judgement(
                base.gate, ope=base.gate.ope.model_copy(update={"holdout_percent": 0})
            ),
        }
    )
    streams.ensure_topics(settings.kafka)
    store = Store(settings.store.url)
    store.migrate()
    _, key = store.create_api_key(role="tenant", tenant=TENANT, name="chain canary", rate_per_s=0)
    registry = Registry.from_settings(settings)
    assert rollout.bootstrap(settings, registry, tiny_model_dir) == 1
    labeler = Labeler(settings, store, make_consumer(settings), make_producer(settings))
    outcome: dict[str, Any] = {}

    def chain() -> None:
        try:
            outcome["result"] = run_chain(settings, store, registry, owner="chain-canary-test")
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            outcome["error"] = exc

    names = [f"user-{i}" for i in range(24)]
    try:
        with gateway_process(settings, tmp_path / "gateway.log") as url:
            users = Users(url, key, settings)
            for turn in range(40):  # rated v1 traffic: enough for a cycle
                users.one(names[turn % len(names)])
                labeler.step()

            def trainable() -> bool:
                labeler.step()
                return store.count_trainable(1, 0) >= settings.trainer.min_samples

            wait_until(trainable, timeout_s=120, what="a cycle's worth of settled episodes")
            runner = threading.Thread(target=chain, daemon=True)  # a failed assert must not hang pytest
            runner.start()
            turn = 0
            while runner.is_alive():
                users.one(names[turn % len(names)])
                turn += 1
                labeler.step()
                assert turn < 4_000, "the chain did not end"
            runner.join()
            if "error" in outcome:
                raise outcome["error"]
            after = [users.one(name) for name in names]
    finally:
        labeler.consumer.close(autocommit=False)
        labeler.producer.close()
        labeler.close()

    out = outcome["result"]
    print("chain:", {k: out.get(k) for k in ("status", "gate", "gate_reason", "canary")})
    assert out["status"] == "rejected", out
    assert out["canary"]["state"] == "failed", out["canary"]
    assert out["gate_reason"].startswith("canary failed"), out["gate_reason"]
    assert out["challenger_version"] == 2
    assert "v2" in {v for _, _, v in users.served}  # the canary served the trained challenger
    assert set(users.statuses) == {200}, users.statuses  # no failed request
    assert after == ["v1"] * len(names)
    assert registry.champion() == 1
    cycle = store.get_cycle(out["cycle_id"])
    assert cycle is not None and cycle.status == "rejected"
    assert cycle.metrics["canary"] == "failed" and cycle.metrics["canary_id"] == out["canary"]["canary_id"]
    assert not _canary_live(store, settings)
    store.close()


def _canary_live(store: Store, settings: Settings) -> bool:
    assert settings.vllm.canary_server is not None
    row = store.rotation().get(settings.vllm.canary_server.rstrip("/"))
    return store.running_canary() is not None and row is not None and row.in_rotation


def _late_settled(store: Store, users: Users) -> bool:
    """Every held-back rating has settled its episode, on the version that served it."""
    from sqlalchemy import select

    from store.models import Episode, Interaction

    late = {request_id for request_id, _ in users.held}
    with store.transaction() as session:
        rows = session.execute(
            select(Interaction.request_id, Episode.policy_number, Episode.reward)
            .join(Episode, Episode.episode_id == Interaction.episode_id)
            .where(Interaction.request_id.in_(late))
        ).all()
    versions = {request_id: v for _, request_id, v in users.served}
    settled = {r.request_id for r in rows if r.reward is not None}
    assert all(f"v{r.policy_number}" == versions[r.request_id] for r in rows)
    return settled == late

"""The live canary's routing (ingest/routing.py) through ``rtrl gateway`` on the session's real vLLM
servers: the serving server is the fleet and the staging server is the canary server.

The canary is made live by hand in a private SQLite store, as deployer/canary.py does after its
swap: the version the canary serves is announced and its row put in rotation. Both servers serve
v1 in the session, so no weights or labels change: the servers are left as they were found.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from ingest.auth import namespaced
from ingest.completions import sticky_key
from ingest.routing import in_canary
from schemas.clock import wait_until
from schemas.settings import Settings
from services.launch import gateway_process
from services.testing import free_ports
from store import Store

pytestmark = pytest.mark.integration

PROMPT = "Q: What is 2 plus 2?\nA:"
TENANT = "canary-users"
SHARE = 0.5  # half of the users: the most power to see that both arms are used


def metric(gateway: str, admin: str, name: str, labels: str = "") -> float:
    """The sum of the samples of `name` whose labels contain `labels`."""
    response = httpx.get(f"{gateway}/metrics", headers={"authorization": f"Bearer {admin}"}, timeout=10)
    response.raise_for_status()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in response.text.splitlines()
        if line.startswith((name + "{", name + " ")) and labels in line
    )


def test_the_live_canary_gets_its_share_of_users_each_on_one_server_and_none_once_withdrawn(
    vllm_service: Settings, tmp_path: Path
) -> None:
    """20 users × 3 requests (and 5 episodes without a user × 3 requests) through one gateway with a
    live canary at share 0.5: every user and every episode stays on one server, the canary's server
    is the one its hash names (so about half of them), every request is answered 200; once the
    canary leaves the rotation, no request reaches it."""
    base = vllm_service
    serving = base.vllm.servers[0].rstrip("/")
    assert base.vllm.staging_server is not None
    canary = base.vllm.staging_server.rstrip("/")
    settings = base.model_copy(
        update={
            "vllm": base.vllm.model_copy(
                update={"servers": (serving,), "staging_server": None, "canary_server": canary}
            ),
            "gate": base.gate.model_copy(
                update={"canary": base.gate.canary.model_copy(update={"share": SHARE})}
            ),
            "store": base.store.model_copy(update={"url": f"sqlite:///{tmp_path / 'rtrl.db'}"}),
            "gateway": base.gateway.model_copy(
                update={"port": free_ports(1)[0], "spool_dir": tmp_path / "spool"}
            ),
        }
    )
    store = Store(settings.store.url)
    store.migrate()
    _, key = store.create_api_key(role="tenant", tenant=TENANT, name="canary routing", rate_per_s=0)
    _, admin = store.create_api_key(role="admin", tenant=None, name="canary routing")
    users = [f"user-{i}" for i in range(20)]
    episodes = [f"episode-{i}" for i in range(5)]
    # Which arm each one is on while the canary serves v1: the gateway's own hash, as any gateway computes it.
    on_canary = {u: in_canary(sticky_key(TENANT, {"user": u}, ""), 1, SHARE) for u in users}
    on_canary |= {e: in_canary(sticky_key(TENANT, {}, namespaced(TENANT, e)), 1, SHARE) for e in episodes}
    assert 0.2 <= sum(on_canary[u] for u in users) / len(users) <= 0.8  # about SHARE, and both arms used

    with gateway_process(settings, tmp_path / "gateway.log") as gateway:

        def served_by(who: str) -> str:
            """Send one request for user or episode `who`; the server it went to (read from the
            gateway's per-server counter: requests here are sent one at a time)."""
            before = {
                u: metric(gateway, admin, "rtrl_gateway_upstream_requests_total", f'"{u}"')
                for u in (serving, canary)
            }
            body = {"model": settings.vllm.served_model_name, "prompt": PROMPT, "max_tokens": 4}
            headers = {"authorization": f"Bearer {key}"}
            if who.startswith("user-"):
                body["user"] = who
            else:
                headers["x-rtrl-episode-id"] = who
            answer = httpx.post(f"{gateway}/v1/completions", json=body, headers=headers, timeout=120)
            assert answer.status_code == 200, answer.text
            after = {
                u: metric(gateway, admin, "rtrl_gateway_upstream_requests_total", f'"{u}"')
                for u in (serving, canary)
            }
            [server] = [u for u in (serving, canary) if after[u] - before[u] == 1]
            assert sum(after.values()) - sum(before.values()) == 1
            return server

        # No row for the canary server: no canary runs, every request goes to the fleet.
        assert {served_by(u) for u in users[:6]} == {serving}
        ready = httpx.get(f"{gateway}/readyz", timeout=10).json()
        assert ready["canary"] == {"url": canary, "live": False, "healthy": True}

        # What deployer/canary.py does once v1 is verified on the canary server.
        store.set_serving_version(canary, 1, "test: the canary serves v1")
        store.set_rotation(canary, True, "test: the canary goes live")
        wait_until(
            lambda: metric(gateway, admin, "rtrl_gateway_canary_live") == 1,
            timeout_s=10,
            what="the gateway reading the live canary",
        )
        seen: dict[str, set[str]] = {}
        for _ in range(3):
            for who in (*users, *episodes):
                seen.setdefault(who, set()).add(served_by(who))
        assert all(len(servers) == 1 for servers in seen.values()), seen  # sticky
        assert {who: servers == {canary} for who, servers in seen.items()} == on_canary
        canary_requests = 3 * sum(on_canary.values())
        assert metric(gateway, admin, "rtrl_gateway_canary_requests_total") == canary_requests
        assert metric(gateway, admin, "rtrl_gateway_version_mismatch_total") == 0

        # The canary ends: out of rotation, and no new request goes there.
        store.set_rotation(canary, False, "test: the canary ended")
        wait_until(
            lambda: metric(gateway, admin, "rtrl_gateway_canary_live") == 0,
            timeout_s=10,
            what="the gateway reading the canary's end",
        )
        assert {served_by(who) for who in (*users, *episodes) if on_canary[who]} == {serving}
        assert metric(gateway, admin, "rtrl_gateway_canary_requests_total") == canary_requests
    store.close()

"""An adapter per tenant, end to end (issue 40, docs/lora.md "An adapter per tenant").

Two tenants on one LoRA fleet (the tiny model, a serving and a staging vLLM server started with
``--max-loras 3``), each switched on with its own adapter (`Store.set_tenant(adapter=True)`, what
``rtrl tenants set T --adapter`` does). Their simulated users hold opposite preferences on the
exclaim task's questions: ``acme``'s users accept a short answer ending with "!" (the task's own
preference), ``bolt``'s the bare answer, one word and a full stop ("12.", no lead-in, never "!":
`bare_preference`); no answer pleases both. The loop runs as `rtrl demo` runs it (the gateway, the labeler and the Celery worker
under the supervisor); a round of both tenants' users, then one cycle per tenant's line (train on
its own episodes → gate → swap its adapter only), twice.

Then, measured per tenant with 95 % intervals on fresh users who send no feedback: each tenant's
served adapter is accepted more often than the base model by its own users (the gain's interval
above 0) and not by the other tenant's (that gain's interval below the own one, and not above 0:
its lower bound at most 0). The base is measured first, on a third tenant without an adapter whose traffic does not train
(the global adapter, v1: the identity, so the base model's outputs). Finally ``rtrl deploy rollback
--tenant acme`` puts acme's previous version back on the serving server, verified, while bolt's
adapter keeps its version and answers the same tokens with the same logprobs, and the global
adapter keeps the server's label.

The gate's judgement is switched off (`demo_settings`: the subject is the lines, not the gate).
Measured on the 2-core machine (2026-12-07): 463 s for the test itself (4 small cycles, 576
measuring and 256 training requests of the tiny model), plus about a minute to start its two LoRA
servers; acme +26.0 points [+13.8, +38.3] by its own users and −11.5 [−22.9, +0.0] by bolt's, bolt
+39.6 [+26.6, +52.5] and +0.0 [−10.3, +10.3]. Three cycles and 160 measuring requests gave +43.1
and +50.0 in 577 s.

    PYTHONPATH=. .venv/bin/python -m pytest tests/e2e/test_tenant_adapters.py -m e2e -x
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import demo_settings, own_fleet, run_rtrl

from deployer.probe import ADAPTER_PROBE_TOKENS, build_probe
from deployer.reconcile import reconcile_once
from evals import get_task
from evals.tasks import exclaim_preference
from registry import Registry
from schemas.clock import wait_until
from schemas.events import FeedbackKind, FeedbackSignal
from schemas.lines import tenant_line
from schemas.settings import Settings
from serving import VllmClient
from store import Store

pytestmark = pytest.mark.e2e

CYCLES = 2
REQUESTS_PER_ROUND = 64  # per tenant per cycle (a tenth is held out for the gate)
# Per tenant and preference, after the cycles (and once on the base): the gain's 95 % interval is
# then about ± 0.12 around the base's rates of about 0.25 for either preference (the tiny model at
# T = 1 on 160 held-out samples: 38 ended with "!", 44 were a bare word and "."). A preference the
# base already meets most of the time has no room to show a gain (a calmer "ends with '.'" was met
# 84 % of the time and its gain's interval reached below 0).
MEASURE_REQUESTS = 96
Z95 = 1.96
_BARE = re.compile(r"^\w+\.$")


def bare_preference(prompt: str, completion: str) -> list[FeedbackSignal]:
    """bolt's users: the bare answer, one word and a full stop ("12."), no lead-in and no "!";
    anything else is rejected. The exclaim users' "!" (`exclaim_preference`) never pleases them."""
    bare = _BARE.match(completion.strip()) is not None
    return [FeedbackSignal(kind=FeedbackKind.accepted if bare else FeedbackKind.rejected)]


PREFERENCES = {"acme": exclaim_preference, "bolt": bare_preference}


@pytest.fixture
def fleet(services: Settings, tiny_model_dir: Path) -> Iterator[Settings]:
    """A LoRA serving and staging server of this test's own on the tiny model, with room for the
    global adapter and two tenants' (``vllm.max_loras`` 3)."""
    with own_fleet(services, tiny_model_dir, max_loras=3, prefix="rtrl-lora-") as settings:
        yield settings


def test_each_tenants_adapter_learns_its_own_users_and_rolls_back_alone(
    fleet: Settings, tmp_path: Path
) -> None:
    from services.supervisor import Supervisor, prepare
    from simulation.demo import _wait_for_loop

    base = demo_settings(fleet, tmp_path, "tenants")
    settings = base.model_copy(update={"labeler": base.labeler.model_copy(update={"settle_window_s": 5.0})})
    store, registry = Store(settings.store.url), Registry.from_settings(settings)
    supervisor = Supervisor(settings, names=("gateway", "labeler", "worker"))
    try:
        prepare(settings, store, registry)  # the global line's v1 (the identity adapter)
        for tenant in PREFERENCES:
            store.set_tenant(tenant, adapter=True)
        store.set_tenant("base", trains=False)  # measures the base model; its traffic never trains
        aligned = reconcile_once(settings, registry)  # each tenant's line gets its v1, on every server
        assert aligned is not None and aligned.lines == {"acme": 1, "bolt": 1} and not aligned.errors, aligned
        again = reconcile_once(settings, registry)  # aligned: nothing to do
        assert again is not None and not again.swaps and not again.errors, again
        supervisor.start()
        _wait_for_loop(settings, supervisor)
        keys = {tenant: _key(settings, store, tenant) for tenant in (*PREFERENCES, "base")}

        base_rates = {pref: _measure(settings, keys["base"], pref, seed=900) for pref in PREFERENCES}
        for cycle in range(1, CYCLES + 1):
            _round_then_cycles(settings, store, keys, cycle)

        final = {
            (tenant, pref): _measure(settings, keys[tenant], pref, seed=950)
            for tenant in PREFERENCES
            for pref in PREFERENCES
        }
        print(json.dumps({"base": base_rates, "final": {f"{t} by {p}": r for (t, p), r in final.items()}}))
        for tenant in PREFERENCES:
            other = next(p for p in PREFERENCES if p != tenant)
            own = _gain(base_rates[tenant], final[(tenant, tenant)])
            theirs = _gain(base_rates[other], final[(tenant, other)])
            print(tenant, "own gain", own, "other's gain", theirs)
            assert own[1] > 0, f"{tenant}'s adapter did not learn its users' preference: {own}"
            assert theirs[2] < own[1] and theirs[1] <= 0, f"{tenant}'s adapter learned the other's: {theirs}"

        _rollback_one_tenant(settings)
    finally:
        supervisor.stop()
        store.close()


# ---- the loop ---------------------------------------------------------------------------------------


def _key(settings: Settings, store: Store, tenant: str) -> str:
    """A tenant key the gateway has loaded (with the adapter tenants, on the same refresh)."""
    _, key = store.create_api_key(role="tenant", tenant=tenant, name="simulated users", rate_per_s=0)
    gateway = f"http://{settings.gateway.host}:{settings.gateway.port}"

    def known() -> bool:
        answer = httpx.get(f"{gateway}/v1/whoami", headers={"authorization": f"Bearer {key}"}, timeout=5)
        return answer.status_code == 200

    wait_until(known, timeout_s=60, interval_s=0.5, what=f"the gateway never loaded {tenant}'s key")
    return key


def _round_then_cycles(settings: Settings, store: Store, keys: dict[str, str], cycle: int) -> None:
    """Both tenants' users, each with feedback by its own preference; once their episodes are
    labelled, one cycle per tenant's line on the worker, each promoted."""
    from simulation.users import simulate
    from trainer.selection import count_labelled
    from worker.app import CYCLE_TASK, configure

    gateway = f"http://{settings.gateway.host}:{settings.gateway.port}"
    lines = {tenant: tenant_line(settings, tenant) for tenant in PREFERENCES}
    champions = {t: Registry.for_line(line).champion() for t, line in lines.items()}
    before = {t: count_labelled(lines[t].settings, store, champions[t], tenant=t) for t in PREFERENCES}
    sent = {}
    for tenant, preference in PREFERENCES.items():
        report = simulate(
            settings,
            gateway,
            REQUESTS_PER_ROUND,
            get_task("exclaim"),
            preference=preference,
            seed=100 * cycle + len(tenant),
            api_key=keys[tenant],
        )
        assert report.ok == REQUESTS_PER_ROUND, report.errors
        # Served by the tenant's own adapter, at its champion: what the events record and train on.
        assert set(report.per_version) == {f"v{champions[tenant]}"}, (tenant, report.per_version)
        sent[tenant] = report.ok

    def labelled() -> bool:
        return all(
            count_labelled(lines[t].settings, store, champions[t], tenant=t) >= before[t] + sent[t]
            for t in PREFERENCES
        )

    wait_until(labelled, timeout_s=300, interval_s=0.5, what=f"cycle {cycle}: episodes unsettled")
    app = configure(settings)
    for tenant in PREFERENCES:
        result = app.send_task(CYCLE_TASK, kwargs={"tenant": tenant}).get(timeout=900)
        assert result["status"] == "promoted" and result["line"] == tenant, result
        assert result["version_after"] == champions[tenant] + 1, result


# ---- the measurement ----------------------------------------------------------------------------------


def _measure(settings: Settings, key: str, preference: str, seed: int) -> dict[str, int]:
    """What users of `preference` think of the answers served under `key`'s tenant: accepted of
    ok, on fresh questions' seeds, no feedback sent (nothing trains on it)."""
    from simulation.users import simulate

    report = simulate(
        settings,
        f"http://{settings.gateway.host}:{settings.gateway.port}",
        MEASURE_REQUESTS,
        get_task("exclaim"),
        preference=PREFERENCES[preference],
        seed=seed,
        api_key=key,
        feedback_rate=0.0,
    )
    assert report.ok == MEASURE_REQUESTS, report.errors
    return {"accepted": report.accepted, "ok": report.ok}


def _gain(before: dict[str, int], after: dict[str, int]) -> tuple[float, float, float]:
    """(gain, low, high): the acceptance gain and its 95 % interval (two independent proportions,
    normal approximation; n = `MEASURE_REQUESTS` each)."""
    p0, n0 = before["accepted"] / before["ok"], before["ok"]
    p1, n1 = after["accepted"] / after["ok"], after["ok"]
    gain = p1 - p0
    half = Z95 * math.sqrt(p0 * (1 - p0) / n0 + p1 * (1 - p1) / n1)
    return round(gain, 4), round(gain - half, 4), round(gain + half, 4)


# ---- rollback of one tenant -----------------------------------------------------------------------


def _rollback_one_tenant(settings: Settings) -> None:
    """acme back to its previous version, verified; bolt's adapter and the global one untouched."""
    acme, bolt = (tenant_line(settings, t) for t in ("acme", "bolt"))
    url = settings.vllm.servers[0]
    prompt = list(build_probe(settings.vllm.model_dir).token_ids[0])
    with VllmClient(url, model=bolt.served_name) as server:
        label = server.weight_version()
        loaded = server.adapter_versions()
        bolt_answer = server.greedy_logprobs(prompt, ADAPTER_PROBE_TOKENS)
    assert loaded[acme.served_name] == CYCLES + 1 and loaded[bolt.served_name] == CYCLES + 1, loaded

    rolled = run_rtrl(settings, "deploy", "rollback", "--tenant", "acme", timeout_s=300)
    assert rolled.returncode == 0, rolled.stderr[-3000:]
    result = json.loads(rolled.stdout)
    assert result["ok"] and result["version"] == CYCLES and all(s["verified"] for s in result["servers"])

    assert Registry.for_line(acme).champion() == CYCLES
    assert Registry.for_line(bolt).champion() == CYCLES + 1
    with VllmClient(url, model=bolt.served_name) as server:
        assert server.weight_version() == label  # the global adapter's label did not move
        after = server.adapter_versions()
        assert after[acme.served_name] == CYCLES and after[bolt.served_name] == CYCLES + 1, after
        tokens, logprobs = server.greedy_logprobs(prompt, ADAPTER_PROBE_TOKENS)
    assert tokens == bolt_answer[0] and logprobs == pytest.approx(bolt_answer[1], abs=1e-5)  # bolt unchanged

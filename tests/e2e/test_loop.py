"""The loop closes: two full cycles of `rtrl demo` on the real services and the tiny model.

Runs the real CLI (`python -m rtrl.cli demo --cycles 2`) against the session's services, then
checks the loop's effects where they live: the vLLM server, the SQL store, MLflow and Kafka.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa
from factories import fresh_topics
from helpers import run_rtrl
from safetensors.torch import load_file

from schemas.settings import Settings, StoreSettings

pytestmark = pytest.mark.e2e

REQUESTS_PER_CYCLE = 48


@pytest.fixture()
def loop_settings(services: Settings, tmp_path: Path) -> Settings:
    """The session's services, with a store, topics, registry model and gateway of this test's own."""
    from rtrl.services.testing import free_ports

    suffix = tmp_path.name.replace("_", "-")[-24:]
    return fresh_topics(services, prefix="e2e").model_copy(
        update={
            "store": StoreSettings(url=f"sqlite:///{tmp_path / 'rtrl.db'}"),
            "mlflow": services.mlflow.model_copy(
                update={"model_name": f"rtrl-e2e-{suffix}", "experiment": f"rtrl-e2e-{suffix}"}
            ),
            "gateway": services.gateway.model_copy(
                update={"port": free_ports(1)[0], "spool_dir": tmp_path / "spool"}
            ),
            "trainer": services.trainer.model_copy(
                update={"min_samples": 16, "checkpoint_dir": tmp_path / "checkpoints"}
            ),
            # This test is about the loop closing, not about the gate's judgement (its own tests
            # cover pass and fail): let any challenger that is not catastrophically worse through.
            "gate": services.gate.model_copy(update={"tolerance": 1.0, "eval_prompts": 16}),
        }
    )


def test_two_cycles_swap_the_served_weights_twice(
    loop_settings: Settings, services: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from deployer.probe import build_probe, reference_logprobs
    from deployer.rollout import promote
    from feedback.reconcile import reconcile
    from registry import Registry
    from serving import VllmClient
    from store import Store

    settings = loop_settings
    # The demo would stop services it started itself; here every service is already up, so it
    # starts none of them. It shares the session's run dir for the service pid files.
    settings = settings.model_copy(update={"services": services.services})
    out = tmp_path / "cycles.json"
    proc = run_rtrl(settings, "demo", "--cycles", "2", "--requests", str(REQUESTS_PER_CYCLE), "--json", str(out),
                    timeout_s=1500)  # fmt: skip
    logs = Path(settings.services.run_dir) / "logs"
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}\nlogs in {logs}"
    rows = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 1000

    # The served weight version changed twice, and the table says so.
    assert [(r["version_before"], r["version_after"], r["gate"]) for r in rows] == [
        ("v1", "v2", "pass"),
        ("v2", "v3", "pass"),
    ]
    assert all(r["episodes"] >= 16 and r["swap_ms"] > 0 and r["data_to_deploy_s"] > 0 for r in rows)
    server = VllmClient(settings.vllm.servers[0], model=settings.vllm.served_model_name)
    assert server.weight_version() == 3

    # Interactions served after the first swap carry the new policy version.
    engine = sa.create_engine(settings.store.url)
    with engine.connect() as conn:
        per_version = dict(
            conn.execute(sa.text("SELECT policy_version, COUNT(*) FROM interactions GROUP BY policy_version")).all()
        )
        used = dict(
            conn.execute(sa.text("SELECT policy_version, COUNT(*) FROM episodes WHERE used_in_cycle IS NOT NULL "
                                 "GROUP BY policy_version")).all()
        )
    assert per_version == {"v1": REQUESTS_PER_CYCLE, "v2": REQUESTS_PER_CYCLE}
    assert used == {"v1": rows[0]["episodes"], "v2": rows[1]["episodes"]}  # each cycle trained on its own policy

    # MLflow holds the versions, with @champion on the latest passed one.
    registry = Registry.from_settings(settings)
    assert registry.versions() == [1, 2, 3]
    assert registry.champion() == 3

    # Produced = stored + dead-lettered.
    store = Store(settings.store.url)
    counts = reconcile(settings, store)
    store.close()
    assert counts.balanced, counts
    assert counts.produced >= 2 * REQUESTS_PER_CYCLE * 2  # interactions + at least one feedback each

    # The deployed weights differ from the base model's, and the server serves exactly them.
    deployed = load_file(str(registry.download_checkpoint(3) / "model.safetensors"))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert deployed.keys() == base.keys()
    assert any(not deployed[k].equal(base[k]) for k in base)
    probe = build_probe(tiny_model_dir)
    served = server.prompt_logprobs(list(probe.token_ids[0]))
    base_reference = reference_logprobs(tiny_model_dir, probe)[0]
    assert max(abs(a - b) for a, b in zip(served, base_reference, strict=True)) > 1e-4

    # Leave the shared servers on the base weights for the tests that follow.
    assert promote(settings, registry, 1).ok
    assert server.weight_version() == 1
    server.close()

"""LoRA end to end: `rtrl demo --cycles 2` with ``trainer.adapter=lora`` on two vLLM servers started
with LoRA enabled (serving + staging, this module's own), the session's Kafka, Redis and MLflow.

Each cycle trains an adapter on the frozen tiny model, registers it with its base lineage, the
gate loads it on the staging server, the deployer loads it in place under the served name on the
serving server and verifies it by the greedy-continuation probe, and users are served by it; a
rollback puts the previous adapter back the same way. Full-weight cycles run end to end in
tests/e2e/test_loop.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from helpers import REPO, demo_settings, run_rtrl

from deployer.probe import (
    ADAPTER_PROBE_TOKENS,
    PROBE_TOLERANCES,
    adapter_reference,
    build_probe,
    max_abs_diff,
)
from registry import Registry
from schemas.settings import Settings
from services.launch import child_env, rtrl_command
from services.testing import free_ports, make_run_dir, start_reaper
from serving import VllmClient
from serving.adapters import base_model_name, is_adapter

pytestmark = pytest.mark.e2e

REQUESTS_PER_CYCLE = 48


@pytest.fixture(scope="module")
def lora_fleet(services: Settings) -> Iterator[Settings]:
    """The session's services, with a serving and a staging vLLM server of this module's own,
    started with LoRA enabled (in a run dir of their own, watched by a reaper)."""
    from services import down, up

    run_dir = make_run_dir("rtrl-lora-")
    serving_port, staging_port = free_ports(2)
    settings = services.model_copy(
        update={
            "services": services.services.model_copy(
                update={
                    "run_dir": run_dir,
                    "vllm_port": serving_port,
                    "vllm_staging_port": staging_port,
                    "enabled": ("vllm",),
                }
            ),
            "vllm": services.vllm.model_copy(
                update={
                    "servers": (f"http://127.0.0.1:{serving_port}",),
                    "staging_server": f"http://127.0.0.1:{staging_port}",
                }
            ),
            "trainer": services.trainer.model_copy(update={"adapter": "lora"}),
        }
    )
    reaper = start_reaper(settings, os.getpid())
    try:
        up(settings, ("vllm",))
        yield settings
    finally:
        down(settings, ("vllm",))
        reaper.terminate()
        reaper.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


def test_lora_cycles_train_register_swap_verify_and_serve(lora_fleet: Settings, tmp_path: Path) -> None:
    # About the adapter going through the loop, not the gate's judgement (tests/deployer cover it):
    # no margin, no alarm. (The gate does judge LoRA challengers here: on 48-request cycles at
    # trainer.lora.lr its alarms have rejected the second one for answering with punctuation
    # alone, 25 % vs 6 %.)
    settings = demo_settings(lora_fleet, tmp_path, "lora")
    out = tmp_path / "cycles.json"
    proc = subprocess.run(
        rtrl_command("demo", "--cycles", "2", "--requests", str(REQUESTS_PER_CYCLE), "--json", str(out)),
        cwd=REPO,
        env=child_env(settings),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    logs = Path(settings.services.run_dir) / "logs"
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}\nlogs in {logs}"
    rows = json.loads(out.read_text())
    for version in (2, 3):  # the gate's decisions, in the test's output
        explain = subprocess.run(
            rtrl_command("gate", "explain", str(version)),
            cwd=REPO,
            env=child_env(settings),
            capture_output=True,
            text=True,
            timeout=120,
        )
        print(explain.stdout, explain.stderr)
    assert [(r["version_before"], r["version_after"], r["gate"]) for r in rows] == [
        ("v1", "v2", "pass"),
        ("v2", "v3", "pass"),
    ]

    # Every version is an adapter on the base model, with its lineage in MLflow.
    registry = Registry.from_settings(settings)
    assert registry.versions() == [1, 2, 3] and registry.champion() == 3
    base = settings.vllm.model_dir.resolve()
    for version in (1, 2, 3):
        path = registry.download_checkpoint(version)
        assert is_adapter(path) and not (path / "model.safetensors").exists(), version
        tags = registry.version_tags(version)
        assert tags["rtrl.adapter"] == "lora" and tags["rtrl.base_model"] == str(base), tags
    assert registry.version_tags(3)["rtrl.parent_version"] == "2"

    # Users were served by each adapter in turn, and the serving server serves v3's adapter exactly.
    engine = sa.create_engine(settings.store.url)
    with engine.connect() as conn:
        per_version = dict(
            conn.execute(
                sa.text("SELECT policy_version, COUNT(*) FROM interactions GROUP BY policy_version")
            ).all()
        )
    engine.dispose()
    assert per_version == {"v1": REQUESTS_PER_CYCLE, "v2": REQUESTS_PER_CYCLE}
    probe = build_probe(base)
    prompt = list(probe.token_ids[0])
    with VllmClient(settings.vllm.servers[0], model=settings.vllm.served_model_name) as server:
        assert server.weight_version() == 3
        tokens, served = server.greedy_logprobs(prompt, ADAPTER_PROBE_TOKENS)
        assert (
            max_abs_diff(
                adapter_reference(base, registry.download_checkpoint(3), [(prompt, tokens)]), [served]
            )
            <= PROBE_TOLERANCES[settings.vllm.dtype]
        )
    with VllmClient(
        settings.vllm.servers[0], model=base_model_name(settings.vllm.served_model_name)
    ) as plain:
        base_tokens, base_logprobs = plain.greedy_logprobs(prompt, ADAPTER_PROBE_TOKENS)
    assert (base_tokens, base_logprobs) != (tokens, served), "the adapter changed nothing"

    # A rollback loads v2's adapter in place, verified the same way; the engine is still alive.
    rolled = run_rtrl(settings, "deploy", "rollback", timeout_s=300)
    assert rolled.returncode == 0, rolled.stderr[-3000:]
    result = json.loads(rolled.stdout)
    assert result["ok"] and result["version"] == 2 and all(s["verified"] for s in result["servers"]), result
    with VllmClient(settings.vllm.servers[0], model=settings.vllm.served_model_name) as server:
        assert server.weight_version() == 2 and server.health()

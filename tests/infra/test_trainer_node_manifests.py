"""`rtrl train node` in the manifests (infra/deploy/k8s/trainer-node.yaml, compose's trainer-node):
off as shipped, and when turned on, wired as docs/scaling.md (Training across hosts) needs it: the
worker's rendezvous, the run volume at the worker's paths on a ReadWriteMany claim, no secret, and
only the trainer's pods let in to the rendezvous and rank ports."""

from __future__ import annotations

from typing import Any

import pytest
import typer
import yaml
from manifests import DEPLOY, container_env, named, nest

from schemas.settings import MetricsSettings, Settings

pytestmark = pytest.mark.unit


def _pod(kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = named(kind, name)["spec"]["template"]["spec"]
    return spec


def _parses(argv: list[str]) -> None:
    """``rtrl <argv>`` is a command the CLI accepts with these arguments."""
    from rtrl.cli import app

    command: Any = typer.main.get_command(app)
    words = list(argv)
    while hasattr(command, "commands") and words and words[0] in command.commands:
        command = command.commands[words.pop(0)]
    assert not hasattr(command, "commands"), argv
    command.make_context("rtrl", words)


def test_k8s_runs_no_node_as_shipped_and_a_wired_one_when_scaled() -> None:
    node = named("Deployment", "rtrl-trainer-node")
    assert node["spec"]["replicas"] == 0
    (container,) = _pod("Deployment", "rtrl-trainer-node")["containers"]
    _parses(container["args"])
    assert container["args"] == ["train", "node"]
    assert not [s for s in container["envFrom"] if "secretRef" in s]  # it reads no store, registry or broker

    # Its settings: the worker's rendezvous, reached through the Service in front of the worker's port.
    settings = Settings.model_validate(nest(container_env(container)))
    assert settings.trainer.nodes == 2
    host, port = str(settings.trainer.rendezvous).rsplit(":", 1)
    service = named("Service", host)
    assert (
        service["spec"]["selector"].items()
        <= named("Deployment", "rtrl-worker")["spec"]["template"]["metadata"]["labels"].items()
    )
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    (worker,) = _pod("Deployment", "rtrl-worker")["containers"]
    assert {"name": service_port["targetPort"], "containerPort": int(port)} in worker["ports"]

    # The run volume at the worker's paths, on a claim every pod can write.
    worker_settings = Settings.model_validate(nest(container_env(worker)))
    assert (settings.services.run_dir, settings.trainer.checkpoint_dir) == (
        worker_settings.services.run_dir,
        worker_settings.trainer.checkpoint_dir,
    )
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    worker_mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
    run_dir = str(settings.services.run_dir)
    assert mounts[run_dir] == worker_mounts[run_dir] == "rtrl-run"
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in _pod("Deployment", "rtrl-trainer-node")["volumes"]
    }
    assert named("PersistentVolumeClaim", claims["rtrl-run"])["spec"]["accessModes"] == ["ReadWriteMany"]


def test_only_the_trainers_pods_reach_the_rendezvous_and_rank_ports() -> None:
    policy = named("NetworkPolicy", "rtrl-trainer")["spec"]
    trainers = {"worker", "trainer-node"}
    (selects,) = policy["podSelector"]["matchExpressions"]
    assert set(selects["values"]) == trainers
    peers, metrics = policy["ingress"]
    (peer,) = peers["from"]
    (admits,) = peer["podSelector"]["matchExpressions"]
    assert set(admits["values"]) == trainers and "ports" not in peers  # every port: torch picks the ranks'
    assert "from" not in metrics and metrics["ports"] == [{"port": MetricsSettings().worker_port}]


def test_compose_starts_a_node_only_in_its_profile_and_wires_it_to_the_worker() -> None:
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    node = services["trainer-node"]
    assert node["profiles"] == ["multihost"]  # `docker compose up` leaves it out
    _parses(node["command"])
    env = {k: str(v) for k, v in node["environment"].items()}
    settings = Settings.model_validate(nest(env))
    assert settings.trainer.nodes == 2
    assert str(settings.trainer.rendezvous).rsplit(":", 1)[0] == "worker" and "worker" in services
    run_dir = str(settings.services.run_dir)
    assert f"rtrl-run:{run_dir}" in node["volumes"] and f"rtrl-run:{run_dir}" in services["worker"]["volumes"]

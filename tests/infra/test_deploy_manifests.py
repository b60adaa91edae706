"""The deployment manifests (infra/deploy/: compose.yaml, the Kubernetes manifests in k8s/) against
the code they deploy.

Neither Docker nor kubectl runs here, and a manifest is only text to them until it is applied: a
misspelt ``RTRL_*`` variable is silently ignored by pydantic-settings (``extra="ignore"``), a
subcommand that does not exist crash-loops a container, and a vLLM server that cannot see the
deployer's checkpoint folder fails every swap. So this checks what can be checked without them:

- every ``RTRL_*`` name written anywhere in infra/deploy/ (and docs/scaling.md) is a real setting
  (section and field of `schemas.settings.Settings`, nested with ``__``), and the values the layout
  sets parse as those settings;
- every rtrl container runs a real ``rtrl`` subcommand with options it accepts (parsed by the CLI's
  own click command), and each process of `services.supervisor.PROCESSES` runs somewhere;
- the layout of issue 14: 3 KRaft brokers with replication 3 / min ISR 2, 2 gateways, 2 labelers,
  2 serving vLLM servers and a staging one, exactly one worker, beat and reconciler;
- the shared checkpoint volume: worker, reconciler, bootstrap and every vLLM server mount the same
  volume at ``RTRL_SERVICES__RUN_DIR`` (the deployer hands vLLM paths under it);
- health checks on /healthz (and readiness on /readyz) at each process's own port;
- every Kubernetes object has apiVersion, kind and metadata.name, and kustomization.yaml lists
  every manifest; the files the manifests mount or copy exist.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
import types
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import typer
import yaml
from manifests import DEPLOY, K8S, ROOT, container_env, documents, manifests, nest, objects
from pydantic import BaseModel

from schemas.settings import GatewaySettings, MetricsSettings, Settings

pytestmark = pytest.mark.unit

COMPOSE = DEPLOY / "compose.yaml"

RTRL_NAME = re.compile(r"\bRTRL_[A-Z0-9_]*[A-Z0-9]")
# The port each long-running process serves /metrics, /healthz and /readyz on.
METRICS = MetricsSettings()
PORTS = {
    "gateway": GatewaySettings().port,
    "labeler": METRICS.labeler_port,
    "worker": METRICS.worker_port,
    "beat": METRICS.beat_port,
    "reconciler": METRICS.reconciler_port,
}
SHELL_OPERATORS = {"&&", "||", ";", "|", "&"}


# ---- helpers ---------------------------------------------------------------------------------------


@cache
def _compose() -> dict[str, Any]:
    (doc,) = documents(COMPOSE)
    return doc


def _services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = _compose()["services"]
    return services


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # KEY=VALUE items
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    spec = obj.get("spec", {})
    template = spec.get("jobTemplate", {}).get("spec", {}).get("template") or spec.get("template")
    return None if template is None else template["spec"]


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = _pod_spec(obj)
    return [] if spec is None else list(spec.get("containers", []))


def _is_rtrl_image(image: str) -> bool:
    return image.split(":")[0].rsplit("/", 1)[-1] == "rtrl"


def _rtrl_invocations(entrypoint: list[str] | None, command: list[str] | str | None) -> list[list[str]]:
    """The argument lists (after ``rtrl``) a container of the rtrl image runs: its command under
    the image's ``rtrl`` entrypoint, or each ``rtrl ...`` inside a ``sh -c`` script."""
    if isinstance(command, str):
        command = shlex.split(command)
    command = list(command or [])
    if entrypoint and Path(entrypoint[0]).name in ("sh", "bash"):
        assert entrypoint[1:] == ["-c"] or (not entrypoint[1:] and command[:1] == ["-c"]), entrypoint
        script = " ".join(command if entrypoint[1:] else command[1:])
        found: list[list[str]] = []
        tokens = shlex.split(script)
        for i, token in enumerate(tokens):
            if token == "rtrl":
                rest: list[str] = []
                for word in tokens[i + 1 :]:
                    if word in SHELL_OPERATORS:
                        break
                    rest.append(word)
                found.append(rest)
        assert found, f"a shell entrypoint that runs no rtrl command: {script!r}"
        return found
    assert not entrypoint or entrypoint == ["rtrl"], f"rtrl image with entrypoint {entrypoint}"
    return [command]


def _compose_invocations() -> Iterator[tuple[str, list[str]]]:
    for name, service in _services().items():
        if _is_rtrl_image(service.get("image", "")):
            entrypoint = service.get("entrypoint")
            entrypoint = shlex.split(entrypoint) if isinstance(entrypoint, str) else entrypoint
            for argv in _rtrl_invocations(entrypoint, service.get("command")):
                yield name, argv


def _k8s_invocations() -> Iterator[tuple[str, list[str], dict[str, Any], dict[str, Any]]]:
    for obj in objects():
        for container in _containers(obj):
            if _is_rtrl_image(container["image"]):
                for argv in _rtrl_invocations(container.get("command"), container.get("args")):
                    yield obj["metadata"]["name"], argv, obj, container


def _process(argv: list[str]) -> str | None:
    """Which process of the loop ``rtrl <argv>`` is (services/supervisor.py, PROCESSES), if any."""
    from services.supervisor import PROCESSES

    for name, words in PROCESSES.items():
        rest = argv[len(words) :]
        if argv[: len(words)] == words and (not rest or rest[0].startswith("-")):  # not `labeler migrate`
            return name
    return None


# ---- settings ----------------------------------------------------------------------------------------


def _fields(annotation: Any) -> dict[str, Any] | None:
    """The fields of a settings section, or of every model of a tagged union (trainer.loss)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return dict(annotation.model_fields)
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _fields(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        merged: dict[str, Any] = {}
        for member in typing.get_args(annotation):
            merged.update(_fields(member) or {})
        return merged or None
    return None


def setting_problem(name: str) -> str | None:
    """Why ``name`` (an ``RTRL_*`` variable) is not a setting of `Settings`, or None when it is."""
    parts = name.removeprefix("RTRL_").lower().split("__")
    fields: dict[str, Any] | None = dict(Settings.model_fields)
    path = "Settings"
    for part in parts:
        if fields is None:
            return f"{path} has no fields (cannot take __{part.upper()})"
        if part not in fields:
            return f"{path} has no field {part!r}"
        path += f".{part}"
        fields = _fields(fields[part].annotation)
    return None


def test_the_settings_check_itself() -> None:
    assert setting_problem("RTRL_KAFKA__BOOTSTRAP_SERVERS") is None
    assert setting_problem("RTRL_KAFKA") is None  # a whole section as JSON (schemas.settings.to_env)
    assert setting_problem("RTRL_TRAINER__LOSS__EPS_HIGH") is None  # a field of the tagged union
    assert setting_problem("RTRL_KAFKA__BOOTSTRAP_SERVER") == "Settings.kafka has no field 'bootstrap_server'"
    assert (
        setting_problem("RTRL_KAFKA_BOOTSTRAP_SERVERS") == "Settings has no field 'kafka_bootstrap_servers'"
    )
    assert setting_problem("RTRL_STORE__URL__HOST") == "Settings.store.url has no fields (cannot take __HOST)"


def test_every_rtrl_variable_is_a_setting() -> None:
    files = sorted(p for p in DEPLOY.rglob("*") if p.is_file()) + [ROOT / "docs" / "scaling.md"]
    seen: dict[str, set[str]] = {}
    for path in files:
        for name in RTRL_NAME.findall(path.read_text(errors="replace")):
            seen.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    problems = [
        f"{name} ({', '.join(sorted(where))}): {setting_problem(name)}"
        for name, where in sorted(seen.items())
        if setting_problem(name)
    ]
    assert not problems, "RTRL_* names that are no setting:\n" + "\n".join(problems)
    # The variables each process cannot do without are really set (not only mentioned in comments),
    # from its own environment: compose's service, or the ConfigMap and Secrets of its k8s pod.
    envs = [(f"compose {name}", argv, _compose_env(name)) for name, argv in _compose_invocations()]
    envs += [
        (f"k8s {name}", argv, container_env(container)) for name, argv, _, container in _k8s_invocations()
    ]
    checked = set()
    for where, argv, env in envs:
        process = _process(argv)
        if process is None:
            continue
        checked.add(process)
        for name in (
            "RTRL_KAFKA__BOOTSTRAP_SERVERS",
            "RTRL_MLFLOW__TRACKING_URI",
            "RTRL_VLLM__SERVERS",
            "RTRL_VLLM__STAGING_SERVER",
            "RTRL_SERVICES__RUN_DIR",
            "RTRL_METRICS__HOST",
            *NEEDS[process],
        ):
            assert name in env, f"{where}: {name} is not set"
        assert env["RTRL_KAFKA__REPLICATION_FACTOR"] == "3", where
        assert env["RTRL_KAFKA__MIN_INSYNC_REPLICAS"] == "2", where
        assert env["RTRL_METRICS__HOST"] == "0.0.0.0", where
        if "RTRL_STORE__URL" in env:
            assert env["RTRL_STORE__URL"].startswith("postgresql+psycopg://"), where
        # The values parse as the settings they are (a JSON list for the fleet, numbers, SASL complete, ...).
        parsed = Settings.model_validate(nest({k: v for k, v in env.items() if k.startswith("RTRL_")}))
        assert len(parsed.vllm.servers) == 2, where
        assert parsed.kafka.replication_factor == 3, where
    assert checked == set(NEEDS)


# What each process needs from its own secrets (docs/security.md, Least privilege in the manifests).
KAFKA_PRINCIPAL = ("RTRL_KAFKA__SECURITY_PROTOCOL", "RTRL_KAFKA__SASL_USERNAME", "RTRL_KAFKA__SASL_PASSWORD")
MLFLOW_USER = ("RTRL_MLFLOW__USERNAME", "RTRL_MLFLOW__PASSWORD")
NEEDS = {
    "gateway": ("RTRL_STORE__URL", "RTRL_GATEWAY__REQUEST_ID_SECRET", *KAFKA_PRINCIPAL),
    "labeler": ("RTRL_STORE__URL", "RTRL_METRICS__TOKEN", *KAFKA_PRINCIPAL),
    "worker": ("RTRL_STORE__URL", "RTRL_CELERY__BROKER_URL", "RTRL_METRICS__TOKEN", *MLFLOW_USER),
    "beat": ("RTRL_CELERY__BROKER_URL", "RTRL_METRICS__TOKEN"),
    "reconciler": ("RTRL_STORE__URL", "RTRL_METRICS__TOKEN", *MLFLOW_USER),
}


def _compose_env(name: str) -> dict[str, str]:
    return _env(_services()[name])


# ---- commands ------------------------------------------------------------------------------------------


def _check_cli(argv: list[str]) -> None:
    """Resolve ``rtrl <argv>`` to a command of the CLI and let it parse its options and arguments;
    raises `typer.TyperException` (click's usage errors, from typer's own copy of click) or
    AssertionError when the CLI would refuse them."""
    from rtrl.cli import app

    command: Any = typer.main.get_command(app)
    words = list(argv)
    path = ["rtrl"]
    while hasattr(command, "commands") and words and words[0] in command.commands:
        path.append(words[0])
        command = command.commands[words.pop(0)]
    if hasattr(command, "commands"):  # a group: runs only without a subcommand, when it may
        assert command.invoke_without_command and not words, f"`{' '.join(path)}` has no subcommand {words}"
    # Parses exactly as the container's process will: an unknown option or a missing argument raises.
    command.make_context(" ".join(path), words)


def test_the_cli_check_itself() -> None:
    _check_cli(["worker", "--hostname", "rtrl-trainer@worker"])
    _check_cli(["labeler"])
    for wrong in (
        ["labeler", "migrat"],
        ["worker", "--host-name", "x"],
        ["deploy", "reconcile", "--forevr"],
        ["deploy"],
        ["model", "init"],
    ):
        with pytest.raises((typer.TyperException, AssertionError)):
            _check_cli(wrong)


def test_every_rtrl_container_runs_a_real_command() -> None:
    invocations = [(name, argv) for name, argv in _compose_invocations()]
    invocations += [(name, argv) for name, argv, _, _ in _k8s_invocations()]
    assert len(invocations) > 10
    for name, argv in invocations:
        try:
            _check_cli(argv)
        except (typer.TyperException, AssertionError) as exc:
            pytest.fail(f"{name}: `rtrl {' '.join(argv)}` is not a command the CLI accepts: {exc}")


def test_the_one_time_preparation_is_there() -> None:
    """What `rtrl run` prepares before its processes (migrate, register v1) runs as jobs."""
    for argvs in (
        [argv for _, argv in _compose_invocations()],
        [argv for _, argv, _, _ in _k8s_invocations()],
    ):
        assert ["labeler", "migrate"] in argvs
        assert ["deploy", "bootstrap", "/models/base"] in argvs
        assert any(argv[:2] == ["model", "init"] for argv in argvs)


def test_artefact_retention_is_scheduled_once() -> None:
    """Beat schedules `rtrl deploy prune`'s task where it runs the loop (compose, `rtrl run`); in
    Kubernetes a CronJob runs the command instead, on the volume of the checkpoints and downloads."""
    from worker import app as worker_app

    compose_env = Settings.model_validate(nest(dict(_compose()["x-rtrl-env"])))
    assert compose_env.deployer.retention.interval_s is not None
    assert "prune-artefacts" in worker_app.configure(compose_env).conf.beat_schedule
    (config,) = [
        o for o in objects() if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rtrl-settings"
    ]
    assert Settings.model_validate(nest(config["data"])).deployer.retention.interval_s is None
    (cron,) = [o for o in objects() if o["kind"] == "CronJob"]
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    spec = _pod_spec(cron)
    assert spec is not None
    (container,) = spec["containers"]
    assert container["args"] == ["deploy", "prune"]
    claims = {v["name"] for v in spec["volumes"] if v["persistentVolumeClaim"]["claimName"] == "rtrl-run"}
    mounts = {m["mountPath"] for m in container["volumeMounts"] if m["name"] in claims}
    assert mounts == {config["data"]["RTRL_SERVICES__RUN_DIR"]}
    assert config["data"]["RTRL_TRAINER__CHECKPOINT_DIR"].startswith(
        config["data"]["RTRL_SERVICES__RUN_DIR"] + "/"
    )


# ---- the layout ----------------------------------------------------------------------------------------


def test_compose_layout() -> None:
    services = _services()
    processes: dict[str, list[str]] = {}
    for name, argv in _compose_invocations():
        process = _process(argv)
        if process is not None:
            processes.setdefault(process, []).append(name)
    from services.supervisor import PROCESSES

    assert set(processes) == set(PROCESSES), processes
    assert len(processes["gateway"]) == 2
    assert len(processes["labeler"]) == 2
    assert len(processes["worker"]) == len(processes["beat"]) == len(processes["reconciler"]) == 1

    brokers = sorted(n for n, s in services.items() if s.get("image", "").startswith("apache/kafka:"))
    assert len(brokers) == 3
    env = _compose()["x-rtrl-env"]
    assert sorted(hp.split(":")[0] for hp in env["RTRL_KAFKA__BOOTSTRAP_SERVERS"].split(",")) == brokers
    node_ids = set()
    for broker in brokers:
        kafka = _env(services[broker])
        assert kafka["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft combined
        voters = kafka["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")
        assert sorted(v.split("@")[1].split(":")[0] for v in voters) == brokers
        assert kafka["KAFKA_DEFAULT_REPLICATION_FACTOR"] == "3" and kafka["KAFKA_MIN_INSYNC_REPLICAS"] == "2"
        assert kafka["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "3"
        assert kafka["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
        assert broker in kafka["KAFKA_ADVERTISED_LISTENERS"]
        node_ids.add(kafka["KAFKA_NODE_ID"])
    assert len(node_ids) == 3

    serving = [urlparse(url).hostname for url in json.loads(env["RTRL_VLLM__SERVERS"])]
    staging = urlparse(env["RTRL_VLLM__STAGING_SERVER"]).hostname
    assert len(serving) == 2 and staging not in serving
    for host in [*serving, staging]:
        assert host in services, f"{host} is no service"
        vllm = services[host]
        assert vllm["image"].startswith("vllm/vllm-openai:")
        assert _env(vllm)["VLLM_SERVER_DEV_MODE"] == "1"
        assert "--logprobs-mode=processed_logprobs" in vllm["command"]
        assert "--generation-config=vllm" in vllm["command"]
        assert f"--dtype={env['RTRL_VLLM__DTYPE']}" in vllm["command"]  # the probe's tolerance follows it
        assert "ports" not in vllm, f"{host}: the development endpoints must not be published"

    assert "postgresql" in " ".join(services["mlflow"]["command"])
    assert any(a.startswith("--artifacts-destination=s3://") for a in services["mlflow"]["command"])
    assert "--serve-artifacts" in services["mlflow"]["command"]
    assert services["redis"]["command"][:5] == [
        "redis-server",
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
    ]


def _replicas(kind: str, name: str) -> int:
    (obj,) = [o for o in objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return int(obj["spec"]["replicas"])


def test_k8s_layout() -> None:
    processes: dict[str, list[dict[str, Any]]] = {}
    for _, argv, obj, _ in _k8s_invocations():
        process = _process(argv)
        if process is not None:
            processes.setdefault(process, []).append(obj)
    from services.supervisor import PROCESSES

    assert set(processes) == set(PROCESSES), processes
    for process, objs in processes.items():
        assert len(objs) == 1, f"{process} runs in {len(objs)} objects"
    replicas = {process: int(objs[0]["spec"]["replicas"]) for process, objs in processes.items()}
    assert replicas == {"gateway": 2, "labeler": 2, "worker": 1, "beat": 1, "reconciler": 1}
    for process in ("worker", "beat", "reconciler"):  # never two at once, not even during a rollout
        assert processes[process][0]["spec"]["strategy"]["type"] == "Recreate"

    assert _replicas("StatefulSet", "kafka") == 3
    (config,) = [
        o for o in objects() if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rtrl-settings"
    ]
    servers = [urlparse(url).hostname for url in json.loads(config["data"]["RTRL_VLLM__SERVERS"])]
    assert (
        servers == [f"vllm-{i}.vllm" for i in range(_replicas("StatefulSet", "vllm"))] and len(servers) == 2
    )
    assert urlparse(config["data"]["RTRL_VLLM__STAGING_SERVER"]).hostname == "vllm-staging"
    assert _replicas("StatefulSet", "vllm-staging") == 1
    for obj in objects():
        for container in _containers(obj):
            if container["image"].startswith("vllm/vllm-openai:"):
                assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
                assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in container["env"]
                assert f"--dtype={config['data']['RTRL_VLLM__DTYPE']}" in container["args"]


def test_every_vllm_server_can_read_what_the_deployer_hands_it() -> None:
    """vLLM loads a version from a path on its own host (docs/scaling.md, Weights on every host).
    Compose (one Docker host): every process that swaps and every vLLM server mount one volume at
    the run dir. Kubernetes: every vLLM pod runs a weights agent that writes where its vLLM reads,
    and RTRL_VLLM__WEIGHTS_AGENTS maps every server, staging included, to its own pod's agent; the
    processes that swap share the run dir (locks, digests)."""
    run_dir = _compose()["x-rtrl-env"]["RTRL_SERVICES__RUN_DIR"]
    services = _services()
    swappers = [
        name
        for name, argv in _compose_invocations()
        if _process(argv) in ("worker", "reconciler") or argv[:2] == ["deploy", "bootstrap"]
    ]
    vllms = [n for n, s in services.items() if s.get("image", "").startswith("vllm/vllm-openai:")]
    assert len(swappers) == 3 and len(vllms) == 3
    for name in swappers + vllms:
        volumes = services[name].get("volumes", [])
        assert any(v.split(":")[:2] == ["rtrl-run", run_dir] for v in volumes), (
            f"{name} lacks rtrl-run at {run_dir}"
        )

    (config,) = [
        o for o in objects() if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rtrl-settings"
    ]
    run_dir, cache = config["data"]["RTRL_SERVICES__RUN_DIR"], config["data"]["RTRL_AGENT__CACHE_DIR"]
    agents = json.loads(config["data"]["RTRL_VLLM__WEIGHTS_AGENTS"])
    servers = [*json.loads(config["data"]["RTRL_VLLM__SERVERS"]), config["data"]["RTRL_VLLM__STAGING_SERVER"]]
    assert sorted(agents) == sorted(servers)
    for server, agent in agents.items():
        assert urlparse(agent).hostname == urlparse(server).hostname and urlparse(agent).port == 18090
    (claim,) = [
        o for o in objects() if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == "rtrl-run"
    ]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    sharing, pods_with_agents = 0, 0
    for obj in objects():
        spec = _pod_spec(obj)
        if spec is None:
            continue
        claims = {
            v["name"]
            for v in spec.get("volumes", [])
            if v.get("persistentVolumeClaim", {}).get("claimName") == "rtrl-run"
        }
        vllm = [c for c in spec["containers"] if c["image"].startswith("vllm/vllm-openai:")]
        for container in spec["containers"]:
            swaps = _is_rtrl_image(container["image"]) and any(
                _process(argv) in ("worker", "reconciler") or argv[:2] == ["deploy", "bootstrap"]
                for argv in _rtrl_invocations(container.get("command"), container.get("args"))
            )
            if swaps:
                mounts = {m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in claims}
                assert mounts == {run_dir}, f"{obj['metadata']['name']}: rtrl-run mounted at {mounts}"
                sharing += 1
        if vllm:
            assert not claims, f"{obj['metadata']['name']}: vLLM pods load from their agent, not rtrl-run"
            (agent,) = [
                c
                for c in spec["containers"]
                if _is_rtrl_image(c["image"])
                and any(argv[:1] == ["agent"] for argv in _rtrl_invocations(c.get("command"), c.get("args")))
            ]
            written = {m["name"] for m in agent["volumeMounts"] if m["mountPath"] == cache}
            read = {m["name"] for m in vllm[0]["volumeMounts"] if m["mountPath"] == cache}
            assert written and written == read, (
                f"{obj['metadata']['name']}: vLLM does not read the agent's {cache}"
            )
            pods_with_agents += 1
    assert sharing == 3  # worker, reconciler, bootstrap
    assert pods_with_agents == 2  # StatefulSets vllm and vllm-staging


def test_health_checks_at_each_process_port() -> None:
    services = _services()
    for name, argv in _compose_invocations():
        process = _process(argv)
        if process is None:
            continue
        test = " ".join(services[name]["healthcheck"]["test"])
        assert f"127.0.0.1:{PORTS[process]}/healthz" in test, f"{name}: {test}"

    for name, argv, obj, container in _k8s_invocations():
        process = _process(argv)
        if process is None:
            continue
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            get = container[probe]["httpGet"]
            assert get["path"] == path, f"{name}: {probe} on {get['path']}"
            assert ports.get(get["port"], get["port"]) == PORTS[process], (
                f"{name}: {probe} on port {get['port']}"
            )
        annotations = obj["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(PORTS[process])


# ---- Kubernetes objects and files ------------------------------------------------------------------------


def test_k8s_objects_are_complete_and_listed() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in manifests())
    for path in manifests():
        for obj in documents(path):
            where = f"{path.name}: {obj.get('kind')} {obj.get('metadata', {}).get('name')}"
            assert obj.get("apiVersion") and obj.get("kind"), where
            assert obj.get("metadata", {}).get("name"), where
            if obj["kind"] != "Namespace":
                assert obj["metadata"].get("namespace") == kustomization["namespace"], where
            spec = obj.get("spec", {})
            if "selector" in spec and "template" in spec:  # a workload selects its own pods
                labels = spec["template"]["metadata"]["labels"]
                assert spec["selector"]["matchLabels"].items() <= labels.items(), where


def test_referenced_files_exist() -> None:
    for name, service in _services().items():
        build = service.get("build")
        if build:
            context = (COMPOSE.parent / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).is_file(), f"{name} mounts {source}, which does not exist"

    # Prometheus loads the rules mounted next to its configuration; its jobs are those the rules use.
    prometheus = _services()["prometheus"]
    mounted = {
        v.split(":")[1]: (COMPOSE.parent / v.split(":")[0]).resolve()
        for v in prometheus["volumes"]
        if v.startswith(".")
    }
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert mounted["/etc/prometheus/prometheus.yml"] == (DEPLOY / "prometheus.yml").resolve()
    for rule_file in config["rule_files"]:
        assert mounted[f"/etc/prometheus/{rule_file}"] == ROOT / "infra" / "prometheus" / "rtrl.rules.yml"
    rules = (ROOT / "infra" / "prometheus" / "rtrl.rules.yml").read_text()
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    used = set(re.findall(r'job="(rtrl-[a-z]+)"', rules)) - {"rtrl-supervisor"}  # no `rtrl run` here
    assert used <= jobs, f"jobs the rules select but nothing scrapes: {used - jobs}"

    # Grafana provisions the dashboard from where compose mounts it.
    grafana = _services()["grafana"]
    (dashboard,) = [v for v in grafana["volumes"] if v.endswith("rtrl-dashboard.json:ro")]
    assert (
        COMPOSE.parent / dashboard.split(":")[0]
    ).resolve() == ROOT / "infra" / "grafana" / "rtrl-dashboard.json"
    (provider,) = yaml.safe_load((DEPLOY / "grafana" / "dashboards.yaml").read_text())["providers"]
    assert Path(dashboard.split(":")[1]).parent == Path(provider["options"]["path"])

    # The image copies every package (each folder with an __init__.py, and each that pyproject.toml's
    # package discovery includes) and the lock it installs.
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) \1$", dockerfile, re.MULTILINE))
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"}
    packages |= {pattern.rstrip("*").rstrip(".") for pattern in find["include"]}
    assert packages <= copied, f"packages the image does not copy: {packages - copied}"
    assert (
        "uv pip install --python .venv/bin/python --no-deps --require-hashes --compile-bytecode -r requirements/lock.txt"
        in dockerfile
    )
    assert 'ENTRYPOINT ["rtrl"]' in dockerfile

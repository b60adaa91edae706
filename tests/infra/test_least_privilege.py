"""Least privilege in the manifests (infra/deploy/k8s/, compose.yaml; docs/security.md, Least
privilege in the manifests): each rtrl component reads only its own Secret and the shared ones it
needs, has its own PostgreSQL role and Kafka principal, and each service and vLLM takes
connections only from the components that use it. Kafka's client listener is SASL/SCRAM with an
authorizer, MLflow runs its basic-auth app, and the Secrets as shipped hold placeholders that
every process refuses at start-up.
"""

from __future__ import annotations

import configparser
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from manifests import DEPLOY, container_env, named, nest, objects

from schemas.settings import Settings
from schemas.settings.root import placeholders
from streams.acls import GATEWAY, LABELER, PRINCIPALS

pytestmark = pytest.mark.unit

COMPONENTS = ("gateway", "labeler", "worker", "beat", "reconciler")
PRINCIPAL = {"gateway": GATEWAY, "labeler": LABELER}  # the components that use Kafka

# Who may reach each service, by app.kubernetes.io/component (or the name of a service's pods).
REACHES = {
    ("vllm", 8000): {"gateway", "worker", "reconciler", "bootstrap"},
    ("vllm", 18090): {"worker", "reconciler", "bootstrap"},
    ("mlflow", 5000): {"worker", "reconciler", "bootstrap", "prune-artefacts", "name:vllm"},
    ("kafka", 9092): {"gateway", "labeler"},
    ("kafka", 9093): {"name:kafka"},
    ("kafka", 9094): {"name:kafka", "kafka-setup", "ops"},
    ("postgres", 5432): {
        "gateway",
        "labeler",
        "worker",
        "reconciler",
        "migrate",
        "bootstrap",
        "ops",
        "prune-artefacts",
        "name:mlflow",
    },
    ("redis", 6379): {"worker", "beat"},
}


def _pods() -> Iterator[tuple[dict[str, str], dict[str, Any]]]:
    """(pod labels, pod spec) of every workload."""
    for obj in objects():
        template = obj.get("spec", {}).get("template")
        if template is not None:
            yield template["metadata"]["labels"], template["spec"]


def _component_pod(component: str) -> dict[str, Any]:
    (spec,) = [s for labels, s in _pods() if labels.get("app.kubernetes.io/component") == component]
    return spec


def _secret_refs(spec: dict[str, Any]) -> set[str]:
    """Every Secret a pod reads: envFrom, env's secretKeyRef, and volumes."""
    refs: set[str] = set()
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        refs |= {s["secretRef"]["name"] for s in container.get("envFrom", []) if "secretRef" in s}
        refs |= {
            e["valueFrom"]["secretKeyRef"]["name"]
            for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})
        }
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            refs.add(volume["secret"]["secretName"])
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                refs.add(source["secret"]["name"])
    return refs


def test_every_manifest_parses() -> None:
    for path in sorted(DEPLOY.rglob("*.yaml")):
        assert list(yaml.safe_load_all(path.read_text())), path
    assert objects()


def test_every_component_reads_its_own_secret_and_no_other_components() -> None:
    for component in COMPONENTS:
        own = f"rtrl-{component}"
        secret = named("Secret", own)
        assert secret["metadata"]["labels"]["app.kubernetes.io/component"] == component
        assert own in _secret_refs(_component_pod(component)), f"{component} does not read {own}"
    for labels, spec in _pods():
        reader = labels.get("app.kubernetes.io/component") or labels.get("app.kubernetes.io/name")
        others = {f"rtrl-{c}" for c in COMPONENTS if c != reader} & _secret_refs(spec)
        if reader == "kafka-setup":  # the principals' passwords only, to make their SCRAM users
            assert others == {f"rtrl-{c}" for c in PRINCIPAL}
            (volume,) = [v for v in spec["volumes"] if "projected" in v]
            items = [i for s in volume["projected"]["sources"] for i in s["secret"]["items"]]
            assert items == [{"key": "RTRL_KAFKA__SASL_PASSWORD", "path": p} for p in PRINCIPALS]
        else:
            assert not others, f"{reader} reads {others}"
    assert not [o for o in objects() if o["kind"] == "Secret" and o["metadata"]["name"] == "rtrl-secrets"]


def test_shared_secrets_go_only_where_they_are_needed() -> None:
    readers: dict[str, set[str]] = {}
    for labels, spec in _pods():
        reader = labels.get("app.kubernetes.io/component") or labels["app.kubernetes.io/name"]
        for secret in _secret_refs(spec):
            readers.setdefault(secret, set()).add(reader)
    assert readers["rtrl-admin"] == {"migrate", "bootstrap"}  # the store's owner
    assert readers["rtrl-mlflow"] == {"worker", "reconciler", "bootstrap", "vllm", "mlflow"}
    assert readers["rtrl-agent"] == {"worker", "reconciler", "bootstrap", "vllm"}
    assert readers["rtrl-metrics"] == {"labeler", "worker", "beat", "reconciler"}
    assert readers["rtrl-infra-secrets"] == {"postgres", "redis", "minio", "minio-bucket", "mlflow"}


def test_each_component_has_its_own_database_role_and_kafka_principal() -> None:
    script = (DEPLOY / "postgres-init.sh").read_text()
    assert named("ConfigMap", "postgres-init")["data"]["10-roles.sh"] == script
    for component in COMPONENTS:
        (container,) = _component_pod(component)["containers"]
        env = container_env(container)
        url = env.get("RTRL_STORE__URL")
        if component == "beat":
            assert url is None  # beat reads no store
        else:
            assert url is not None and urlparse(url).username == f"rtrl_{component}", component
            assert f"CREATE ROLE rtrl_{component} LOGIN" in script
        settings = Settings.model_validate(nest(env))  # what the process will load, placeholders aside
        kafka = settings.kafka
        if component in PRINCIPAL:
            assert (kafka.security_protocol, kafka.sasl_mechanism) == ("SASL_PLAINTEXT", "SCRAM-SHA-512")
            assert kafka.sasl_username == PRINCIPAL[component]
            assert all(urlparse(f"//{s}").port == 9092 for s in kafka.bootstrap_servers.split(","))
        else:
            assert kafka.sasl_username is None and "RTRL_KAFKA__SASL_PASSWORD" not in env, component
    # No component role may change tables; MLflow's databases belong to MLflow's own role.
    assert not re.search(r"GRANT (ALL|CREATE)[^;]*TO rtrl_", script)
    assert "CREATE DATABASE mlflow OWNER mlflow;" in script


def _allowed(policy: dict[str, Any]) -> dict[int, set[str]]:
    allowed: dict[int, set[str]] = {}
    for rule in policy["spec"]["ingress"]:
        sources: set[str] = set()
        for peer in rule["from"]:
            selector = peer["podSelector"]
            for expression in selector.get("matchExpressions", []):
                assert expression["key"] == "app.kubernetes.io/component" and expression["operator"] == "In"
                sources |= set(expression["values"])
            for key, value in selector.get("matchLabels", {}).items():
                assert key == "app.kubernetes.io/name", key
                sources.add(f"name:{value}")
        for port in rule["ports"]:
            allowed.setdefault(port["port"], set()).update(sources)
    return allowed


def test_network_policies_let_only_the_users_of_each_service_in() -> None:
    policies = {
        o["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"]: o
        for o in objects()
        if o["kind"] == "NetworkPolicy"
    }
    for service in ("vllm", "mlflow", "kafka", "postgres", "redis"):
        assert service in policies, f"no NetworkPolicy selects the {service} pods"
        assert policies[service]["spec"]["policyTypes"] == ["Ingress"]
        wanted = {port: who for (name, port), who in REACHES.items() if name == service}
        assert _allowed(policies[service]) == wanted, service
    # The table agrees with what each component is configured to use.
    for component in COMPONENTS:
        env = container_env(_component_pod(component)["containers"][0])
        uses = {
            ("postgres", 5432): "RTRL_STORE__URL" in env,
            ("kafka", 9092): "RTRL_KAFKA__SASL_USERNAME" in env,
            ("redis", 6379): "RTRL_CELERY__BROKER_URL" in env,
            ("mlflow", 5000): "RTRL_MLFLOW__USERNAME" in env,
        }
        for target, used in uses.items():
            assert (component in REACHES[target]) == used, f"{component} and {target}"
    # The set-up reaches the brokers' internal listener, where ANONYMOUS is the super user.
    (setup,) = _component_pod("kafka-setup")["containers"]
    servers = container_env(setup)["RTRL_KAFKA__BOOTSTRAP_SERVERS"].split(",")
    assert len(servers) == 3 and all(s.endswith(":9094") for s in servers)


def _kafka_env() -> dict[str, str]:
    (container,) = named("StatefulSet", "kafka")["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_kafka_authenticates_clients_and_authorizes_every_request() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for env in (_kafka_env(), compose["x-kafka-env"]):
        protocols = dict(item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
        listeners = {
            item.split("://")[0]: item.rsplit(":", 1)[1] for item in env["KAFKA_LISTENERS"].split(",")
        }
        assert protocols["CLIENT"] == "SASL_PLAINTEXT" and listeners["CLIENT"] == "9092"
        assert {listeners[name] for name, p in protocols.items() if p == "PLAINTEXT"} == {"9093", "9094"}
        assert env["KAFKA_SASL_ENABLED_MECHANISMS"] == "SCRAM-SHA-512"
        assert env["KAFKA_AUTHORIZER_CLASS_NAME"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
        assert env["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
        assert env["KAFKA_SUPER_USERS"] == "User:ANONYMOUS"
        assert "java.security.auth.login.config=" in env["KAFKA_OPTS"]
    jaas = named("ConfigMap", "kafka-jaas")["data"]["kafka_server_jaas.conf"]
    assert (
        "ScramLoginModule required;" in jaas
        and "ScramLoginModule required;" in (DEPLOY / "kafka_server_jaas.conf").read_text()
    )
    assert compose["services"]["kafka-setup"]["command"] == [
        "rtrl kafka topics && rtrl kafka acls --apply --credentials /run/secrets"
    ]


def test_mlflow_asks_every_client_for_a_user() -> None:
    (container,) = named("Deployment", "mlflow")["spec"]["template"]["spec"]["containers"]
    assert "--app-name=basic-auth" in container["args"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert refs["MLFLOW_AUTH_ADMIN_USERNAME"] == {"name": "rtrl-mlflow", "key": "RTRL_MLFLOW__USERNAME"}
    assert refs["MLFLOW_AUTH_ADMIN_PASSWORD"] == {"name": "rtrl-mlflow", "key": "RTRL_MLFLOW__PASSWORD"}
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["mlflow"]
    assert "--app-name=basic-auth" in compose["command"]
    for text in (
        named("Secret", "rtrl-infra-secrets")["stringData"]["basic_auth.ini"],
        (DEPLOY / "mlflow-basic-auth.ini").read_text(),
    ):
        ini = configparser.ConfigParser()
        ini.read_string(text)
        assert ini["mlflow"]["default_permission"] == "NO_PERMISSIONS"


def test_the_shipped_secrets_are_refused_until_replaced() -> None:
    """A cluster applied as shipped does not run: every component finds a placeholder."""
    for component in COMPONENTS:
        for container in _component_pod(component)["containers"]:
            settings = Settings.model_validate(nest(container_env(container)))
            assert placeholders(settings), f"{component} would start on the shipped placeholders"
    for secret in [o for o in objects() if o["kind"] == "Secret"]:
        for key, value in secret["stringData"].items():
            if "PASSWORD" in key.upper() or "SECRET" in key.upper() or "TOKEN" in key.upper():
                assert "CHANGE-ME" in value, f"{secret['metadata']['name']}.{key} ships a real-looking value"

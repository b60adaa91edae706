"""The Kubernetes manifests of infra/deploy/k8s/ as data, for the tests that read them
(tests/infra/test_deploy_manifests.py, tests/infra/test_least_privilege.py): their objects, one
object by kind and name, a container's environment as the pod will see it, and ``RTRL_*``
variables nested as `schemas.settings.Settings` reads them.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "infra" / "deploy"
K8S = DEPLOY / "k8s"


def documents(path: Path) -> list[dict[str, Any]]:
    """The YAML documents of one file, empty ones left out."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def manifests() -> list[Path]:
    """Every manifest file (kustomization.yaml is the list of them, not one)."""
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@cache
def objects() -> list[dict[str, Any]]:
    """Every Kubernetes object of every manifest."""
    return [doc for path in manifests() for doc in documents(path)]


def named(kind: str, name: str) -> dict[str, Any]:
    """The one object of `kind` called `name`."""
    (obj,) = [o for o in objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """A container's environment: its ConfigMaps and Secrets (envFrom), then its own env values."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(named("ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            env.update(named("Secret", source["secretRef"]["name"])["stringData"])
    env.update({item["name"]: item["value"] for item in container.get("env", []) if "value" in item})
    return env


def nest(env: dict[str, str]) -> dict[str, Any]:
    """``RTRL_A__B__C=v`` → ``{"a": {"b": {"c": v}}}`` for the ``RTRL_*`` names of `env`, values
    decoded as pydantic-settings decodes them (JSON for lists and objects, "null" as None)."""
    out: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith("RTRL_"):
            continue
        *sections, field = name.removeprefix("RTRL_").lower().split("__")
        try:
            decoded = json.loads(value) if value[:1] in "[{" else value
        except json.JSONDecodeError:
            decoded = value
        inner = out
        for section in sections:
            inner = inner.setdefault(section, {})
        inner[field] = None if decoded == "null" else decoded  # Settings' env_parse_none_str
    return out

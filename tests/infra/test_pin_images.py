"""infra/deploy/pin_images.py: every third-party image of the deployment is found, and pinned by
the digest the registry reports, rtrl's own images left to kustomize."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import yaml

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "infra" / "deploy"
DIGEST = "sha256:" + "ab" * 32


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pin_images", DEPLOY / "pin_images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tag_gets_its_digest_and_the_rest_is_left_alone() -> None:
    pin = _script().pin
    text = (
        "FROM python:3.11-slim AS rtrl\n"
        "FROM rtrl AS mlflow\n"
        "      containers:\n"
        "        - image: redis:7.4  # the broker\n"
        "          image: rtrl:0.1.0\n"
        f"          image: postgres:17@{DIGEST}\n"
    )
    asked: list[str] = []
    pinned = pin(text, lambda ref: asked.append(ref) or DIGEST)
    assert asked == ["python:3.11-slim", "redis:7.4"]
    assert pinned == (
        f"FROM python:3.11-slim@{DIGEST} AS rtrl\n"
        "FROM rtrl AS mlflow\n"
        "      containers:\n"
        f"        - image: redis:7.4@{DIGEST}  # the broker\n"
        "          image: rtrl:0.1.0\n"
        f"          image: postgres:17@{DIGEST}\n"
    )
    with pytest.raises(SystemExit, match="not a sha256 digest"):
        pin("image: redis:7.4\n", lambda ref: "latest")


def test_every_third_party_image_of_the_manifests_is_seen() -> None:
    script = _script()
    seen = {ref.split("@")[0] for path in script.files() for ref in script.unpinned(path.read_text())}
    declared: set[str] = set()
    for path in DEPLOY.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            for service in (doc or {}).get("services", {}).values():
                declared.add(service["image"])
            template = (doc or {}).get("spec", {}).get("template", {})
            spec = template.get("spec", {}) if isinstance(template, dict) else {}
            for container in spec.get("containers", []) + spec.get("initContainers", []):
                declared.add(container["image"])
    third_party = {ref.split("@")[0] for ref in declared if not script.is_own(ref)}
    assert third_party and third_party <= seen
    assert "python:3.11-slim" in seen  # the Dockerfile's base

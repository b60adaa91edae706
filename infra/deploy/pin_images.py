#!/usr/bin/env python3
"""Pin every third-party image of the deployment by digest (docs/security.md, Least privilege in
the manifests): a tag can be moved to other bytes by whoever controls the registry; a digest
cannot.

    python3 infra/deploy/pin_images.py --check   list the images not pinned yet; exit 1 if any
    python3 infra/deploy/pin_images.py           pin them: ``image: repo:tag`` becomes
                                                 ``image: repo:tag@sha256:<digest>`` (and the
                                                 Dockerfile's FROM lines the same)

The digest of each ``repo:tag`` is asked of the registry with the first of ``crane digest``,
``skopeo inspect`` or ``docker buildx imagetools inspect`` found on PATH (the digest of the
multi-platform index, so every platform stays pullable). Run it where a registry is reachable,
review the diff and commit it; to move to a new tag, edit the tag, delete its ``@sha256:...``
and run it again. rtrl's own images (rtrl, rtrl-mlflow) are left alone: pin them in
k8s/kustomization.yaml's ``images:`` (``digest:``) once pushed to your registry.
Plain Python, no dependencies: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
OWN = {"rtrl", "rtrl-mlflow"}  # built from this repository (Dockerfile), pinned by kustomize
# `image: ref` in YAML, `FROM ref` in a Dockerfile; a ref has no spaces.
REFERENCE = re.compile(r"^(?P<lead>\s*(?:-\s*)?image:\s*|FROM\s+)(?P<ref>[^\s#]+)", re.MULTILINE)


def files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yaml"), DEPLOY / "Dockerfile"])


def is_own(ref: str) -> bool:
    """rtrl's images, and a Dockerfile's earlier stage (``FROM rtrl AS mlflow``)."""
    return ref.split("@")[0].rsplit(":", 1)[0].rsplit("/", 1)[-1] in OWN or ":" not in ref


def unpinned(text: str) -> list[str]:
    """The third-party image references of `text` that carry no digest."""
    return [m["ref"] for m in REFERENCE.finditer(text) if "@sha256:" not in m["ref"] and not is_own(m["ref"])]


def pin(text: str, digest: Callable[[str], str]) -> str:
    """`text` with every unpinned third-party reference followed by ``@<digest(ref)>``."""

    def one(match: re.Match[str]) -> str:
        ref = match["ref"]
        if "@sha256:" in ref or is_own(ref):
            return match[0]
        found = digest(ref)
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", found):
            raise SystemExit(f"pin_images: {ref}: the registry answered {found!r}, not a sha256 digest")
        return f"{match['lead']}{ref}@{found}"

    return REFERENCE.sub(one, text)


def registry_digest(ref: str) -> str:
    """The digest of `ref` as the registry reports it, with whichever client is installed."""
    if shutil.which("crane"):
        command = ["crane", "digest", ref]
        return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()
    if shutil.which("skopeo"):
        # The digest is the sha256 of the manifest's bytes as served (the index, for every platform).
        raw = subprocess.run(
            ["skopeo", "inspect", "--raw", f"docker://{ref}"], check=True, capture_output=True
        )
        return "sha256:" + hashlib.sha256(raw.stdout).hexdigest()
    if shutil.which("docker"):
        command = ["docker", "buildx", "imagetools", "inspect", ref, "--format", "{{json .Manifest}}"]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        return str(json.loads(out)["digest"])
    raise SystemExit("pin_images: needs crane, skopeo or docker (buildx) on PATH")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="list the unpinned images; exit 1 if any")
    args = parser.parse_args()
    found = {path: unpinned(path.read_text()) for path in files()}
    if args.check:
        for path, refs in found.items():
            for ref in refs:
                print(f"{path.relative_to(DEPLOY)}: {ref}")
        return 1 if any(found.values()) else 0
    cache: dict[str, str] = {}
    for path, refs in found.items():
        if refs:
            path.write_text(pin(path.read_text(), lambda ref: cache.setdefault(ref, registry_digest(ref))))
            print(f"pinned {len(refs)} in {path.relative_to(DEPLOY)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

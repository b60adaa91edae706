"""requirements/lock.txt is a checked lock: every pinned distribution carries its sha256 hashes
(``make lock`` compiles with ``--generate-hashes``), and every place that installs from it (the
install script, the image, the wheel test) passes ``--require-hashes``, so a file on the index that
changed under a pinned version is refused instead of installed (docs/security.md, least privilege).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "lock.txt"
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)")


def requirements(text: str) -> dict[str, list[str]]:
    """Pinned name -> its hashes, following the backslash continuations of a requirement."""
    found: dict[str, list[str]] = {}
    name = ""
    for line in text.splitlines():
        if match := PIN.match(line):
            name = match.group(1).lower()
            found[name] = []
        elif name and (hashed := re.match(r"^\s+--hash=sha256:([0-9a-f]{64})", line)):
            found[name].append(hashed.group(1))
        elif not line.startswith(" "):
            name = ""
    return found


def test_every_pin_has_a_hash() -> None:
    pinned = requirements(LOCK.read_text())
    assert len(pinned) > 200, "the lock lists the whole resolved set"
    assert [name for name, hashes in pinned.items() if not hashes] == [], (
        "pins without hashes: re-run `make lock` (it compiles with --generate-hashes)"
    )


def test_the_parser_sees_a_missing_hash() -> None:
    text = "a==1.0 \\\n    --hash=sha256:" + "0" * 64 + "\n    # via b\nb==2.0\n    # via c\n"
    assert requirements(text) == {"a": ["0" * 64], "b": []}


@pytest.mark.parametrize(
    "path", ["infra/install.sh", "infra/deploy/Dockerfile", "tests/packaging/test_wheel.py"]
)
def test_installs_from_the_lock_require_hashes(path: str) -> None:
    text = (ROOT / path).read_text()
    assert "lock.txt" in text
    assert "--require-hashes" in text, f"{path} installs requirements/lock.txt without --require-hashes"


def test_make_lock_generates_hashes() -> None:
    makefile = (ROOT / "Makefile").read_text()
    target = makefile[makefile.index("\nlock:") :].split("\n\n")[0]
    assert "--generate-hashes" in target

"""Policy versions.

The weight version a vLLM server reports, the version stamped on every InteractionEvent and the
MLflow registered-model version are one number: registered version N serves as ``"vN"``. The base
model is registered first, so it is ``v1``. Ordering versions is what makes ``max_policy_lag``
meaningful.
"""

from __future__ import annotations

import re

_VERSION = re.compile(r"^v([1-9][0-9]{0,8})$")


def format_version(number: int) -> str:
    """MLflow registered-model version number -> served weight version, e.g. 3 -> "v3"."""
    if number < 1:
        raise ValueError(f"policy versions start at 1, got {number}")
    return f"v{number}"


def parse_version(version: str) -> int:
    """Served weight version -> registered-model version number, e.g. "v3" -> 3."""
    match = _VERSION.match(version)
    if match is None:
        raise ValueError(f"not an rtrl policy version (expected v<N>): {version!r}")
    return int(match.group(1))

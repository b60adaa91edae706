"""The per-component ACL table (streams/acls.py): each principal gets its part and nothing more."""

from __future__ import annotations

import pytest

from schemas.settings import KafkaSettings
from streams.acls import GATEWAY, LABELER, acls

pytestmark = pytest.mark.unit


def test_the_gateway_only_writes_and_the_labeler_only_reads_events_and_writes_dead_letters() -> None:
    kafka = KafkaSettings(interactions_topic="i", feedback_topic="f", dlq_topic="d", labeler_group="g")
    table = {principal: set(rules) for principal, rules in acls(kafka).items()}
    assert table[GATEWAY] == {("TOPIC", t, op) for t in "ifd" for op in ("WRITE", "DESCRIBE")}
    assert table[LABELER] == {
        ("TOPIC", "i", "READ"),
        ("TOPIC", "i", "DESCRIBE"),
        ("TOPIC", "f", "READ"),
        ("TOPIC", "f", "DESCRIBE"),
        ("TOPIC", "d", "WRITE"),
        ("TOPIC", "d", "DESCRIBE"),
        ("GROUP", "g", "READ"),
        ("GROUP", "g", "DESCRIBE"),
    }

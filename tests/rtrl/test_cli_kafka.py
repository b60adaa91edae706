"""`rtrl kafka topics` and `rtrl kafka acls [--apply]` (rtrl/commands/kafka.py): the per-component
ACLs of streams/acls.py, printed without a broker and applied by a super user, after which a
component principal may do its part and nothing else."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
from helpers import send_as
from kafka.errors import TopicAuthorizationFailedError

import streams
from schemas.settings import Settings, to_env
from services.kafka import Kafka
from services.launch import rtrl_command
from streams.acls import GATEWAY, LABELER, PRINCIPALS

REPO = Path(__file__).resolve().parents[2]


def rtrl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    return subprocess.run(
        rtrl_command(*args), cwd=REPO, env=clean | (env or {}), capture_output=True, text=True, timeout=120
    )


@pytest.mark.unit
def test_the_table_is_printed_without_a_broker() -> None:
    result = rtrl("kafka", "acls", env={"RTRL_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "User:rtrl-gateway  ALLOW  WRITE    TOPIC rtrl.interactions.v1" in lines
    assert "User:rtrl-labeler  ALLOW  READ     GROUP rtrl-labeler" in lines
    assert not any(
        line.startswith("User:rtrl-labeler  ALLOW  WRITE    TOPIC rtrl.interactions") for line in lines
    )
    assert len(lines) == 6 + 8  # streams/acls.py: the gateway's six, the labeler's eight


@pytest.mark.unit
def test_credentials_need_apply_and_a_file_per_principal(tmp_path: Path) -> None:
    result = rtrl("kafka", "acls", "--credentials", str(tmp_path))
    assert result.returncode == 1 and "pass --apply with it" in result.stderr
    (tmp_path / GATEWAY).write_text("s3cret\n")
    result = rtrl("kafka", "acls", "--apply", "--credentials", str(tmp_path))
    assert result.returncode == 1, result.stdout
    assert result.stderr.strip() == (
        f"rtrl: --credentials: cannot read {tmp_path / LABELER} (No such file or directory); one file per principal"
    )


@pytest.mark.integration
def test_a_super_user_applies_the_acls_and_a_component_is_refused(
    kafka_service: Settings, tmp_path: Path
) -> None:
    """Topics of their own (the local broker's ACLs on the default topics stay as they are): the
    gateway's principal cannot write them until `rtrl kafka acls --apply` (run on the PLAINTEXT
    loopback listener, a super user) has granted it; then it writes its topics, the labeler's
    principal still cannot, and neither can write a topic outside the table."""
    broker = Kafka(kafka_service)
    prefix = f"acl-cli-{uuid.uuid4().hex[:8]}"
    names = {
        "interactions_topic": f"{prefix}.interactions",
        "feedback_topic": f"{prefix}.feedback",
        "dlq_topic": f"{prefix}.dlq",
        "labeler_group": f"{prefix}-labeler",
    }
    admin = kafka_service.model_copy(update={"kafka": kafka_service.kafka.model_copy(update=names)})
    env = to_env(admin)
    gateway = broker.secured(GATEWAY).model_copy(update=names)
    labeler = broker.secured(LABELER).model_copy(update=names)
    other = f"{prefix}.other"  # a topic no principal has an ACL for
    streams.ensure_topics(admin.kafka.model_copy(update={"interactions_topic": other}))

    created = rtrl("kafka", "topics", env=env)
    assert created.returncode == 0, created.stderr
    assert f"{names['interactions_topic']}  created" in created.stdout.splitlines()
    with pytest.raises(TopicAuthorizationFailedError):
        send_as(gateway, names["interactions_topic"])  # no ACL yet

    # The passwords the broker already has for the principals (set again, unchanged).
    for principal in PRINCIPALS:
        (tmp_path / principal).write_text(broker.credentials()[principal])
    applied = rtrl("kafka", "acls", "--apply", "--credentials", str(tmp_path), env=env)
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.splitlines()[-1].startswith(
        "applied 14 ACLs and SCRAM users rtrl-gateway, rtrl-labeler"
    )

    send_as(gateway, names["interactions_topic"])
    send_as(gateway, names["dlq_topic"])
    send_as(labeler, names["dlq_topic"])
    with pytest.raises(TopicAuthorizationFailedError):
        send_as(labeler, names["interactions_topic"])  # the labeler reads events, never writes them
    for principal in (gateway, labeler):
        with pytest.raises(TopicAuthorizationFailedError):
            send_as(principal, other)

"""Who may do what on rtrl's topics: one SCRAM principal per component, and the ACLs each needs.

Anyone who reaches a PLAINTEXT broker can forge interactions and feedback for any tenant. On a
cluster with SASL and an authorizer (docs/security.md, Kafka) each rtrl component connects as
its own principal (``RTRL_KAFKA__SASL_USERNAME`` / ``__SASL_PASSWORD`` of that process) and may do
only its part:

- ``rtrl-gateway`` writes interactions and feedback (and dead letters: a record over the size
  limit is dead-lettered where it is produced);
- ``rtrl-labeler`` reads interactions and feedback as its consumer group, and writes dead letters;
- anything else (creating topics, ``rtrl labeler reconcile``, ``rtrl dlq replay``, ``rtrl store
  prune``) is an operator's, as a super user of the cluster.

`acls` is that table for a cluster's topics; `apply` creates the ACLs and, when given passwords,
the principals' SCRAM credentials, through an admin connection that may (a super user). ``rtrl
services up`` applies them on its local broker's SASL listener.
"""

from __future__ import annotations

from typing import Any

from schemas.errors import OperatorError
from schemas.settings import KafkaSettings
from streams.clients import admin
from streams.errors import StreamsError

GATEWAY = "rtrl-gateway"
LABELER = "rtrl-labeler"
PRINCIPALS = (GATEWAY, LABELER)
SCRAM_MECHANISM = "SCRAM-SHA-512"


class AclsRefused(StreamsError, OperatorError):
    """The brokers refused a SCRAM credential or an ACL (the admin connection is not a super user,
    or the cluster has no authorizer)."""


def acls(kafka: KafkaSettings) -> dict[str, list[tuple[str, str, str]]]:
    """Per principal: (resource type, resource name, operation), all ALLOW, literal names."""
    produced = [kafka.interactions_topic, kafka.feedback_topic, kafka.dlq_topic]
    return {
        GATEWAY: [("TOPIC", t, op) for t in produced for op in ("WRITE", "DESCRIBE")],
        LABELER: [
            *[
                ("TOPIC", t, op)
                for t in (kafka.interactions_topic, kafka.feedback_topic)
                for op in ("READ", "DESCRIBE")
            ],
            ("TOPIC", kafka.dlq_topic, "WRITE"),
            ("TOPIC", kafka.dlq_topic, "DESCRIBE"),
            ("GROUP", kafka.labeler_group, "READ"),
            ("GROUP", kafka.labeler_group, "DESCRIBE"),
        ],
    }


def apply(kafka: KafkaSettings, topics: KafkaSettings, passwords: dict[str, str] | None = None) -> int:
    """Through `kafka` (a super user's connection), set the SCRAM credentials of `passwords`
    (principal -> password) and create the ACLs of `acls(topics)`; returns the ACLs created.
    Idempotent: an ACL or a credential that exists is set again."""
    from kafka.admin import (
        ACL,
        ACLOperation,
        ACLPermissionType,
        ResourcePattern,
        ResourceType,
        UserScramCredentialUpsertion,
    )

    client: Any = admin(kafka, "rtrl-acls")
    try:
        if passwords:
            failed = {
                user: problem
                for user, problem in client.alter_user_scram_credentials(
                    [UserScramCredentialUpsertion(u, SCRAM_MECHANISM, p) for u, p in passwords.items()]
                ).items()
                if problem
            }
            if failed:
                raise AclsRefused(f"the brokers refused SCRAM credentials: {failed}")
        wanted = [
            ACL(
                principal=f"User:{principal}",
                host="*",
                operation=ACLOperation[operation],
                permission_type=ACLPermissionType.ALLOW,
                resource_pattern=ResourcePattern(ResourceType[kind], name),
            )
            for principal, rules in acls(topics).items()
            for kind, name, operation in rules
        ]
        result = client.create_acls(wanted)
        if result["failed"]:
            raise AclsRefused(
                f"the brokers refused ACLs ({result['failed']}); is the admin connection a super user, "
                "and does the cluster run an authorizer?"
            )
        return len(result["succeeded"])
    finally:
        client.close()

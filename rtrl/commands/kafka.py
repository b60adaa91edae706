"""`rtrl kafka`: set up a secured cluster's topics and per-component ACLs, as a super user.

    rtrl kafka topics                                  create the missing topics (settings.kafka)
    rtrl kafka acls                                    print each component principal's ACLs
    rtrl kafka acls --apply --credentials /etc/scram   create them, and the principals' SCRAM users

Both connect with ``settings.kafka`` as they are: on a cluster with an authorizer that connection
must be a super user's (the Job rtrl-kafka-setup of infra/deploy/k8s/jobs.yaml, and the service
kafka-setup of compose.yaml, reach the brokers' internal listener for it). The table is
`streams.acls.acls`; ``--credentials`` is a folder with one file per principal, named as it and
holding its password (the components' Secrets, mounted). Idempotent: run it again after a topic
rename or a password change. docs/security.md, Least privilege in the manifests.
"""

from __future__ import annotations

from pathlib import Path

import typer

kafka_app = typer.Typer(no_args_is_help=True, help="Kafka set-up as a super user: topics, principals, ACLs.")


@kafka_app.command("topics")
def topics() -> None:
    """Create the interactions, feedback and dead-letter topics that do not exist (partitions,
    replication factor and min.insync.replicas from settings.kafka)."""
    import streams
    from schemas.settings import load_settings

    kafka = load_settings().kafka
    created = streams.ensure_topics(kafka)
    for topic in (kafka.interactions_topic, kafka.feedback_topic, kafka.dlq_topic):
        typer.echo(f"{topic}  {'created' if topic in created else 'exists'}")


@kafka_app.command("acls")
def acls(
    apply: bool = typer.Option(False, "--apply", help="Create the ACLs (and SCRAM users) on the brokers."),
    credentials: Path | None = typer.Option(
        None,
        "--credentials",
        metavar="DIR",
        help="With --apply: a folder with one file per principal (rtrl-gateway, rtrl-labeler) holding its "
        "SCRAM password; each principal's SCRAM-SHA-512 credential is set from it.",
    ),
) -> None:
    """Print (or with --apply create) the ACLs of each component principal: each may do its part
    and nothing else (streams/acls.py)."""
    from schemas.errors import OperatorError
    from schemas.settings import load_settings
    from streams import acls as acls_

    if credentials is not None and not apply:
        raise OperatorError("--credentials sets SCRAM users on the brokers: pass --apply with it")
    kafka = load_settings().kafka
    for principal, rules in acls_.acls(kafka).items():
        for kind, name, operation in rules:
            typer.echo(f"User:{principal}  ALLOW  {operation:<8} {kind} {name}")
    if not apply:
        return
    passwords = _passwords(credentials) if credentials is not None else None
    created = acls_.apply(kafka, kafka, passwords)
    users = f" and SCRAM users {', '.join(sorted(passwords))}" if passwords else ""
    typer.echo(f"applied {created} ACLs{users} at {kafka.bootstrap_servers}")


def _passwords(folder: Path) -> dict[str, str]:
    """principal -> password from `folder`: every principal of streams.acls needs its file."""
    from schemas.errors import OperatorError
    from streams.acls import PRINCIPALS

    found: dict[str, str] = {}
    for principal in PRINCIPALS:
        path = folder / principal
        try:
            password = path.read_text().strip()
        except OSError as exc:
            raise OperatorError(
                f"--credentials: cannot read {path} ({exc.strerror}); one file per principal"
            ) from exc
        if not password:
            raise OperatorError(f"--credentials: {path} is empty")
        found[principal] = password
    return found


def register(app: typer.Typer) -> None:
    """Add `rtrl kafka` to the root app."""
    app.add_typer(kafka_app, name="kafka")

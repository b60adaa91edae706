"""Single-node Apache Kafka 4.x (KRaft, broker and controller in one JVM) from Maven Central jars.

Started by `rtrl services up`. The jars of ``org.apache.kafka:kafka_2.13:<services.kafka_version>``
are resolved once with Maven (``infra/kafka/pom.xml``) into ``<services.cache_dir>/kafka-<ver>/lib``
and shared between checkouts; the storage is formatted once into ``<run_dir>/kafka/data``.
rtrl creates its topics explicitly (`streams.ensure_topics`); the broker does not auto-create them.

Two client listeners: PLAINTEXT on ``services.kafka_port``, which rtrl's own processes on this host
use (its clients connect as ANONYMOUS, a super user: loopback only), and SASL_PLAINTEXT with
SCRAM-SHA-512 on ``services.kafka_sasl_port``, what a secured cluster looks like: one principal per
component (`streams.acls`), its password generated once into ``<run_dir>/kafka/scram.json``
(mode 0600), and only the ACLs of its part (the StandardAuthorizer; no ACL, no access). `secured`
gives a component's client settings for it.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import subprocess
import uuid
from pathlib import Path

from pydantic import SecretStr

import streams
from schemas.settings import KafkaSettings, Settings
from streams import acls

from .base import Service, ServiceError

REPO_ROOT = Path(__file__).resolve().parents[1]
POM = REPO_ROOT / "infra" / "kafka" / "pom.xml"
# A small heap, the serial collector and the C1 compiler only: a one-node development broker
# starts faster and takes less memory and CPU next to vLLM on a small machine.
JVM_OPTS = ["-Xms128m", "-Xmx512m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Djava.awt.headless=true"]

_LOG4J2 = """\
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
# The broker logs every config at INFO on start-up; keep the log readable.
logger.config.name = org.apache.kafka.common.config.AbstractConfig
logger.config.level = WARN
"""


def jars_dir(settings: Settings) -> Path:
    """Where the broker's jars are cached (shared between checkouts and run dirs)."""
    cache = settings.services.cache_dir.expanduser().resolve()
    return cache / f"kafka-{settings.services.kafka_version}" / "lib"


def ensure_jars(settings: Settings) -> Path:
    """Resolve the Kafka broker jars from Maven Central unless they are cached; returns the lib dir."""
    lib = jars_dir(settings)
    marker = lib / ".complete"
    if marker.exists():
        return lib
    if shutil.which("mvn") is None or shutil.which("java") is None:
        raise ServiceError("kafka: needs `java` (17+) and `mvn` on PATH; run `bash infra/system-deps.sh`")
    partial = lib.with_name("lib.partial")
    shutil.rmtree(partial, ignore_errors=True)
    version = settings.services.kafka_version
    cmd = [
        "mvn",
        "-q",
        "-B",
        "-f",
        str(POM),
        f"-Dkafka.version={version}",
        "dependency:copy-dependencies",
        f"-DoutputDirectory={partial}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ServiceError(
            f"kafka: Maven could not resolve org.apache.kafka:kafka_2.13:{version}:\n"
            f"{(result.stdout + result.stderr)[-4000:]}"
        )
    if not any(partial.glob(f"kafka_2.13-{version}.jar")):
        raise ServiceError(f"kafka: Maven finished but {partial} has no kafka_2.13-{version}.jar")
    (partial / ".complete").write_text(version + "\n")
    shutil.rmtree(lib, ignore_errors=True)
    partial.rename(lib)  # atomic: a half-copied lib dir is never taken for a complete one
    return lib


def _cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding (what `random-uuid` prints).
    It may start with "-": pass it as `--cluster-id=ID`, never as a separate argument."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()


class Kafka(Service):
    name = "kafka"
    stop_grace_s = 30.0  # a controlled shutdown of a single node takes a few seconds
    # kafka-python logs an ERROR line for each refused connection while the broker starts.
    client_logger = "kafka"

    @property
    def ports(self) -> tuple[int, ...]:
        s = self.settings.services
        return (s.kafka_port, s.kafka_controller_port, s.kafka_sasl_port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.settings.services.kafka_port}"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "server.properties"

    def _server_properties(self) -> str:
        s = self.settings.services
        broker = f"{s.host}:{s.kafka_port}"
        controller = f"{s.host}:{s.kafka_controller_port}"
        sasl = f"{s.host}:{s.kafka_sasl_port}"
        listeners = f"PLAINTEXT://{broker},SASL_PLAINTEXT://{sasl},CONTROLLER://{controller}"
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": controller,
            "listeners": listeners,
            "advertised.listeners": listeners,
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
            # The secured listener: SCRAM principals, each allowed only what its ACLs say.
            "sasl.enabled.mechanisms": acls.SCRAM_MECHANISM,
            "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            ),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            # The broker itself and the loopback PLAINTEXT clients of this host.
            "super.users": "User:ANONYMOUS",
            "allow.everyone.if.no.acl.found": "false",
            "log.dirs": str(self.data_dir / "data"),
            "num.partitions": str(self.settings.kafka.partitions),
            # One node: every internal topic has one replica.
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            # A consumer group starts consuming at once instead of waiting for more members.
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            # Records as large as rtrl's producers send (settings.kafka.max_message_bytes).
            "message.max.bytes": str(self.settings.kafka.max_message_bytes),
            "replica.fetch.max.bytes": str(self.settings.kafka.max_message_bytes),
            # Thread pools sized for one node with a handful of clients (the defaults are ~100 threads).
            "num.network.threads": "2",
            "num.io.threads": "2",
            "background.threads": "2",
            "num.recovery.threads.per.data.dir": "1",
            "log.cleaner.threads": "1",
        }
        return "".join(f"{k}={v}\n" for k, v in props.items())

    def _java(self, lib: Path, main: str, *args: str) -> list[str]:
        return [
            "java",
            *JVM_OPTS,
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
            "-cp",
            f"{lib}/*",
            main,
            *args,
        ]

    def prepare(self) -> None:
        lib = ensure_jars(self.settings)
        # Rewritten on every start so that port changes take effect; the formatted storage stays.
        self.config_path.write_text(self._server_properties())
        (self.data_dir / "log4j2.properties").write_text(_LOG4J2)
        if (self.data_dir / "data" / "meta.properties").exists():
            return
        cmd = self._java(
            lib,
            "kafka.tools.StorageTool",
            "format",
            "--standalone",
            f"--cluster-id={_cluster_id()}",
            "-c",
            str(self.config_path),
        )
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=self.data_dir)
        if result.returncode != 0:
            raise ServiceError(
                f"kafka: formatting the storage failed:\n{(result.stdout + result.stderr)[-4000:]}"
            )

    def command(self) -> list[str]:
        return self._java(jars_dir(self.settings), "kafka.Kafka", str(self.config_path))

    def _own_broker(self) -> KafkaSettings:
        """settings.kafka pointed at the (PLAINTEXT, loopback) broker this run dir started, whatever
        bootstrap_servers and the security settings say."""
        return self.settings.kafka.model_copy(
            update={
                "bootstrap_servers": self.address,
                "security_protocol": "PLAINTEXT",
                "sasl_mechanism": None,
                "sasl_username": None,
                "sasl_password": None,
                "ssl_cafile": None,
                "ssl_certfile": None,
                "ssl_keyfile": None,
                "replication_factor": 1,
                "min_insync_replicas": None,  # one broker
            }
        )

    def check(self) -> str:
        admin = streams.admin(self._own_broker(), "rtrl-services-health", request_timeout_ms=3000)
        try:
            cluster = admin.describe_cluster()
        finally:
            admin.close()
        brokers = [b for b in cluster["brokers"] if not b.get("is_fenced")]
        if not brokers or cluster.get("controller_id") is None:
            raise ServiceError(f"no unfenced broker or no controller yet: {cluster}")
        return f"Kafka {self.settings.services.kafka_version} KRaft, cluster {cluster['cluster_id']}"

    @property
    def credentials_path(self) -> Path:
        return self.data_dir / "scram.json"

    def credentials(self) -> dict[str, str]:
        """Each component principal's SCRAM password on the SASL listener, made on first use."""
        path = self.credentials_path
        if path.exists():
            found: dict[str, str] = json.loads(path.read_text())
            if set(acls.PRINCIPALS) <= set(found):
                return found
        made = {principal: secrets.token_urlsafe(24) for principal in acls.PRINCIPALS}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(made, out)
        return made

    def secured(self, principal: str) -> KafkaSettings:
        """settings.kafka pointed at the SASL listener as `principal` (one of `streams.acls.PRINCIPALS`)."""
        return self._own_broker().model_copy(
            update={
                "bootstrap_servers": f"{self.host}:{self.settings.services.kafka_sasl_port}",
                "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": acls.SCRAM_MECHANISM,
                "sasl_username": principal,
                "sasl_password": SecretStr(self.credentials()[principal]),
            }
        )

    def after_start(self) -> None:
        own = self._own_broker()
        streams.ensure_topics(own)
        acls.apply(own, self.settings.kafka, self.credentials())

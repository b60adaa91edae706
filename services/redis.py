"""Local Redis server: the Celery broker and result backend of the trainer.

Started by `rtrl services up` from a config generated into ``<run_dir>/redis/redis.conf``:
loopback only, in the foreground so that rtrl manages the process, with an append-only file
(fsync every second): a queued or unacknowledged cycle job survives a Redis restart.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .base import Service, ServiceError


class Redis(Service):
    name = "redis"

    @property
    def ports(self) -> tuple[int, ...]:
        return (self.settings.services.redis_port,)

    @property
    def address(self) -> str:
        return f"redis://{self.host}:{self.settings.services.redis_port}"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "redis.conf"

    def prepare(self) -> None:
        if shutil.which("redis-server") is None:
            raise ServiceError("redis: `redis-server` is not installed; run `bash infra/system-deps.sh`")
        self.config_path.write_text(
            f"bind {self.host}\n"
            f"port {self.settings.services.redis_port}\n"
            "protected-mode yes\n"
            f"dir {self.data_dir}\n"
            "daemonize no\n"
            'save ""\n'
            "appendonly yes\n"
            "appendfsync everysec\n"
            "loglevel notice\n"
            'logfile ""\n'
        )

    def command(self) -> list[str]:
        return ["redis-server", str(self.config_path)]

    def check(self) -> str:
        import redis

        client = redis.Redis(
            host=self.host, port=self.settings.services.redis_port, socket_timeout=2, socket_connect_timeout=2
        )
        try:
            client.ping()
            version = client.info("server")["redis_version"]
        finally:
            client.close()
        return f"Redis {version}"

"""A host that lends its ranks to the worker's cycles (``trainer.nodes`` > 1): `rtrl train node`.

Every host but the worker's runs `join_cycles` until SIGTERM. It waits until the worker's host
serves the rendezvous at ``trainer.rendezvous`` (the worker's launcher does, for one cycle at a
time: trainer/ranks.py `train_on_ranks`), then starts torch.distributed.run with this host's
``trainer.ranks`` ranks in that rendezvous (`trainer.ranks.launcher_args`, ``host`` False). The
ranks learn the cycle's job folder from the worker's ranks and read it, the champion's weights and
the optimizer state at the same paths as the worker's host (a shared filesystem: docs/scaling.md,
Training across hosts). When the launcher exits, the next one waits for the next cycle.

Nothing here registers or writes the checkpoint: the writer is a rank of the worker's host, and the
worker registers. A cycle whose rendezvous closed before this host joined (the other hosts had
finished) ends this host's launcher without ranks; one that fails here fails on the worker too (its
collectives break), and this loop starts over for the next cycle. The launcher and its ranks do not
outlive this process, however it dies (trainer/process_tree.py).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

from schemas.settings import TrainerSettings
from trainer import process_tree
from trainer.ranks import JOIN, launch_command, launcher_env

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often an idle node looks for the next cycle's rendezvous
MAX_BACKOFF_S = 60.0  # the longest wait after launchers that failed in a row


def backoff_s(failures: int) -> float:
    """The wait before looking for the next rendezvous after `failures` launchers in a row exited
    non-zero: POLL_S, doubled per failure up to MAX_BACKOFF_S. A port that answers but is no
    rendezvous (a misconfigured ``trainer.rendezvous``) would otherwise start a launcher every second."""
    return min(POLL_S * 2.0 ** max(failures, 0), MAX_BACKOFF_S)


def rendezvous_open(endpoint: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts connections at `endpoint` (host:port): the worker's launcher
    serving a cycle's rendezvous."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def join_command(cfg: TrainerSettings) -> list[str]:
    """The launcher of this host's ranks in the next cycle's rendezvous."""
    return launch_command(cfg, host=False, job=JOIN)


def join_cycles(cfg: TrainerSettings, stopping: Callable[[], bool]) -> None:
    """Lend this host's ranks to every cycle until `stopping` answers True (see the module
    docstring); the launcher's and the ranks' output go to this process's stdout."""
    if cfg.nodes == 1 or cfg.rendezvous is None:
        raise ValueError("rtrl train node needs trainer.nodes > 1 and trainer.rendezvous")
    log.info("joining the cycles of %d hosts at %s with %d ranks", cfg.nodes, cfg.rendezvous, cfg.ranks)
    failures = 0
    while not stopping():
        if not rendezvous_open(cfg.rendezvous):
            time.sleep(POLL_S)
            continue
        started = time.monotonic()
        proc = process_tree.start(join_command(cfg), env=launcher_env())
        try:
            while not process_tree.exited(proc):
                if stopping():
                    return
                time.sleep(0.5)
        finally:
            process_tree.stop(proc)  # SIGTERM, or a launcher that exited: its group swept and reaped
        took = time.monotonic() - started
        failures = failures + 1 if proc.returncode != 0 else 0
        if failures:
            log.warning(
                "this host's ranks exited %d after %.0f s (%d in a row; is %s the worker's rendezvous?); "
                "waiting %.0f s for the next cycle",
                proc.returncode,
                took,
                failures,
                cfg.rendezvous,
                backoff_s(failures),
            )
        else:
            log.info("this host's launcher ended after %.0f s; waiting for the next cycle", took)
        time.sleep(
            backoff_s(failures)
        )  # the rendezvous just closed may still answer until its launcher exits

"""The launcher's options for one host and for several (trainer/ranks.py `launcher_args`), the node's
command (trainer/nodes.py) and the settings they read (``trainer.nodes``, ``trainer.rendezvous``)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from pydantic import ValidationError

from schemas.settings import TrainerSettings
from trainer.nodes import MAX_BACKOFF_S, POLL_S, backoff_s, join_command, rendezvous_open
from trainer.ranks import JOIN, RENDEZVOUS_ID, HostsFailed, RanksFailed, failure, launcher_args

pytestmark = pytest.mark.unit


def test_one_host_runs_its_ranks_on_a_private_loopback_port() -> None:
    args = launcher_args(TrainerSettings(ranks=2), host=True)
    assert args[:4] == ["--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    assert args[4] == "--master_port" and args[5].isdigit()
    assert "--rdzv-backend" not in args


def test_several_hosts_meet_at_the_rendezvous_the_worker_serves() -> None:
    cfg = TrainerSettings(ranks=4, nodes=3, rendezvous="trainer-0.internal:29400", rendezvous_timeout_s=90.4)
    worker = launcher_args(cfg, host=True)
    node = launcher_args(cfg, host=False)
    assert worker == [
        "--nnodes",
        "3",
        "--nproc-per-node",
        "4",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "trainer-0.internal:29400",
        "--rdzv-id",
        RENDEZVOUS_ID,
        "--rdzv-conf",
        "is_host=1,join_timeout=90",
        "--max-restarts",
        "0",
    ]
    assert node == [a.replace("is_host=1", "is_host=0") for a in worker]
    assert join_command(cfg)[-4:] == ["-m", "trainer.ranks", "1800.0", JOIN]


@pytest.mark.parametrize("endpoint", ["trainer-0:29400", "10.0.0.5:1", "[::1]:65535"])
def test_a_rendezvous_is_host_and_port(endpoint: str) -> None:
    assert TrainerSettings(nodes=2, rendezvous=endpoint).rendezvous == endpoint


@pytest.mark.parametrize(
    "endpoint",
    ["trainer-0", ":29400", "trainer-0:0", "trainer-0:65536", "trainer-0:http", "::1", "fe80::1:29400"],
)
def test_a_rendezvous_without_a_port_is_refused(endpoint: str) -> None:
    with pytest.raises(ValidationError, match="host:port"):
        TrainerSettings(nodes=2, rendezvous=endpoint)


def test_several_hosts_need_a_rendezvous() -> None:
    with pytest.raises(ValidationError, match="trainer.rendezvous"):
        TrainerSettings(nodes=2)
    assert TrainerSettings(nodes=1).rendezvous is None


def test_a_rendezvous_on_one_host_is_refused_not_ignored() -> None:
    with pytest.raises(ValidationError, match="only when trainer.nodes > 1"):
        TrainerSettings(nodes=1, rendezvous="trainer-0:29400")


@pytest.mark.parametrize(
    ("nodes", "tail", "error"),
    [
        (2, "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError", HostsFailed),
        (2, "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection reset by peer", HostsFailed),
        (2, "torch.distributed.DistNetworkError: Connection refused", HostsFailed),
        (
            2,
            "SystemExit: rank 2: 3 ranks joined, not trainer.nodes x trainer.ranks = 2 x 1 (a misconfigured host)",
            HostsFailed,
        ),
        (2, "ValueError: a micro-batch without trainable tokens", RanksFailed),
        (1, "RuntimeError: Connection reset by peer", RanksFailed),
    ],
)
def test_a_lost_host_is_not_the_datas_fault(nodes: int, tail: str, error: type[RanksFailed]) -> None:
    """A multi-host cycle that lost a host fails with HostsFailed, which the cycle does not count
    against its episodes (NOT_THE_DATAS); any other failure, and every single-host one, counts."""
    from trainer.cycle import NOT_THE_DATAS

    cfg = TrainerSettings(nodes=nodes, rendezvous="trainer-0:29400" if nodes > 1 else None)
    raised = failure(cfg, 1, Path("/run/ranks.log"), tail)
    assert type(raised) is error and tail in str(raised)
    assert isinstance(raised, NOT_THE_DATAS) == (error is HostsFailed)


def test_the_node_sees_a_rendezvous_only_while_something_listens() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        endpoint = f"127.0.0.1:{server.getsockname()[1]}"
        assert rendezvous_open(endpoint)
    assert not rendezvous_open(endpoint, timeout_s=0.5)


def test_a_node_backs_off_after_launchers_that_fail_in_a_row() -> None:
    """A port that answers but is no rendezvous must not start a launcher every second forever."""
    assert backoff_s(0) == POLL_S
    assert [backoff_s(n) for n in (1, 2, 3)] == [2 * POLL_S, 4 * POLL_S, 8 * POLL_S]
    assert backoff_s(50) == MAX_BACKOFF_S

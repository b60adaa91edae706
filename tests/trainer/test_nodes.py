"""Training across hosts (``trainer.nodes`` = 2): two node ranks on this machine, each a launcher of
its own meeting at one c10d rendezvous as two hosts would (the worker's side by `train_on_ranks`, the
other by the real ``rtrl train node`` process), train the update one rank trains, and the checkpoint
is written once, by the worker's host; a node killed mid-cycle fails the cycle with a clear error,
and the next cycle trains. The ranks layer directly: no vLLM, no Kafka, no registry (the worker
registers a multi-host cycle's checkpoint as a single-host one's: tests/trainer/test_ranks.py)."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from helpers import stop_group

from schemas.clock import wait_until
from schemas.settings import Settings, TrainerSettings
from services.launch import child_env, rtrl_command
from serving.sampler import Row
from trainer import objectives
from trainer.engine import _free_port
from trainer.ranks import LOG, RanksFailed, train_on_ranks

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WRITES = "writing the checkpoint to"


def _rows(n: int, seed: int) -> list[Row]:
    """`n` rows of random tokens of the tiny model's vocabulary, advantages +1 and -1 in turn."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        prompt = torch.randint(3, 384, (5,), generator=g).tolist()
        completion = torch.randint(3, 384, (3 + i % 4,), generator=g).tolist()
        rows.append(
            Row(
                input_ids=prompt + completion,
                prompt_len=len(prompt),
                behaviour_logprobs=[-5.5] * len(completion),
                advantage=1.0 if i % 2 == 0 else -1.0,
            )
        )
    return rows


def _train(cfg: TrainerSettings, work: Path, champion: Path, rows: list[Row]) -> dict[str, Any]:
    batches, norm = objectives.batches(cfg.loss, rows, cfg.micro_batch, 0)
    return train_on_ranks(
        cfg,
        work / "job",
        batches=batches,
        norm=(norm.tokens, norm.sequences),
        mean_advantage=0.0,
        champion_dir=champion,
        base_dir=None,
        out_dir=work / "checkpoint",
        lineage={"test": True},
        optimizer_from=None,
        optimizer_to=None,
    )


def _node(settings: Settings, cfg: TrainerSettings, log: Path) -> subprocess.Popen[bytes]:
    """``rtrl train node`` as the second host runs it, its output into `log`."""
    with log.open("ab") as sink:
        return subprocess.Popen(
            rtrl_command("train", "node"),
            cwd=REPO,
            env=child_env(settings.model_copy(update={"trainer": cfg})),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _kill_host(node: subprocess.Popen[bytes]) -> None:
    """SIGKILL the node process and everything under it (its launcher, its ranks in sessions of
    their own): the host died."""
    tree = psutil.Process(node.pid).children(recursive=True)
    for proc in [psutil.Process(node.pid), *tree]:
        proc.kill()
    node.wait(timeout=30)
    psutil.wait_procs(tree, timeout=30)


@pytest.fixture
def two_nodes(services_config: Settings) -> TrainerSettings:
    return services_config.trainer.model_copy(
        update={
            "steps": 2,
            "micro_batch": 4,
            "ranks": 1,
            "nodes": 2,
            "rendezvous": f"127.0.0.1:{_free_port()}",
            "rendezvous_timeout_s": 120.0,
            "collective_timeout_s": 120.0,
        }
    )


def test_two_hosts_train_what_one_rank_trains_and_write_once(
    services_config: Settings, tiny_model_dir: Path, two_nodes: TrainerSettings, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    rows = _rows(16, seed=7)  # four micro-batches: two per host
    one = two_nodes.model_copy(update={"nodes": 1, "rendezvous": None})
    single = _train(one, tmp_path / "one", tiny_model_dir, rows)

    node = _node(services_config, two_nodes, tmp_path / "node.log")
    try:
        double = _train(two_nodes, tmp_path / "two", tiny_model_dir, rows)
    finally:
        stop_group(node)

    assert [s["tokens"] for s in double["steps"]] == [s["tokens"] for s in single["steps"]]
    for a, b in zip(single["steps"], double["steps"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5) and b["kl_k3"] == pytest.approx(
            a["kl_k3"], abs=1e-6
        )
        assert b["applied"] == a["applied"]
    base = load_file(tiny_model_dir / "model.safetensors")
    w1 = load_file(tmp_path / "one" / "checkpoint" / "model.safetensors")
    w2 = load_file(tmp_path / "two" / "checkpoint" / "model.safetensors")
    assert any(not torch.equal(w2[k].float(), base[k].float()) for k in base)
    assert max(float((w1[k] - w2[k]).abs().max()) for k in base) < 1e-5  # data parallel = the same update
    # Written once, by the worker's host; the other host's rank trained (its log has the job).
    worker_log = (tmp_path / "two" / "job" / LOG).read_text(errors="replace")
    node_log = (tmp_path / "node.log").read_text(errors="replace")
    assert worker_log.count(WRITES) == 1, worker_log[-3000:]
    assert WRITES not in node_log, node_log[-3000:]
    assert str(tmp_path / "two" / "job") in node_log, node_log[-3000:]


def test_a_host_that_dies_fails_the_cycle_and_the_next_cycle_trains(
    services_config: Settings, tiny_model_dir: Path, two_nodes: TrainerSettings, tmp_path: Path
) -> None:
    long = two_nodes.model_copy(update={"steps": 400, "max_kl": None})
    log = tmp_path / "node.log"
    node = _node(services_config, long, log)

    def kill_once_training() -> None:
        wait_until(
            lambda: "training on" in log.read_text(errors="replace"),
            timeout_s=300,
            interval_s=0.2,
            what="the node's rank training",
        )
        _kill_host(node)

    killer = threading.Thread(target=kill_once_training)
    killer.start()
    try:
        with pytest.raises(RanksFailed, match="a host that died mid-cycle") as failed:
            _train(long, tmp_path / "dead", tiny_model_dir, _rows(16, seed=8))
    finally:
        killer.join(timeout=300)
        stop_group(node)
    assert not (tmp_path / "dead" / "checkpoint").exists(), failed.value

    node = _node(services_config, two_nodes, tmp_path / "node-again.log")
    try:
        again = _train(two_nodes, tmp_path / "again", tiny_model_dir, _rows(16, seed=8))
    finally:
        stop_group(node)
    assert len(again["steps"]) == 2
    assert (tmp_path / "again" / "checkpoint" / "model.safetensors").is_file()

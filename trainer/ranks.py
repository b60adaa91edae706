"""Multi-rank cycles (``trainer.ranks`` > 1 or ``trainer.nodes`` > 1): DeepSpeed data-parallel ranks
on the worker's host, or on several hosts.

The worker prepares the cycle as for one rank (lease, selection, advantages, micro-batches), then
`train_on_ranks` writes the job (micro-batches, normaliser, paths: trainer/jobs.py, no pickle) into
a folder and launches
``python -m torch.distributed.run ... -m trainer.ranks FOLDER`` (`launcher_args`). Each rank (`main`)
builds the engine on the champion's weights, continues the optimizer state the worker chose (all
ranks or none), runs `trainer.steps.run_steps` on its share of the micro-batches, saves the
optimizer state (collectively), gathers the weights, and one rank, the *writer*, writes the
checkpoint and ``result.json`` (the steps' metrics, the trust-region stop). The worker then logs
the metrics and registers the checkpoint as for one rank: registration stays in one process, after
every rank exited 0.

With ``trainer.nodes`` > 1 the worker's launcher hosts a c10d rendezvous at ``trainer.rendezvous``
and waits for the other hosts, each running `rtrl train node` (trainer/nodes.py), whose launcher
starts ranks without a folder (``trainer.ranks --join``). The ranks form their process group
first and learn the job's folder from the ranks of the worker's host (`_job_folder`); the rendezvous
numbers hosts in its own order, so the writer is the lowest rank of the worker's host, not
necessarily global rank 0. The folder and the paths in the job are read at the same paths on every
host (a shared filesystem: docs/scaling.md, Training across hosts).

While the ranks run, the worker keeps renewing the cycle lease (worker/chain.py) and asks
`stopping` every half second: on SIGTERM it stops the ranks' process group and abandons the cycle,
as a single-rank cycle does at its next step. No rank outlives its launcher, nor the launcher
the worker (trainer/process_tree.py). A rank that fails, on any host, fails the cycle with
the tail of the worker's launcher log (the launcher stops the other ranks; a host that dies breaks
the collectives of the others).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from schemas.settings import TrainerSettings
from trainer import checkpoint, jobs, process_tree
from trainer.errors import Abandoned, TrainerError
from trainer.reference import Reference

log = logging.getLogger(__name__)

RESULT = "result.json"
LOG = "ranks.log"


class RanksFailed(TrainerError):
    """A rank of a multi-rank cycle exited with an error (the message has the ranks' log tail)."""


class HostsFailed(RanksFailed):
    """A multi-host cycle failed for want of a host: one did not join the rendezvous in time, the
    connection to one broke or timed out, or its filesystem did not show the cycle's job
    (trainer/jobs.py `StaleJob`) (`failure`). It says nothing about the cycle's episodes,
    which go back to the pool uncounted (trainer/cycle.py ``NOT_THE_DATAS``)."""


# What torch.distributed reports when a host is missing, died or hung (the launcher's and the ranks'
# log), and `main`'s refusal of a host with other trainer.ranks: a failure with none of these counts
# against the episodes, as a single-host one does.
_HOST_TROUBLE = re.compile(
    r"RendezvousTimeoutError|RendezvousClosedError|RendezvousConnectionError|DistNetworkError|a misconfigured host"
    r"|not this cycle's job|Connection reset by peer|Connection closed by peer|Broken pipe|Connection refused|timed out",
    re.IGNORECASE,
)


def failure(cfg: TrainerSettings, returncode: int | None, log: Path, tail: str) -> RanksFailed:
    """The error of a cycle whose ranks failed: `HostsFailed` when the cycle spans hosts and the log's
    `tail` shows a missing or lost host, else `RanksFailed`."""
    if cfg.nodes == 1:
        return RanksFailed(
            f"the {cfg.ranks} training ranks failed (exit {returncode}); {log} ends with:\n{tail}"
        )
    where = (
        f"the training ranks on {cfg.nodes} hosts failed (exit {returncode}; a host that died mid-cycle, or that "
        f"did not join the rendezvous at {cfg.rendezvous} within {cfg.rendezvous_timeout_s:g} s, fails the cycle)"
    )
    error = HostsFailed if _HOST_TROUBLE.search(tail) else RanksFailed
    return error(f"{where}; {log} ends with:\n{tail}")


def train_on_ranks(
    cfg: TrainerSettings,
    work_dir: Path,
    *,
    batches: list[Any],
    norm: tuple[int, int],
    mean_advantage: float,
    champion_dir: Path,
    base_dir: Path | None,
    out_dir: Path,
    lineage: dict[str, Any],
    optimizer_from: Path | None,
    optimizer_to: Path | None,
    reference: Reference | None = None,
    stopping: Callable[[], bool] = lambda: False,
) -> dict[str, Any]:
    """Train on ``cfg.ranks`` rank processes (see the module docstring); returns ``result.json``:
    ``{"steps": [StepMetrics...], "kl_stop": int | None, "optimizer_carried": bool}``, with the
    checkpoint written to `out_dir`. Raises Abandoned when `stopping` answers True, RanksFailed
    when a rank fails."""
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / RESULT).unlink(missing_ok=True)
    digest = jobs.write(
        work_dir,
        [{f.name: getattr(mb, f.name) for f in fields(mb)} for mb in batches],
        {
            "settings": cfg.model_dump_json(),
            "norm": list(norm),
            "mean_advantage": mean_advantage,
            "champion_dir": str(champion_dir),
            "base_dir": None if base_dir is None else str(base_dir),
            "out_dir": str(out_dir),
            "lineage": json.dumps(lineage, default=str),
            "optimizer_from": None if optimizer_from is None else str(optimizer_from),
            "optimizer_to": None if optimizer_to is None else str(optimizer_to),
            "reference": None if reference is None else reference.to_job(),
        },
    )
    command = launch_command(cfg, host=True, job=str(work_dir))
    proc = process_tree.start(command, env={**launcher_env(), jobs.DIGEST_ENV: digest}, log=work_dir / LOG)
    try:
        while not process_tree.exited(proc):
            if stopping():
                raise Abandoned("the worker is stopping; cycle abandoned while its ranks trained")
            time.sleep(0.5)
    finally:
        process_tree.stop(proc)  # a launcher that exited: its group swept and reaped
    if proc.returncode != 0 or not (work_dir / RESULT).is_file():
        tail = (work_dir / LOG).read_text(errors="replace")[-3000:]
        raise failure(cfg, proc.returncode, work_dir / LOG, tail)
    result: dict[str, Any] = json.loads((work_dir / RESULT).read_text())
    return result


RENDEZVOUS_ID = "rtrl-trainer"
# What torch.distributed.run sets for its ranks: a value inherited from the worker's own
# single-process rendezvous (trainer/engine.py) must not reach them.
_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def launcher_args(cfg: TrainerSettings, *, host: bool) -> list[str]:
    """torch.distributed.run's options for a cycle: ``trainer.ranks`` ranks on a private port of
    this host, or, with ``trainer.nodes`` > 1, this host's ``trainer.ranks`` ranks in a c10d
    rendezvous of ``trainer.nodes`` hosts at ``trainer.rendezvous`` that this host serves (`host`:
    the worker's) or joins (`rtrl train node`). No restarts: a failed rank fails the cycle."""
    from trainer.engine import _free_port

    if cfg.nodes == 1:
        return [
            "--nproc_per_node",
            str(cfg.ranks),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(_free_port()),
        ]
    return [
        "--nnodes",
        str(cfg.nodes),
        "--nproc-per-node",
        str(cfg.ranks),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        str(cfg.rendezvous),
        "--rdzv-id",
        RENDEZVOUS_ID,
        "--rdzv-conf",
        f"is_host={int(host)},join_timeout={max(1, round(cfg.rendezvous_timeout_s))}",
        "--max-restarts",
        "0",
    ]


def launcher_env() -> dict[str, str]:
    """This process's environment for a launcher, without a rendezvous of its own (`_RANK_ENV`)."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    return env


def launch_command(cfg: TrainerSettings, *, host: bool, job: str) -> list[str]:
    """torch.distributed.run of this host's ranks (`launcher_args`), each running `main` on `job`:
    the job folder on the worker's host, ``JOIN`` on another (`rtrl train node`)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher_args(cfg, host=host),
        "-m",
        "trainer.ranks",
        str(cfg.collective_timeout_s),
        job,
    ]


def _job_folder(work_dir: Path | None, timeout_s: float) -> tuple[Path, str, int]:
    """Form the ranks' process group and agree on the job: (its folder, the sha256 of its
    ``job.json``, the writer's global rank).

    The ranks of the worker's host were given the folder (`work_dir`) and the digest (by the worker,
    in ``jobs.DIGEST_ENV``); those of other hosts (``--join``) were not, and take both from the
    lowest rank that was: the writer."""
    from datetime import timedelta

    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))  # NCCL's object collectives need it
    deepspeed.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(), timeout=timedelta(seconds=timeout_s)
    )
    mine = None if work_dir is None else (str(work_dir), os.environ[jobs.DIGEST_ENV])
    announced: list[tuple[str, str] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(announced, mine)
    owners = [rank for rank, job in enumerate(announced) if job is not None]
    if not owners:
        raise RanksFailed("no rank of this cycle was given its job: the worker's host did not join")
    folder, digest = announced[owners[0]] or ("", "")
    return Path(folder), digest, owners[0]


def main(work_dir: Path | None, timeout_s: float) -> None:
    """One rank of a multi-rank cycle (launched by `train_on_ranks`, or with `work_dir` None by
    `rtrl train node` on another host), whose collectives wait at most `timeout_s` for the others."""
    import torch

    from serving.sampler import MicroBatch
    from trainer.engine import (
        close_engine,
        load_optimizer_state,
        save_optimizer_state,
        start_engine,
        state_dict,
    )
    from trainer.losses import Normaliser, loss_function
    from trainer.steps import collective_device, rank_batches, run_steps, world

    process_tree.die_with_parent(signal.SIGKILL)  # a launcher killed outright takes this rank with it
    work_dir, digest, writer = _job_folder(work_dir, timeout_s)
    job, tensors = jobs.read(work_dir, digest)  # StaleJob unless this is the job the cycle announced
    cfg = TrainerSettings.model_validate_json(job["settings"])
    batches = [MicroBatch(**fields_) for fields_ in tensors]
    champion_dir = Path(job["champion_dir"])
    base_dir = None if job["base_dir"] is None else Path(job["base_dir"])
    size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if size != cfg.nodes * cfg.ranks:  # every rank sees it and stops, before the first step
        raise SystemExit(
            f"rank {rank}: {size} ranks joined, not trainer.nodes x trainer.ranks = {cfg.nodes} x {cfg.ranks} "
            f"(a misconfigured host): every rtrl train node must run the worker's trainer.ranks"
        )
    log.info("rank %d of %d: job %s, the checkpoint written by rank %d", rank, size, work_dir, writer)
    mine = rank_batches(batches, rank, size)
    engine = start_engine(champion_dir, cfg, accumulation=len(mine), base_dir=base_dir)
    assert world() == (rank, size), f"process group {world()} is not the launcher's ({rank}, {size})"
    carried = False
    if job["optimizer_from"] is not None:
        loaded = 1
        try:
            load_optimizer_state(engine, Path(job["optimizer_from"]))
        except Exception:  # noqa: BLE001 - a damaged state starts a fresh optimizer, on every rank alike
            log.exception("rank %d: the optimizer state in %s does not load", rank, job["optimizer_from"])
            loaded = 0
        agreed = torch.tensor([loaded], device=collective_device())
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        carried = bool(agreed.item())
        if not carried:
            close_engine(engine)
            engine = start_engine(champion_dir, cfg, accumulation=len(mine), base_dir=base_dir)
    tokens, sequences = job["norm"]
    log.info("rank %d: training on %d micro-batches", rank, len(mine))
    trained = run_steps(
        engine,
        mine,
        cfg,
        loss_function(cfg.loss),
        Normaliser(tokens=tokens, sequences=sequences),
        mean_advantage=float(job["mean_advantage"]),
        reference=Reference.from_job(job.get("reference")),  # each rank scores its own micro-batches
    )
    if job["optimizer_to"] is not None:
        save_optimizer_state(engine, Path(job["optimizer_to"]))  # every rank writes its part
    weights = state_dict(engine)  # gathered from every rank at ZeRO 3
    if rank == writer:
        log.info("rank %d: writing the checkpoint to %s", rank, job["out_dir"])
        checkpoint.save(weights, Path(job["out_dir"]), champion_dir, json.loads(job["lineage"]))
        result = {
            "steps": [m.model_dump() for m in trained.steps],
            "kl_stop": trained.kl_stop,
            "optimizer_carried": carried,
        }
        (work_dir / f"{RESULT}.tmp").write_text(json.dumps(result))
        os.replace(work_dir / f"{RESULT}.tmp", work_dir / RESULT)
    close_engine(engine)


JOIN = "--join"

if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s rank %(process)d %(levelname)s %(name)s %(message)s"
    )
    if len(sys.argv) != 3:
        sys.exit(
            f"usage: python -m trainer.ranks TIMEOUT_S (WORK_DIR | {JOIN}) (launched by trainer/ranks.py "
            "train_on_ranks, or by `rtrl train node`)"
        )
    main(None if sys.argv[2] == JOIN else Path(sys.argv[2]), float(sys.argv[1]))

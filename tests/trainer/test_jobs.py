"""The job folder of a multi-rank cycle (trainer/jobs.py): no pickle, and read only when it is the job
the cycle announced (a stale or foreign folder is refused)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from schemas.settings import TrainerSettings
from trainer.jobs import JOB, TENSORS, StaleJob, read, write
from trainer.ranks import HostsFailed, failure

pytestmark = pytest.mark.unit


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 100, (2, 5), generator=g),
        "mask": torch.rand((2, 4), generator=g),
        "top_k": torch.zeros(2, dtype=torch.long),
    }


def test_a_job_reads_back_as_written_without_pickle(tmp_path: Path) -> None:
    batches = [batch(1), batch(2)]
    digest = write(tmp_path, batches, {"norm": [7, 2], "out_dir": "/run/v3", "base_dir": None})
    record = json.loads((tmp_path / JOB).read_text())  # plain JSON
    assert (tmp_path / TENSORS).read_bytes()[8:9] == b"{"  # safetensors: a length, then a JSON header
    assert len(record["token"]) == 32 and record["batches"] == 2

    job, tensors = read(tmp_path, digest)
    assert (job["norm"], job["out_dir"], job["base_dir"]) == ([7, 2], "/run/v3", None)
    assert len(tensors) == 2
    for got, want in zip(tensors, batches, strict=True):
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name])


def test_every_cycle_writes_a_job_of_its_own(tmp_path: Path) -> None:
    """The same inputs twice: the per-cycle token makes the digests differ, so an earlier cycle's
    job at the same path is refused, not trained on."""
    stale = write(tmp_path, [batch(1)], {"norm": [1, 1]})
    fresh = write(tmp_path, [batch(1)], {"norm": [1, 1]})
    assert stale != fresh
    read(tmp_path, fresh)
    with pytest.raises(StaleJob, match=rf"{tmp_path / JOB} is not this cycle's job"):
        read(tmp_path, stale)


def test_tensors_that_are_not_the_jobs_are_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    write(other, [batch(9)], {"norm": [1, 1]})
    digest = write(tmp_path, [batch(1)], {"norm": [1, 1]})
    (tmp_path / TENSORS).write_bytes((other / TENSORS).read_bytes())  # a foreign or half-synced tensors file
    with pytest.raises(StaleJob, match=rf"{tmp_path / TENSORS} is not the tensors of"):
        read(tmp_path, digest)


def test_a_job_without_micro_batches_writes_and_reads(tmp_path: Path) -> None:
    digest = write(tmp_path, [], {"norm": [0, 0]})
    assert read(tmp_path, digest)[1] == []


def test_a_host_that_saw_a_stale_job_is_not_the_datas_fault() -> None:
    cfg = TrainerSettings(nodes=2, rendezvous="trainer-0:29400")
    tail = f"trainer.jobs.StaleJob: /run/ranks/cycle-3/{JOB} is not this cycle's job (sha256 ...)"
    assert type(failure(cfg, 1, Path("/run/ranks.log"), tail)) is HostsFailed


def test_the_cycles_micro_batches_come_back_as_the_ranks_build_them(tmp_path: Path) -> None:
    """What `train_on_ranks` writes of real micro-batches and `trainer.ranks.main` rebuilds."""
    from dataclasses import fields

    from serving.sampler import MicroBatch, Row, micro_batches

    rows = [
        Row(input_ids=[1, 2, 3, 4], prompt_len=2, behaviour_logprobs=[-0.5, -0.25], advantage=1.0),
        Row(input_ids=[5, 6, 7], prompt_len=1, behaviour_logprobs=[-1.0, -2.0], advantage=-1.0),
        Row(input_ids=[8, 9], prompt_len=1, behaviour_logprobs=[-0.1], advantage=0.5),
    ]
    written = micro_batches(rows, 2, pad_id=0)
    digest = write(tmp_path, [{f.name: getattr(mb, f.name) for f in fields(mb)} for mb in written], {})
    _, tensors = read(tmp_path, digest)
    rebuilt = [MicroBatch(**fields_) for fields_ in tensors]
    assert len(rebuilt) == len(written) == 2
    for got, want in zip(rebuilt, written, strict=True):
        for f in fields(want):
            assert torch.equal(getattr(got, f.name), getattr(want, f.name)), f.name

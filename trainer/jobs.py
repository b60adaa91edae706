"""The job folder of a multi-rank cycle: written by the worker (trainer/ranks.py `train_on_ranks`), read
by every rank, on the worker's host and, through the shared filesystem, on the others.

Two files, neither of them a pickle, so reading a job runs no code whoever wrote the folder:

- ``job.json``: the cycle's paths, normaliser, lineage, the trainer's settings, the names and count of
  the micro-batches' tensors, a random per-cycle token and the sha256 of the tensors file;
- ``batches.safetensors``: the micro-batches' tensors (``<batch>.<field>``).

`write` returns the sha256 of ``job.json``. The worker hands it to its own ranks (the environment
variable ``DIGEST_ENV`` of their launcher), they announce it to the other hosts' ranks with the
folder (trainer/ranks.py `_job_folder`), and every rank reads the job only if ``job.json`` has that
digest and the tensors file the digest ``job.json`` records (`read`). The token makes every cycle's
``job.json`` unique, so a stale folder (an earlier cycle's job at the same path, a shared filesystem
that does not show the worker's write yet) or a foreign one is refused with `StaleJob`, never
trained on. What it does not protect against: see docs/security.md, The trainer's rendezvous.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

import torch

from trainer.errors import TrainerError

JOB = "job.json"
TENSORS = "batches.safetensors"
DIGEST_ENV = "RTRL_TRAINER_JOB_SHA256"  # set by the worker for its own ranks only


class StaleJob(TrainerError):
    """The job folder a rank was pointed at is not this cycle's: ``job.json`` or its tensors do not
    have the digests the cycle announced."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write(work_dir: Path, batches: list[dict[str, torch.Tensor]], record: dict[str, Any]) -> str:
    """Write the job: `batches` (each a micro-batch's tensors by field) to ``batches.safetensors``,
    `record` (JSON values) with a fresh token to ``job.json``; the sha256 of ``job.json``."""
    from safetensors.torch import save_file

    names = sorted(batches[0]) if batches else []
    # A copy of each: safetensors refuses tensors that share storage (targets is a view of input_ids).
    tensors = {
        f"{i}.{name}": batch[name].clone().contiguous() for i, batch in enumerate(batches) for name in names
    }
    save_file(tensors, str(work_dir / TENSORS))
    job = {
        **record,
        "token": secrets.token_hex(16),
        "batches": len(batches),
        "fields": names,
        "tensors_sha256": sha256(work_dir / TENSORS),
    }
    data = json.dumps(job, sort_keys=True).encode()
    (work_dir / f"{JOB}.tmp").write_bytes(data)
    os.replace(work_dir / f"{JOB}.tmp", work_dir / JOB)
    return hashlib.sha256(data).hexdigest()


def read(work_dir: Path, digest: str) -> tuple[dict[str, Any], list[dict[str, torch.Tensor]]]:
    """The job in `work_dir` (its record, its micro-batches' tensors by field), if ``job.json`` has
    the sha256 `digest` the cycle announced and the tensors the digest it records; else `StaleJob`."""
    from safetensors.torch import load_file

    data = (work_dir / JOB).read_bytes()
    found = hashlib.sha256(data).hexdigest()
    if found != digest:
        raise StaleJob(
            f"{work_dir / JOB} is not this cycle's job (sha256 {found[:12]}, the cycle announced {digest[:12]}): "
            "a stale or foreign job folder, or a shared filesystem that does not show the worker's write"
        )
    job: dict[str, Any] = json.loads(data)
    if sha256(work_dir / TENSORS) != job["tensors_sha256"]:
        raise StaleJob(
            f"{work_dir / TENSORS} is not the tensors of {work_dir / JOB} (its sha256 differs from the one the "
            "job records): a stale or foreign job folder, or a shared filesystem that does not show the worker's write"
        )
    tensors = load_file(str(work_dir / TENSORS))
    batches = [{name: tensors[f"{i}.{name}"] for name in job["fields"]} for i in range(job["batches"])]
    return job, batches

"""`rtrl model`: build, inspect and check checkpoints.

rtrl model init .rtrl/models/tiny --task exclaim --seed 0   the deterministic tiny model (`services/tinymodel.py`)
rtrl model random DIR --arch qwen2 --size tiny              random weights in a real one's shape (`simulation/checkpoints.py`)
rtrl model info .rtrl/models/tiny
rtrl model check DIR                                        what rtrl will do with it, every problem (`services/modelcheck.py`)
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

model_app = typer.Typer(
    no_args_is_help=True,
    help="Build, inspect and check the HF-format checkpoints the loop serves and trains.",
)


@model_app.command("init")
def init(
    directory: Path = typer.Argument(..., help="Folder to write the checkpoint into."),
    task: str = typer.Option(
        "exclaim", help="Task to fine-tune on (see evals/tasks.py), or 'none' for raw init."
    ),
    seed: int = typer.Option(0, help="Seed of initialisation and fine-tune; same seed, same bytes."),
    force: bool = typer.Option(False, "--force", help="Overwrite a non-empty folder."),
    recipe: str = typer.Option(
        "v1",
        help="v1: learns the answers' shapes (the demo's base); v2: also learns the answers (docs/algorithms.md); "
        "tools: with --task lookup, calls the lookup tool and answers from its result (docs/methods.md, Tool calls).",
    ),
    measure: bool = typer.Option(
        True,
        help="Sample the task's questions and report how often the preference is met and the answer is right.",
    ),
) -> None:
    """Build the tiny Llama checkpoint (tokenizer, weights, configs) into DIRECTORY."""
    if directory.exists() and not directory.is_dir():
        raise typer.BadParameter(f"{directory} exists and is not a folder", param_hint="DIRECTORY")
    if directory.is_dir() and any(directory.iterdir()) and not force:
        raise typer.BadParameter(
            f"{directory} is not empty; pass --force to overwrite", param_hint="DIRECTORY"
        )

    from evals import TaskError, get_task
    from services import tinymodel

    task_name = None if task == "none" else task
    if task_name is not None:
        try:
            get_task(task_name)
        except TaskError as exc:
            raise typer.BadParameter(str(exc), param_hint="--task") from None
    if recipe not in tinymodel.RECIPES:
        raise typer.BadParameter(
            f"unknown recipe {recipe!r}; known: {', '.join(sorted(tinymodel.RECIPES))}", param_hint="--recipe"
        )
    tinymodel.build(directory, task=task_name, seed=seed, recipe=recipe)
    summary = tinymodel.info(directory)
    wall, cpu = tinymodel.build_seconds(directory) or (0.0, 0.0)
    summary["build_seconds"] = {"wall": round(wall, 1), "cpu": round(cpu, 1)}
    if measure and task_name is not None:
        summary["preference_rate"] = tinymodel.measure_preference(directory, task_name)
        summary["correct_train"] = tinymodel.measure_correct(directory, task_name, "train")
        summary["correct_heldout"] = tinymodel.measure_correct(directory, task_name, "heldout")
    typer.echo(json.dumps(summary, indent=2))


@model_app.command("info")
def info(
    directory: Path = typer.Argument(..., exists=True, file_okay=False, help="Checkpoint folder."),
) -> None:
    """Print a checkpoint's shape, parameter count, vocabulary, recipe and weight digest."""
    from services import tinymodel

    typer.echo(json.dumps(tinymodel.info(directory), indent=2))


@model_app.command("check")
def check(
    directory: Path | None = typer.Argument(
        None, help="Checkpoint folder (default: RTRL_VLLM__MODEL_DIR, the one the servers start on)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Print what rtrl will do with a checkpoint, one line each (architecture, dtype, vocabulary, chat
    template, sampling defaults and whether requests under them are trainable), then every problem with
    its fix. Exits 1 when a problem is an error: `rtrl run` and `rtrl demo` refuse such a checkpoint."""
    from schemas.settings import load_settings
    from services import modelcheck

    # The settings say how the checkpoint will be served: their sampling defaults and context length.
    settings = load_settings()
    report = modelcheck.check(
        directory or settings.vllm.model_dir.expanduser(),
        sampling_defaults=settings.vllm.sampling_defaults,
        max_model_len=settings.vllm.max_model_len,
    )
    typer.echo(json.dumps(report.to_json(), indent=2) if as_json else "\n".join(report.lines()))
    if not report.ok:
        raise typer.Exit(1)


@model_app.command("random")
def random_checkpoint(
    directory: Path = typer.Argument(..., help="Folder to write the checkpoint into."),
    arch: str = typer.Option(
        "qwen2", help="Family: qwen2 (Qwen2.5's layout, bf16, tied) or llama (Llama-2's, fp32)."
    ),
    size: str = typer.Option("tiny", help="tiny (loads in seconds) or 0.5b (Qwen2.5-0.5B's shape)."),
    dtype: str | None = typer.Option(None, help="bfloat16, float16 or float32 (default: the family's)."),
    vocab_size: int | None = typer.Option(
        None, min=1, help="Embedding rows (default: the tokenizer's rounded up to 64; Qwen's is 151936)."
    ),
    seed: int = typer.Option(0, help="Seed of the random weights."),
    force: bool = typer.Option(False, "--force", help="Overwrite a non-empty folder."),
) -> None:
    """Write a checkpoint with random weights in the shape of a real one (files, tokenizer, chat
    template, sampling defaults), then check it as `rtrl model check` does."""
    from services import modelcheck
    from simulation import checkpoints

    if directory.exists() and not directory.is_dir():
        raise typer.BadParameter(f"{directory} exists and is not a folder", param_hint="DIRECTORY")
    if directory.is_dir() and any(directory.iterdir()) and not force:
        raise typer.BadParameter(
            f"{directory} is not empty; pass --force to overwrite", param_hint="DIRECTORY"
        )
    for value, known, hint in (
        (arch, checkpoints.ARCHS, "--arch"),
        (size, tuple(checkpoints.SIZES), "--size"),
        (dtype, ("bfloat16", "float16", "float32", None), "--dtype"),
    ):
        if value not in known:
            raise typer.BadParameter(
                f"unknown {hint[2:]} {value!r}; known: {', '.join(k for k in known if k)}", param_hint=hint
            )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards": the report below says what was written
    try:
        checkpoints.build(directory, arch, size, dtype=dtype, vocab_size=vocab_size, seed=seed)
    except ValueError as exc:  # a vocab_size below the tokenizer's
        raise typer.BadParameter(str(exc), param_hint="--vocab-size") from None
    typer.echo("\n".join(modelcheck.check(directory).lines()))


def register(app: typer.Typer) -> None:
    """Add `rtrl model ...` to the root app."""
    app.add_typer(model_app, name="model")

"""`rtrl model`: build and inspect the deterministic tiny checkpoint (`rtrl/tinymodel.py`).

rtrl model init .rtrl/models/tiny --task exclaim --seed 0
rtrl model info .rtrl/models/tiny
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

model_app = typer.Typer(
    no_args_is_help=True, help="Build and inspect the tiny HF-format model the local loop serves."
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
        "v1", help="v1: learns the answers' shapes (the demo's base); v2: also learns the answers (docs/algorithms.md)."
    ),
    measure: bool = typer.Option(
        True, help="Sample the task's questions and report how often the preference is met and the answer is right."
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
    from rtrl import tinymodel

    task_name = None if task == "none" else task
    if task_name is not None:
        try:
            get_task(task_name)
        except TaskError as exc:
            raise typer.BadParameter(str(exc), param_hint="--task") from None
    if recipe not in tinymodel.RECIPES:
        raise typer.BadParameter(f"unknown recipe {recipe!r}; known: {', '.join(sorted(tinymodel.RECIPES))}",
                                 param_hint="--recipe")  # fmt: skip
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
    from rtrl import tinymodel

    typer.echo(json.dumps(tinymodel.info(directory), indent=2))


def register(app: typer.Typer) -> None:
    """Add `rtrl model ...` to the root app."""
    app.add_typer(model_app, name="model")

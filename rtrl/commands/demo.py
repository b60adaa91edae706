"""``rtrl demo``: N full cycles of the loop on embedded defaults and the tiny model (or ``--model-dir``)."""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Literal

import typer

if TYPE_CHECKING:
    from schemas.settings import Settings


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _api(value: str) -> Literal["completions", "chat"]:
    if value not in ("completions", "chat"):
        raise typer.BadParameter(f"{value!r}: completions or chat", param_hint="--api")
    return "chat" if value == "chat" else "completions"


def with_model_dir(settings: Settings, model_dir: Path | None) -> Settings:
    """`settings` serving and training the checkpoint in `model_dir` (``--model-dir``), if given."""
    if model_dir is None:
        return settings
    return settings.model_copy(update={"vllm": settings.vllm.model_copy(update={"model_dir": model_dir})})


def register(app: typer.Typer) -> None:
    """Add ``rtrl demo``."""

    @app.command("demo")
    def demo(
        cycles: int = typer.Option(3, min=1, help="Full cycles to run."),
        requests: int = typer.Option(
            96,
            min=1,
            help="Simulated requests per cycle; with --scenario, episodes per cycle (several calls each).",
        ),
        concurrency: int = typer.Option(4, min=1, help="Simulated users sending at once."),
        task: str | None = typer.Option(
            None,
            help="Synthetic task the simulated users bring (default: exclaim; lookup with --scenario tools).",
        ),
        preference: str | None = typer.Option(
            None, help="module:function preference(prompt, completion) -> list[FeedbackSignal]."
        ),
        json_path: Path | None = typer.Option(None, "--json", help="Write the per-cycle figures here."),
        plot: Path | None = typer.Option(
            None, help="PNG plot of reward per cycle (default: next to --json)."
        ),
        keep_services: bool = typer.Option(False, help="Leave the services up that the demo started."),
        settle_window: float = typer.Option(
            5.0, help="Labeler settle window (s) for episodes without terminal feedback (accepted ones)."
        ),
        scenario: str | None = typer.Option(
            None,
            help="Simulated agents of one RL method instead of one-call users: parl (Kimi PARL orchestrator and "
            "sub-agents), summarize (Cursor self-summarization), self-edit (Chroma's self-editing agent, judged by "
            "the serving model unless labeler.judge is set) or tools (a tool call through the openai client with "
            "`tools`, its result, the final answer: the lookup model, served with vLLM's pythonic tool parser); "
            "each labelled with its reward spec (docs/methods.md).",
        ),
        api: str = typer.Option(
            "completions",
            help="How the simulated users ask: completions (the task's prompt at T = 1) or chat (the "
            "question as a user message, under the model's chat template and generation_config.json defaults).",
        ),
        model_dir: Path | None = typer.Option(
            None,
            help="Your own HF checkpoint to serve and train instead of the tiny model (RTRL_VLLM__MODEL_DIR); "
            "refused in one line when `rtrl model check` rejects it.",
        ),
    ) -> None:
        """Run the whole loop N times: users → gateway → Kafka → labeler → trainer → gate → hot-swap."""
        from schemas.settings import load_settings
        from services.logs import setup_logging
        from services.modelcheck import require_usable
        from simulation.demo import DemoOptions, run

        setup_logging()
        settings = with_model_dir(load_settings(), model_dir)
        # A checkpoint rtrl would fail on is refused before any service starts (an empty folder is
        # where the tiny model is built, and passes).
        require_usable(settings)
        # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C: the demo stops the processes and
        # services it started instead of leaving them running without it.
        signal.signal(signal.SIGTERM, _raise_interrupt)
        run(
            settings,
            DemoOptions(
                cycles=cycles,
                requests_per_cycle=requests,
                concurrency=concurrency,
                task=task or ("lookup" if scenario == "tools" else "exclaim"),
                preference=preference,
                json_path=json_path,
                plot_path=plot,
                keep_services=keep_services,
                settle_window_s=settle_window,
                scenario=scenario,
                api=_api(api),
            ),
        )

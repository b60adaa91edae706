"""`rtrl simulate`: simulated users sending a task's prompts and feedback through the gateway."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from evals import Preference
    from schemas.settings import Settings


def register(app: typer.Typer) -> None:
    """Add `rtrl simulate` to the root app."""

    @app.command("simulate")
    def simulate(
        requests: int = typer.Option(100, "--requests", "-n", min=1, help="Requests to send."),
        concurrency: int = typer.Option(4, "--concurrency", "-c", min=1, help="Requests in flight at once."),
        task: str = typer.Option("exclaim", help="Task whose training prompts are sent (evals/tasks.py)."),
        preference: str = typer.Option(
            None, help="Preference function 'module:function' (default: the task's own)."
        ),
        gateway: str = typer.Option(None, help="Gateway base URL (default: settings.gateway host:port)."),
        seed: int = typer.Option(0, help="Seed of the prompt draw and of per-request sampling."),
        json_out: Path = typer.Option(None, "--json", help="Also write the report as JSON to this file."),
        api_key: str = typer.Option(
            None,
            "--api-key",
            help="A tenant key of the gateway. Default: a key of tenant 'sim' is made in the store for this run "
            "and revoked after it.",
        ),
        scenario: str | None = typer.Option(
            None,
            help="Send multi-segment episodes of simulated agents instead, --requests of them: parl, summarize, "
            "self-edit (simulation/agents.py) or tools (with --task lookup, against a server with a tool parser: "
            "simulation/tools.py); docs/methods.md. Prints the report as JSON.",
        ),
    ) -> None:
        """Send N requests through the gateway, give feedback on each, print acceptance per policy version."""
        from contextlib import nullcontext

        from evals import load_preference
        from schemas.settings import load_settings
        from simulation.client import simulation_key
        from simulation.users import simulate as run_simulation
        from store import Store

        settings = load_settings()
        _check_scenario(scenario, task)  # before a key is made for it
        chosen = load_preference(preference) if preference else None
        url = gateway or f"http://{settings.gateway.host}:{settings.gateway.port}"
        with (
            nullcontext()
            if api_key or settings.gateway.auth == "open"
            else Store(settings.store.url) as store
        ):
            if store is not None:
                store.migrate()  # the key is written to the store, like `rtrl keys create` does
            with nullcontext(api_key or "open") if store is None else simulation_key(store, url) as key:
                if scenario is not None:
                    _agents(settings, url, scenario, requests, task, key, concurrency, seed, chosen, json_out)
                    return
                report = run_simulation(
                    settings,
                    url,
                    requests,
                    task,
                    preference=chosen,
                    concurrency=concurrency,
                    seed=seed,
                    api_key=key,
                )
        if json_out is not None:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(report.to_json() + "\n")
        reward = "n/a" if report.mean_reward is None else f"{report.mean_reward:.3f}"
        typer.echo(
            f"requests {report.requests}: ok {report.ok}, failed {report.failed}; "
            f"feedback sent {report.feedback_sent} (failed {report.feedback_failed}); "
            f"acceptance {report.acceptance_rate:.3f}; mean reward {reward}; {report.elapsed_s:.1f}s"
        )
        for version, count in report.per_version.items():
            accepted = report.accepted_per_version.get(version, 0)
            typer.echo(f"  {version}: {count} requests, {accepted} accepted ({accepted / count:.3f})")
        for error in report.errors[:5]:
            typer.echo(f"  error: {error}", err=True)
        if report.failed:
            raise typer.Exit(1)


def _check_scenario(scenario: str | None, task: str) -> None:
    """An unknown scenario, or the tools scenario without a task with tools, is an operator error."""
    from simulation.agents import check_scenario
    from simulation.tools import SCENARIO, tool_task

    if scenario == SCENARIO:
        tool_task(task)
    elif scenario is not None:
        check_scenario(scenario)


def _agents(
    settings: Settings,
    url: str,
    scenario: str,
    episodes: int,
    task: str,
    key: str,
    concurrency: int,
    seed: int,
    preference: Preference | None,
    json_out: Path | None,
) -> None:
    """`rtrl simulate --scenario`: one run of simulated agents, its report printed as JSON."""
    from schemas.events import new_id
    from simulation.agents import run_agents
    from simulation.tools import SCENARIO, run_tool_agents

    # A fresh tag in the episode ids: the same seed sent again must not extend the episodes it settled.
    common: dict[str, Any] = {
        "api_key": key,
        "concurrency": concurrency,
        "seed": seed,
        "preference": preference,
        "run": new_id()[:12],
    }
    if scenario == SCENARIO:
        report = run_tool_agents(settings, url, episodes, task, **common)
    else:
        report = run_agents(settings, url, scenario, episodes, task, **common)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(report.to_json() + "\n")
    typer.echo(report.to_json())
    for error in report.errors[:5]:
        typer.echo(f"  error: {error}", err=True)
    if report.failed:
        raise typer.Exit(1)

"""``rtrl demo``: the whole loop, N cycles, on one machine with the tiny model.

What it does, in order:
1. starts the local services it needs (Kafka, Redis, MLflow, vLLM serving + staging) unless they
   are already up, building the tiny model on first use; a service left out of
   ``services.enabled`` is taken to run elsewhere, at the address its client settings give. The
   store and MLflow's backend are SQLite files in the run dir unless set (embedded_databases), so
   the demo needs no PostgreSQL, unlike ``rtrl run``;
2. migrates the store, creates the topics, registers the base model as v1 @champion;
3. starts the loop's processes under the supervisor: gateway, labeler, Celery worker;
4. per cycle: simulated users send requests through the gateway and give feedback (with
   ``scenario``, simulated agents send multi-segment episodes of one RL method instead:
   simulation/agents.py, docs/methods.md); once the labeler has settled them, a training cycle runs on
   the worker (lease → select → CISPO on DeepSpeed → MLflow @challenger → eval gate → hot-swap →
   @champion);
5. prints a table per cycle, writes the figures as JSON and a PNG plot of reward per cycle.

It stops the processes it started, and the services too when it was the one that started them.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from schemas.clock import utcnow, wait_until
from schemas.errors import OperatorError
from schemas.settings import Settings, TrafficSettings, embedded_databases
from schemas.versions import format_version

if TYPE_CHECKING:
    from evals import Preference, Task
    from registry import Registry
    from services.supervisor import Supervisor
    from simulation.agents import AgentReport
    from store import DeadLetterEntry, Store

log = logging.getLogger("simulation.demo")

JSON_KEYS = (
    "cycle",
    "version_before",
    "version_after",
    "episodes",
    "mean_reward",
    "gate",
    "swap_ms",
    "data_to_deploy_s",
)
# With a scenario, what its agents did too: the figures that tell the methods apart.
SCENARIO_JSON_KEYS = ("scenario", "acceptance", "ok", "segments", "summaries", "subagents", "prunes")


class DemoError(OperatorError, RuntimeError):
    """The demo could not complete a cycle (the message says which log to read)."""


@dataclass(frozen=True)
class DemoOptions:
    cycles: int = 3
    requests_per_cycle: int = 96
    concurrency: int = 4
    task: str = "exclaim"
    preference: str | None = None
    json_path: Path | None = None
    plot_path: Path | None = None
    cycle_timeout_s: float = 600.0
    keep_services: bool = False
    # The exclaim users only accept or reject; "accepted" is not terminal under tab-v1 (an
    # edit_persisted / edit_reverted may follow), so accepted episodes settle after this window.
    settle_window_s: float = 5.0
    # What share of the simulated users give feedback, and what share of those say the opposite.
    feedback_rate: float = 1.0
    flip_rate: float = 0.0
    # The simulated users are an oracle the demo has: the gate asks it too (the oracle suite).
    gate_oracle: bool = True
    # After the cycles, one more round of users on the final champion, without training (a row with
    # cycle "final"): what the last promotion did for users.
    final_round: bool = False
    final_round_requests: int | None = None  # default: requests_per_cycle (a measurement, not training)
    # The users of cycle c are drawn with seed 1000 x seed + c (0: the seeds every run used so far).
    seed: int = 0
    # One of simulation.agents.SCENARIOS: simulated agents run that RL method's multi-segment episodes, each
    # `requests_per_cycle` an episode, labelled with its reward spec. None: the ordinary one-call users.
    scenario: str | None = None
    # How the one-call users ask: completions (the task's prompt, T = 1) or chat (the question as a
    # user message, under the model's chat template and sampling defaults).
    api: Literal["completions", "chat"] = "completions"


def _traffic_settings(settings: Settings, task: Task, options: DemoOptions) -> TrafficSettings:
    """The traffic suite replays the users' prompts as they sent them: the task's completion budget
    and, for raw completion prompts, its stop strings (a chat prompt ends at the end-of-turn token).
    Values an operator changed from the defaults are kept."""
    traffic, default = settings.gate.traffic, TrafficSettings()
    update: dict[str, Any] = {}
    if traffic.max_tokens == default.max_tokens:
        update["max_tokens"] = task.max_tokens
    if traffic.stop == default.stop and options.api == "completions":
        update["stop"] = task.stop
    return traffic.model_copy(update=update)


def _demo_settings(settings: Settings, task: Task, options: DemoOptions) -> Settings:
    """The settings the demo's services run with: its labeler window and scenario, and a gate that
    also knows the task and the users' preference."""
    # The simulated users are an oracle the demo has: the gate asks it too (the oracle suite), with the
    # preference the users hold, on the task they bring (docs/gate.md, The demo's oracle). The demo
    # keeps its task's retention suite beside the tenant's traffic (the default suites).
    suites = settings.gate.suites
    if "retention" not in suites:
        suites = (*suites, "retention")
    if options.gate_oracle and "oracle" not in suites:
        suites = ("oracle", *suites)
    labeler: dict[str, Any] = {"settle_window_s": options.settle_window_s}
    if options.scenario is not None:
        labeler |= _scenario_labeler(settings, options.scenario)
    return settings.model_copy(
        update={
            "labeler": settings.labeler.model_copy(update=labeler),
            "gate": settings.gate.model_copy(
                update={
                    "suites": suites,
                    "traffic": _traffic_settings(settings, task, options),
                    "task": options.task,
                    "preference": options.preference or settings.gate.preference,
                }
            ),
        }
    )


def run(settings: Settings, options: DemoOptions) -> list[dict[str, Any]]:
    """Run the demo (see the module docstring); returns one row of figures per cycle."""
    import services
    from evals import get_task, load_preference
    from registry import Registry
    from schemas.events import new_id
    from services.supervisor import Supervisor, prepare
    from simulation.client import simulation_key
    from store import Store

    settings = embedded_databases(settings)
    if options.scenario == "tools":  # the lookup model and vLLM's tool parser (simulation/tools.py)
        from simulation.tools import demo_settings, ensure_model, tool_task

        tool_task(options.task)
        settings = demo_settings(settings)
        ensure_model(settings)
    task = get_task(options.task)  # an unknown task fails now, before any service starts
    settings = _demo_settings(settings, task, options)
    # Mistakes in the options and the settings fail now, before any service starts.
    preference = load_preference(options.preference) if options.preference else None
    store, registry = Store(settings.store.url), Registry.from_settings(settings)

    # The local services the loop needs, of those rtrl manages here (services.enabled): one left out
    # is an external service the client settings point at, and is not started.
    needed = [name for name in ("kafka", "redis", "mlflow", "vllm") if name in settings.services.enabled]
    already_up = {s.name for s in services.status(settings) if s.healthy}
    t0 = time.monotonic()
    ready = services.up(settings, only=needed)  # and what they require; stops what it started when it fails
    started_services = [s.name for s in ready if s.name not in already_up]
    log.info("services ready in %.1fs", time.monotonic() - t0)
    # The supervisor hands the children (gateway, labeler, worker) these settings.
    supervisor = Supervisor(settings, names=("gateway", "labeler", "worker"))
    rows: list[dict[str, Any]] = []
    try:
        prepare(settings, store, registry)
        supervisor.serve_metrics()
        supervisor.start()
        _wait_for_loop(settings, supervisor)
        gateway = f"http://{settings.gateway.host}:{settings.gateway.port}"
        with simulation_key(store, gateway) as api_key:  # the users' key, made the way a user would
            # Agents' episode ids repeat with the seeds: this run's own tag keeps them apart from the
            # episodes of an earlier run in the same store (simulation.agents.episode_id).
            users = _Users(settings, task, preference, options, api_key, run_tag=new_id()[:12])
            for cycle in range(1, options.cycles + 1):
                rows.append(_one_cycle(settings, store, registry, users, options, cycle, supervisor))
                _print_row(rows[-1])
            if options.final_round:
                rows.append(_final_round(settings, registry, users, options))
                _print_row(rows[-1])
    finally:
        supervisor.stop()
        store.close()
        if started_services and not options.keep_services:
            services.down(settings, only=started_services)
    _print_table(rows)
    if options.json_path is not None:
        options.json_path.parent.mkdir(parents=True, exist_ok=True)
        keys = JSON_KEYS + (SCENARIO_JSON_KEYS if options.scenario is not None else ())
        options.json_path.write_text(json.dumps([{k: r[k] for k in keys} for r in rows], indent=2) + "\n")
        print(f"wrote {options.json_path}")
    plot_path = options.plot_path or (options.json_path.with_suffix(".png") if options.json_path else None)
    if plot_path is not None:
        _plot(rows, plot_path)
        print(f"wrote {plot_path}")
    return rows


def _check_children(supervisor: Supervisor, settings: Settings) -> None:
    supervisor.check()
    if supervisor.crash_looping():
        raise DemoError(
            f"processes keep crashing: {supervisor.crash_looping()}; see {settings.services.run_dir}/logs"
        )


def _wait_for_loop(settings: Settings, supervisor: Supervisor, timeout_s: float = 180.0) -> None:
    """Wait until the gateway answers and a Celery worker replies to ping."""
    import httpx

    from worker.app import configure

    gateway = f"http://{settings.gateway.host}:{settings.gateway.port}"
    app = configure(settings)
    ready = {"gateway": False, "worker": False}

    def loop_ready() -> bool:
        _check_children(supervisor, settings)
        if not ready["gateway"]:
            try:
                ready["gateway"] = httpx.get(f"{gateway}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                pass
        if not ready["worker"]:
            ready["worker"] = bool(app.control.ping(timeout=1.0))
        return ready["gateway"] and ready["worker"]

    try:
        wait_until(loop_ready, timeout_s=timeout_s, interval_s=1.0, what="loop not ready")
    except TimeoutError as exc:
        raise DemoError(f"{exc} ({ready}); see {settings.services.run_dir}/logs") from None


def _scenario_labeler(settings: Settings, scenario: str) -> dict[str, Any]:
    """The labeler settings a scenario's episodes need: its reward spec, and for self-edit (judged-v1) a
    judge, the serving vLLM server unless one is configured (docs/methods.md, Judged rewards)."""
    from schemas.settings import JudgeSettings
    from simulation.agents import SCENARIO_SPECS, check_scenario
    from simulation.tools import SCENARIO, SPEC

    if scenario == SCENARIO:
        return {"reward_spec": SPEC}
    update: dict[str, Any] = {"reward_spec": SCENARIO_SPECS[check_scenario(scenario)]}
    if scenario == "self-edit" and settings.labeler.judge is None:
        update["judge"] = JudgeSettings(
            url=f"{settings.vllm.servers[0].rstrip('/')}/v1", model=settings.vllm.served_model_name
        )
    return update


@dataclass(frozen=True)
class _Users:
    """Who sends traffic each round: the one-call users of simulation/users.py, or with a scenario the
    agents of simulation/agents.py. `send` gives the round's figures for the row."""

    settings: Settings
    task: Task
    preference: Preference | None
    options: DemoOptions
    api_key: str
    run_tag: str

    def send(self, n: int, seed: int) -> dict[str, Any]:
        from simulation.agents import run_agents
        from simulation.users import simulate

        gateway = f"http://{self.settings.gateway.host}:{self.settings.gateway.port}"
        options = self.options
        if options.scenario is None:
            report = simulate(
                self.settings,
                gateway,
                n,
                self.task,
                preference=self.preference,
                concurrency=options.concurrency,
                seed=seed,
                api_key=self.api_key,
                feedback_rate=options.feedback_rate,
                flip_rate=options.flip_rate,
                api=options.api,
            )
            return {
                "scenario": None,
                "acceptance": report.acceptance_rate,
                "ok": report.ok,
                "accepted": report.accepted,
                "silent": report.silent,
                "feedback_sent": report.feedback_sent,
                "segments": report.ok,
                "summaries": 0,
                "subagents": 0,
                "prunes": 0,
                "users_reward": report.mean_reward,
            }
        # Each of the n is an episode of several calls; its feedback is the method's, always sent.
        common: dict[str, Any] = {
            "api_key": self.api_key,
            "concurrency": options.concurrency,
            "seed": seed,
            "preference": self.preference,
            "run": self.run_tag,
        }
        if options.scenario == "tools":
            from simulation.tools import run_tool_agents

            agents = run_tool_agents(self.settings, gateway, n, self.task, **common)
        else:
            agents = run_agents(self.settings, gateway, options.scenario, n, self.task, **common)
        return self._row(agents)

    def _row(self, agents: AgentReport) -> dict[str, Any]:
        return {
            "scenario": agents.scenario,
            "acceptance": agents.acceptance_rate,
            "ok": agents.ok,
            "accepted": agents.accepted,
            "silent": 0,
            "feedback_sent": agents.feedback_sent,
            "segments": agents.segments,
            "summaries": agents.summaries,
            "subagents": agents.subagents,
            "prunes": agents.prunes,
            "users_reward": agents.mean_outcome,
        }


def _one_cycle(
    settings: Settings,
    store: Store,
    registry: Registry,
    users: _Users,
    options: DemoOptions,
    cycle: int,
    supervisor: Supervisor,
) -> dict[str, Any]:
    from trainer.selection import count_labelled
    from worker.app import CYCLE_TASK, configure

    champion = registry.champion()

    # Users (or agents): requests through the gateway, feedback by the preference function.
    before = count_labelled(settings, store, champion)
    started = utcnow()
    sent = users.send(options.requests_per_cycle, seed=1000 * options.seed + cycle)
    # The labeler settles each episode when its terminal feedback arrives (or its window passes); the
    # trainer takes it once its window has passed either way (trainer/selection.py). An agent's episode
    # is one labelled episode however many calls it made.
    lost = _wait_for_round(
        store,
        settings.kafka.interactions_topic,
        started,
        before + int(sent["ok"]),
        labelled=lambda: count_labelled(settings, store, champion),
        check=lambda: _check_children(supervisor, settings),
        timeout_s=options.cycle_timeout_s,
        what=f"cycle {cycle}",
        logs=settings.services.run_dir / "logs",
    )
    if lost:
        print(f"cycle {cycle}: {_dead_letter_line(lost)}", flush=True)

    # Train → gate → deploy, on the worker.
    app = configure(settings)
    result: dict[str, Any] = app.send_task(CYCLE_TASK).get(timeout=options.cycle_timeout_s)
    if result.get("status") not in ("promoted", "rejected"):
        raise DemoError(f"cycle {cycle} ended with status {result.get('status')!r}: {result}")
    sent.pop("users_reward")  # the row's mean reward is the trained batch's
    return {
        "cycle": cycle,
        "version_before": format_version(champion),
        "version_after": format_version(int(result["version_after"])),
        "episodes": result["episodes"],
        "mean_reward": round(float(result["mean_reward"]), 4),
        "gate": result["gate"],
        "swap_ms": None if result.get("swap_ms") is None else round(float(result["swap_ms"]), 1),
        "data_to_deploy_s": None
        if result.get("data_to_deploy_s") is None
        else round(float(result["data_to_deploy_s"]), 1),
        "challenger": None
        if result.get("challenger_version") is None
        else format_version(int(result["challenger_version"])),
        **sent,
        "dead_lettered": len(lost),  # interactions of the round (rtrl dlq list)
        "challenger_score": result.get("challenger_score"),
        "champion_score": result.get("champion_score"),
    }


def _wait_for_round(
    store: Store,
    topic: str,
    started: datetime,
    target: int,
    *,
    labelled: Callable[[], int],
    check: Callable[[], None],
    timeout_s: float,
    what: str,
    logs: Path,
) -> dict[str, tuple[str, str]]:
    """Wait until `labelled()` reaches `target`, less the episodes that can never settle: those of
    the interactions the labeler dead-lettered (from `topic`) since `started`, the round's start.
    Returns those dead letters, id -> (episode id, reason); raises DemoError after `timeout_s`.

    A ``duplicate:`` dead letter costs nothing (the first copy is stored) and is not counted. An
    agent's episode one of whose calls was dead-lettered is counted as lost although its other calls
    may still settle it; the wait may then end before it does, and it trains in a later cycle.
    Interactions the gateway could not capture (its dead letters go to the DLQ topic, not the
    store) are not seen here: the wait for them times out."""
    lost: dict[str, tuple[str, str]] = {}

    def unsettleable() -> int:
        return len({episode for episode, _ in lost.values()})

    def settled() -> bool:
        check()
        for letter in _dead_letters_since(store, topic, started):
            if not letter.reason.startswith("duplicate:"):
                lost[letter.event_id] = (_episode_of(letter), letter.reason)
        return labelled() >= target - unsettleable()

    try:
        wait_until(settled, timeout_s=timeout_s, interval_s=0.5, what=f"{what}: episodes unsettled")
    except TimeoutError as exc:
        dead = f"; {_dead_letter_line(lost)}" if lost else ""
        have = labelled()
        raise DemoError(
            f"{exc} ({have}/{target - unsettleable()} settled{dead}); see the labeler log in {logs}"
        ) from None
    return lost


def _dead_letters_since(store: Store, topic: str, since: datetime) -> list[DeadLetterEntry]:
    """The store's dead letters of records from `topic` dead-lettered at or after `since` (the
    labeler's clock), newest first; read in growing pages until one reaches past `since`."""
    limit = 64
    while True:
        letters = store.dead_letters(limit)
        if len(letters) < limit or letters[-1].created_at < since:
            return [d for d in letters if d.created_at >= since and d.source_topic == topic]
        limit *= 4


def _dead_letter_line(lost: dict[str, tuple[str, str]]) -> str:
    """One line: how many interactions were dead-lettered, the episodes not waited for, the
    commonest reasons."""
    reasons = Counter(" ".join(reason.split())[:120] for _, reason in lost.values())
    why = "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common(3))
    more = f"; {len(reasons) - 3} other reasons" if len(reasons) > 3 else ""
    episodes = len({episode for episode, _ in lost.values()})
    return f"{len(lost)} interactions dead-lettered, {episodes} episodes not waited for ({why}{more}; `rtrl dlq list`)"


def _episode_of(letter: DeadLetterEntry) -> str:
    """The episode a dead-lettered interaction belongs to, from its payload when readable; else the
    dead letter's own id (one episode per unreadable record)."""
    try:
        episode = json.loads(letter.payload).get("episode_id")
    except (ValueError, AttributeError, RecursionError):
        episode = None
    return episode if isinstance(episode, str) else letter.event_id


def _final_round(
    settings: Settings, registry: Registry, users: _Users, options: DemoOptions
) -> dict[str, Any]:
    """The users once more, on the final champion, without a cycle."""
    champion = format_version(registry.champion())
    requests = options.final_round_requests or options.requests_per_cycle
    sent = users.send(requests, seed=1000 * options.seed + options.cycles + 1)
    reward = sent.pop("users_reward")  # no batch was trained: the row's mean reward is the users'
    return {
        "cycle": "final",
        "version_before": champion,
        "version_after": champion,
        "episodes": 0,
        "mean_reward": round(reward or 0.0, 4),
        "gate": "-",
        "swap_ms": None,
        "data_to_deploy_s": None,
        "challenger": None,
        **sent,
        "challenger_score": None,
        "champion_score": None,
    }


def _print_row(row: dict[str, Any]) -> None:
    print(
        f"cycle {row['cycle']}: {row['version_before']} -> {row['version_after']}, "
        f"{row['episodes']} episodes, mean reward {row['mean_reward']:+.3f}, gate {row['gate']}, "
        f"swap {row['swap_ms']} ms, data-to-deploy {row['data_to_deploy_s']} s",
        flush=True,
    )


def _print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rtrl demo: one row per cycle")
    for header in (
        "cycle",
        "served before",
        "served after",
        "episodes",
        "mean reward",
        "acceptance",
        "eval gate",
        "swap ms",
        "data-to-deploy s",
    ):
        table.add_column(header, justify="right")
    for r in rows:
        table.add_row(
            str(r["cycle"]),
            r["version_before"],
            r["version_after"],
            str(r["episodes"]),
            f"{r['mean_reward']:+.3f}",
            f"{r['acceptance']:.2f}",
            r["gate"],
            "-" if r["swap_ms"] is None else f"{r['swap_ms']:.0f}",
            "-" if r["data_to_deploy_s"] is None else f"{r['data_to_deploy_s']:.1f}",
        )
    Console(width=max(120, Console().width)).print(table)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r for r in rows if isinstance(r["cycle"], int)]  # not the final round's
    cycles = [r["cycle"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(cycles, [r["mean_reward"] for r in rows], marker="o", label="mean reward of the batch")
    ax.plot(cycles, [r["acceptance"] for r in rows], marker="s", label="acceptance (simulated users)")
    for r in rows:
        outcome = "deployed" if r["gate"] == "pass" else "rejected by the gate"
        ax.annotate(
            f"{r['challenger']} {outcome}",
            (r["cycle"], r["mean_reward"]),
            textcoords="offset points",
            xytext=(0, 8),
            ha="center",
            fontsize=8,
        )
    ax.set_xlabel("cycle")
    ax.set_ylabel("reward / rate")
    ax.set_xticks(cycles)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("rtrl: reward per cycle")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

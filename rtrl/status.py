"""``rtrl status``: the whole loop on one screen.

Each part is read on its own, with short timeouts (the store's parts on one store, opened once),
and a part that cannot be read says why instead of failing the rest: the local services (what ``rtrl services status`` shows), the daemon's
processes (the state file ``rtrl run``'s supervisor rewrites every poll, `services.supervisor`), the
labeler's lag and reconciliation (`feedback.reconcile`), the trainer (paused or not, the cycle
under way, the last one and its gate decision), the registry's champion, every server's
weight version, pause and rotation, and who holds the deployer's locks (store/locks.py). ``problems`` lists what needs an operator, each with where to
look; ``rtrl status`` exits 1 when there is one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.settings import Settings
from services.base import process_alive

if TYPE_CHECKING:
    from store import Store

STALE_STATE_S = 30.0  # a supervisor state file older than this: `rtrl run` is not polling any more


def collect(settings: Settings) -> dict[str, Any]:
    """Every part of the loop's state, and the problems found (a JSON-able dict)."""
    problems: list[str] = []
    report: dict[str, Any] = {"problems": problems}

    def part(name: str, read: Callable[[], Any]) -> Any:
        try:
            report[name] = read()
        except Exception as exc:  # noqa: BLE001 - one part down must not hide the others
            report[name] = {
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            }
            problems.append(f"{name}: cannot read it ({report[name]['error']})")
        return report[name]

    with ExitStack() as closing:
        opened: list[Store] = []

        def store() -> Store:
            """The one store every part reads, opened by the first that needs it (an error opening
            it is that part's error, and the next part tries again)."""
            if not opened:
                from store import Store

                opened.append(closing.enter_context(Store(settings.store.url)))
            return opened[0]

        part("services", lambda: _services(settings, problems))
        part("daemon", lambda: _daemon(settings, problems))
        champion = part("registry", lambda: _registry(settings)).get("champion")
        part("labeler", lambda: _labeler(settings, store(), problems))
        part("trainer", lambda: _trainer(settings, store()))
        part("fleet", lambda: _fleet(settings, store(), champion, problems))
        part("locks", lambda: _locks(store()))
    return report


def _services(settings: Settings, problems: list[str]) -> list[dict[str, Any]]:
    import services

    rows = []
    for unit in services.services(settings):
        status = unit.status()
        rows.append(
            {"name": status.name, "healthy": status.healthy, "pid": status.pid, "detail": status.detail}
        )
        if not status.healthy and unit.pid_path.exists():  # started here and not healthy now
            problems.append(f"service {status.name}: {status.detail} (log: {unit.log_path})")
    return rows


def _daemon(settings: Settings, problems: list[str]) -> dict[str, Any]:
    path = Path(settings.services.run_dir) / "supervisor.json"
    if not path.exists():
        problems.append(f"rtrl run is not running (no {path}); start it with `rtrl run`")
        return {"running": False}
    state = json.loads(path.read_text())
    age = time.time() - float(state["updated_at"])
    running = not state.get("stopped") and age < STALE_STATE_S and process_alive(int(state["pid"]))
    daemon = {
        "running": running,
        "pid": state["pid"],
        "state_age_s": round(age, 1),
        "prepared": state.get("prepared"),
        "children": state.get("children", {}),
    }
    if not running:
        problems.append(
            f"rtrl run is not running (its state was last written {age:.0f}s ago); start it with `rtrl run`"
        )
        return daemon
    if not state.get("prepared"):
        problems.append("rtrl run is waiting for its dependencies (store, Kafka, MLflow); see its log")
    for name, child in daemon["children"].items():
        if child.get("crash_looping"):
            problems.append(
                f"{name} is crash-looping (last exit code {child.get('last_exit_code')}); see {child.get('log')}"
            )
        elif not child.get("running") and not child.get("waiting_for_prepare"):
            problems.append(
                f"{name} is down, restarting (last exit code {child.get('last_exit_code')}); see {child.get('log')}"
            )
    return daemon


def _registry(settings: Settings) -> dict[str, Any]:
    import httpx

    from registry import Registry

    uri = settings.mlflow.tracking_uri.rstrip("/")
    if uri.startswith(("http://", "https://")):  # MLflow's client retries for minutes: ask once, briefly
        try:
            httpx.get(f"{uri}/health", timeout=3.0).raise_for_status()
        except httpx.HTTPError as exc:
            raise RuntimeError(
                f"MLflow at {uri} does not answer ({exc!r}); check RTRL_MLFLOW__TRACKING_URI"
            ) from None
    registry = Registry.from_settings(settings)
    versions = registry.versions()
    return {
        "champion": registry.champion() if versions else None,
        "latest": max(versions) if versions else None,
    }


def _labeler(settings: Settings, store: Store, problems: list[str]) -> dict[str, Any]:
    from feedback.reconcile import reconcile

    store.check_schema()
    counts = reconcile(settings, store)
    judging = store.count_judging()
    if counts.pending == 0 and not counts.balanced:
        problems.append(
            f"labeler: {counts.produced} records produced but {counts.stored} stored + "
            f"{counts.dead_lettered} dead-lettered (see docs/runbooks/labeler.md)"
        )
    return {
        "pending": counts.pending,
        "produced": counts.produced,
        "stored": counts.stored,
        "dead_lettered": counts.dead_lettered,
        "balanced": counts.balanced,
        "judging": judging,
    }


def _trainer(settings: Settings, store: Store) -> dict[str, Any]:
    from worker.tasks import training_paused

    store.check_schema()
    active = store.active_cycles()
    recent = store.recent_cycles(5)
    paused = training_paused(settings)
    done = next((c for c in recent if c.finished_at is not None), None)
    return {
        "paused": paused,
        "running": [
            {
                "id": c.id,
                "status": c.status,
                "champion": c.champion,
                "challenger": c.challenger,
                "started_at": c.started_at.isoformat(),
            }
            for c in active
        ],
        "last": None
        if done is None
        else {
            "id": done.id,
            "status": done.status,
            "champion": done.champion,
            "challenger": done.challenger,
            "finished_at": done.finished_at.isoformat() if done.finished_at else None,
            "gate": done.metrics.get("gate"),
            "gate_reason": done.metrics.get("gate_reason"),
            "error": done.error,
        },
    }


def _fleet(
    settings: Settings, store: Store, champion: int | None, problems: list[str]
) -> list[dict[str, Any]]:
    """A row per vLLM server: serving, staging and the live canary's (``vllm.canary_server``), with
    its version, pause and rotation; what an operator must look at goes into `problems`."""
    try:
        rotation = store.rotation()
    except Exception:  # noqa: BLE001 - the store is reported by its own part; show the servers anyway
        rotation = {}
    vllm = settings.vllm
    roles = [(url, "serving") for url in vllm.servers]
    roles += [
        (url, role) for url, role in ((vllm.staging_server, "staging"), (vllm.canary_server, "canary")) if url
    ]
    rows = []
    for url, role in roles:
        row = _server_row(settings, url.rstrip("/"), role, rotation)
        rows.append(row)
        if "error" in row:
            problems.append(f"{row['url']}: {row['error']}; the reconciler restarts local servers")
        elif role == "canary":
            _canary_problems(store, row, problems)
        else:
            if champion is not None and row["version"] != champion:
                problems.append(
                    f"{row['url']} serves {row['version']} but @champion is v{champion}; "
                    "the reconciler aligns it (`rtrl deploy reconcile`)"
                )
            if row.get("in_rotation") is False:
                problems.append(f"{row['url']} is out of rotation: {row.get('rotation_reason')}")
    return rows


def _server_row(settings: Settings, url: str, role: str, rotation: dict[str, Any]) -> dict[str, Any]:
    """What one server says (`rtrl deploy status`'s reading; a dead server is a row with its error)."""
    from serving import VllmClient

    row: dict[str, Any] = {"url": url, "role": role}
    with VllmClient(url, model=settings.vllm.served_model_name, timeout_s=3.0) as server:
        state = server.state()  # never raises
    if state.error is not None:
        row["error"] = state.error[:200]
        return row
    row["version"], row["paused"] = state.weight_version, state.paused
    if url in rotation:
        row["in_rotation"] = rotation[url].in_rotation
        row["rotation_reason"] = rotation[url].reason
    return row


def _canary_problems(store: Store, row: dict[str, Any], problems: list[str]) -> None:
    """The canary server is out of rotation between canaries (idle, whatever it holds) and serves its
    canary's challenger during one (docs/gate.md, Live canary)."""
    try:
        running = store.running_canary()
    except Exception:  # noqa: BLE001 - the store is reported by its own part
        return
    row["canary"] = None if running is None else {"id": running.id, "version": running.challenger_version}
    if running is None:
        if row.get("in_rotation"):
            problems.append(
                f"{row['url']} (canary server) is in rotation but no canary runs; "
                "the worker's reaper takes it out (`rtrl deploy canary status`)"
            )
        return
    if row["version"] != running.challenger_version and row.get("in_rotation"):
        problems.append(
            f"{row['url']} (canary server) serves {row['version']} but canary #{running.id} runs "
            f"v{running.challenger_version}"
        )


def _locks(store: Store) -> list[dict[str, Any]]:
    """The deploy locks' recorded holders; ``held`` False: a row left by a holder that was killed
    (the lock is free, the next holder overwrites it), None: cannot be told here."""
    store.check_schema()
    holders = store.lock_holders()
    return [
        {
            "name": h.name,
            "holder": h.holder,
            "purpose": h.purpose,
            "since": h.acquired_at.isoformat(),
            "held": h.held,
        }
        for h in holders
    ]


def render(report: dict[str, Any]) -> str:
    """The report as a screen of text."""
    lines: list[str] = []

    def failed(name: str) -> bool:
        value = report.get(name)
        if isinstance(value, dict) and "error" in value:
            lines.append(f"{name:<9} cannot read: {value['error']}")
            return True
        return False

    if not failed("services"):
        lines.append(_services_line(report["services"]))
    if not failed("daemon"):
        lines.append(_daemon_line(report["daemon"]))
    if not failed("labeler"):
        lines.append(_labeler_line(report["labeler"]))
    if not failed("trainer"):
        lines.append(_trainer_line(report["trainer"]))
    if not failed("registry"):
        lines.append(_registry_line(report["registry"]))
    if not failed("fleet"):
        lines.extend(_fleet_lines(report["fleet"]))
    if "locks" in report and not failed("locks"):
        lines.append(_locks_line(report["locks"]))
    problems = report["problems"]
    lines.append("problems  " + ("none" if not problems else f"{len(problems)}"))
    lines.extend(f"  - {p}" for p in problems)
    return "\n".join(lines)


def _services_line(services: list[dict[str, Any]]) -> str:
    listed = " · ".join(f"{s['name']} {'ok' if s['healthy'] else s['detail']}" for s in services)
    return "services  " + (listed or "none enabled")  # none: services.enabled is empty (external services)


def _daemon_line(daemon: dict[str, Any]) -> str:
    if not daemon.get("running"):
        return "daemon    not running"
    children = ", ".join(
        f"{name} "
        + ("waiting" if c.get("waiting_for_prepare") else f"pid {c['pid']}" if c.get("running") else "DOWN")
        + (f" ({c['restarts_recent']} restarts)" if c.get("restarts_recent") else "")
        for name, c in daemon["children"].items()
    )
    return f"daemon    rtrl run pid {daemon['pid']}: {children}"


def _labeler_line(lab: dict[str, Any]) -> str:
    return (
        f"labeler   lag {lab['pending']} · produced {lab['produced']} = stored {lab['stored']} + "
        f"dead-lettered {lab['dead_lettered']} ({'balanced' if lab['balanced'] else 'NOT balanced'})"
        + (f" · {lab['judging']} waiting for the judge" if lab.get("judging") else "")
    )


def _trainer_line(tr: dict[str, Any]) -> str:
    paused = tr["paused"]
    text = (
        f"PAUSED since {paused.get('since')} ({paused.get('reason')})"
        if isinstance(paused, dict)
        else ("running" if paused is False else f"pause state {paused}")
    )
    now = (
        "; ".join(f"cycle {c['id']} {c['status']} on v{c['champion']}" for c in tr["running"])
        or "no cycle under way"
    )
    last = tr["last"]
    done = (
        "no cycle finished yet"
        if last is None
        else (
            f"last: cycle {last['id']} {last['status']}"
            + (f" v{last['challenger']}" if last["challenger"] else "")
            + (f", gate {last['gate']}" if last["gate"] else "")
            + (f" ({last['gate_reason']})" if last["gate_reason"] else "")
            + (f", error: {last['error'][:120]}" if last["error"] else "")
        )
    )
    return f"trainer   {text} · {now} · {done}"


def _registry_line(reg: dict[str, Any]) -> str:
    return (
        f"registry  @champion v{reg['champion']} (latest registered v{reg['latest']})"
        if reg["champion"] is not None
        else "registry  empty (`rtrl run` registers the base model)"
    )


def _fleet_lines(fleet: list[dict[str, Any]]) -> list[str]:
    lines = []
    for row in fleet:
        state = row.get("error") or (
            f"v{row['version']}"
            + (" PAUSED" if row.get("paused") else "")
            + (
                ""
                if row.get("in_rotation") in (None, True)
                else f", out of rotation ({row.get('rotation_reason')})"
            )
        )
        if row["role"] == "canary" and "error" not in row:
            canary = row.get("canary")
            state += f" (canary #{canary['id']} of v{canary['version']})" if canary else ", idle"
        lines.append(f"fleet     {row['role']:<8} {row['url']}  {state}")
    return lines


def _locks_line(locks: list[dict[str, Any]]) -> str:
    held = [
        f"{lock['name']} held by {lock['holder']} ({lock['purpose']}) since {lock['since']}"
        + (" (held: unknown)" if lock["held"] is None else "")
        for lock in locks
        if lock["held"] is not False
    ]
    return "locks     " + (" · ".join(held) or "none held")

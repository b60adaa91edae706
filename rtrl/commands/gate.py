"""`rtrl gate`: run the eval gate on a version, and explain a decision it made (docs/gate.md).

rtrl gate run VERSION        challenger VERSION against @champion; JSON; exit 1 when it fails
rtrl gate explain VERSION    the latest decision on VERSION: suites, intervals, alarms, reasons
"""

from __future__ import annotations

import json
from typing import Any

import typer

gate_app = typer.Typer(
    no_args_is_help=True, help="The eval gate: run it on a version, explain its decisions."
)


def run_gate(version: int) -> None:
    """Judge VERSION against @champion, print the decision as JSON, exit 1 when it fails."""
    from deployer.gate import evaluate
    from registry import Registry
    from schemas.settings import load_settings
    from store import Store

    settings = load_settings()
    with Store(settings.store.url) as store:
        store.check_schema()
        decision = evaluate(settings, Registry.from_settings(settings), version, store)
    typer.echo(decision.model_dump_json(indent=2))
    if not decision.passed:
        raise typer.Exit(1)


@gate_app.command("run")
def run(
    version: int = typer.Argument(..., min=1, help="Registered version to judge against @champion."),
) -> None:
    """Judge VERSION against @champion (staging server, held-out traffic); exit 1 when it fails."""
    run_gate(version)


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def explain_text(record: dict[str, Any]) -> str:
    """A decision record (deployer/gate.py GateDecision as JSON) in words, one fact per line."""
    lines = [
        f"v{record['challenger_version']} against champion v{record['champion_version']}"
        + (f" and anchor v{record['anchor_version']}" if record.get("anchor_version") else "")
        + f": {'PASS' if record['passed'] else 'FAIL'} ({record['decided_at']})",
        f"  reason: {record['reason']}",
        f"  rule: every conclusive suite's {record['confidence']:.0%} lower bound of challenger - champion "
        f"above -(its margin) (a census's exact difference at least -(its margin)), at least one conclusive suite "
        "against the champion that is not a guard, no alarm",
    ]
    if record.get("seed") is not None:  # recorded since fresh draws (docs/gate.md, Fresh draws)
        drawn = record.get("draw") or []
        lines.append(
            f"  draw: seed {record['seed']} ({'drawn for this challenger' if record.get('fresh_draw') else 'fixed'})"
            + (f", held-out questions {', '.join(map(str, drawn))}" if drawn else "")
            + (
                f", {len(replayed)} held-out traffic prompts"
                if (replayed := record.get("traffic_draw"))
                else ""
            )
            + "".join(f"; {name}: census, nothing drawn" for name in record.get("census") or [])
        )
    for suite in record.get("suites", []):
        verdict = "inconclusive" if not suite["conclusive"] else "pass" if suite["passed"] else "FAIL"
        diff = suite.get("difference")
        interval = f"{diff['estimate']:+.4f} [{diff['low']:+.4f}, {diff['high']:+.4f}]" if diff else "-"
        lines.append(
            f"  suite {suite['name']:<16} {verdict:<12} challenger {_figure(suite['challenger'])} "
            f"champion {_figure(suite['champion'])} difference {interval} margin {suite.get('margin', 0):g} "
            f"n={suite['n']}"
            + (f" ess={suite['ess']:.1f}" if suite.get("ess") is not None else "")
            + (" guard (can fail, never passes alone)" if suite.get("guard") else "")
            + (f" estimator={suite['estimator']}" if suite.get("estimator") else "")
        )
        if suite.get("note"):
            lines.append(f"        {suite['note']}")
    for alarm in record.get("alarms", []):
        lines.append(
            f"  alarm {alarm['name']:<16} {'FIRED' if alarm['fired'] else 'ok':<12} {alarm['detail']} "
            f"(threshold {alarm['threshold']:.4g})"
        )
    for model, figures in record.get("behaviour", {}).items():
        lines.append(
            f"  {model:<10} {figures['completions']} completions, {figures['mean_tokens']:.1f} tokens, "
            f"entropy {figures['entropy']:.3f}, repetitive {figures['repetition']:.1%}, "
            f"non-answers {figures['no_action']:.1%}, truncated {figures['truncated']:.1%}"
        )
    return "\n".join(lines)


@gate_app.command("explain")
def explain(
    version: int = typer.Argument(..., min=1, help="Version the gate judged."),
    as_json: bool = typer.Option(False, "--json", help="The full decision record as JSON."),
    every: bool = typer.Option(
        False, "--all", help="Every decision on VERSION, newest first (default: the latest)."
    ),
) -> None:
    """Why the gate passed or failed VERSION: each suite's interval, each alarm, the reason."""
    from schemas.settings import load_settings
    from store import Store

    with Store(load_settings().store.url) as store:
        store.check_schema()
        records = store.gate_decisions(version)
    if not records:
        typer.echo(f"no gate decision is recorded for v{version}; run `rtrl gate run {version}`", err=True)
        raise typer.Exit(1)
    shown = records if every else records[:1]
    if as_json:
        typer.echo(json.dumps(shown if every else shown[0], indent=2))
        return
    typer.echo("\n\n".join(explain_text(r) for r in shown))


def register(app: typer.Typer) -> None:
    """Add `rtrl gate ...` to the root app."""
    app.add_typer(gate_app, name="gate")

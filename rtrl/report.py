"""``rtrl report``: how the loop has been doing, as one self-contained HTML page of plots.

`collect(store)` reads the store alone (`ReportStore.report`, store/reports.py: grouped SQL
queries in one transaction) into `ReportData`; `render(data)` turns that into HTML whose plots are inline SVG (rtrl/charts.py). The page has no
JavaScript and fetches nothing (no CDN, no fonts), so it opens from a file, a mail or an archive,
and it needs neither MLflow nor Kafka to be made. Started by ``rtrl report``
(rtrl/commands/report.py); what each plot means is in docs/report.md.

Every string read from the database (tenant ids, gate reasons, errors, dead-letter reasons, even
statuses) is user-controlled or carries user text, so it is HTML-escaped where it is written;
numbers are formatted here.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from html import escape

from rtrl.charts import (
    CHAMPION,
    COLORS,
    FAIL,
    PASS,
    Frame,
    Series,
    bar_chart,
    line_chart,
    num,
    pct,
    svg,
    value_range,
)
from schemas.clock import utcnow
from schemas.rewards import NO_FEEDBACK
from store.reports import CycleRow, ReportRows, ReportStore

# ---- what the page shows -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ReportData(ReportRows):
    """Everything `render` draws: the store's numbers (`ReportRows`: versions, cycles, dead letters,
    tenants) and when, over what window and from which store they were read; `collect` reads it."""

    generated_at: datetime
    since: datetime | None  # None: the whole history
    store: str  # the store's URL, password hidden


def collect(
    store: ReportStore, *, since: datetime | None = None, now: Callable[[], datetime] = utcnow
) -> ReportData:
    """Read the report's numbers from `store` (one transaction, `ReportStore.report`, the busiest
    `store.reports.TOP_TENANTS` tenants); only what happened at or after `since` when given
    (episodes by when they settled, segments and feedback by when they were ingested, cycles by
    when they started, dead letters by when they were written)."""
    rows = store.report(since)
    return ReportData(**vars(rows), generated_at=now(), since=since, store=store.where)


# ---- plots of this report (the generic ones are in rtrl/charts.py) --------------------------------


def gate_chart(name: str, title: str, cycles: Sequence[CycleRow]) -> str:
    """Per cycle: the champion's score (grey), the challenger's (green dot: passed, red cross:
    failed), joined by a line whose length is the difference."""
    scores = [v for c in cycles for v in (c.challenger_score, c.champion_score) if v is not None]
    frame = Frame(
        [f"c{c.id}" for c in cycles], *value_range(scores, zero=False), "gate score (mean reward)", num
    )
    body = frame.axes()
    for i, c in enumerate(cycles):
        x = frame.x(i)
        if c.challenger_score is not None and c.champion_score is not None:
            body.append(
                f'<line class="diff" x1="{x:.1f}" x2="{x:.1f}" y1="{frame.y(c.champion_score):.1f}" '
                f'y2="{frame.y(c.challenger_score):.1f}"/>'
            )
        if c.champion_score is not None:
            tip = f"c{c.id}: champion v{c.champion} scored {num(c.champion_score)}"
            body.append(
                f'<circle cx="{x:.1f}" cy="{frame.y(c.champion_score):.1f}" r="4" fill="{CHAMPION}">'
                f"<title>{escape(tip)}</title></circle>"
            )
        if c.challenger_score is not None:
            y, passed = frame.y(c.challenger_score), c.gate == "pass"
            tip = f"c{c.id}: challenger v{c.challenger} scored {num(c.challenger_score)}, gate {c.gate}"
            if passed:
                mark = f'<circle class="pass" cx="{x:.1f}" cy="{y:.1f}" r="5" fill="{PASS}">'
                body.append(f"{mark}<title>{escape(tip)}</title></circle>")
            else:
                d = f"M{x - 5:.1f},{y - 5:.1f}L{x + 5:.1f},{y + 5:.1f}M{x - 5:.1f},{y + 5:.1f}L{x + 5:.1f},{y - 5:.1f}"
                body.append(
                    f'<path class="fail" d="{d}" stroke="{FAIL}" stroke-width="2.5">'
                    f"<title>{escape(tip)}</title></path>"
                )
    legend = [("champion", CHAMPION), ("challenger, passed", PASS), ("challenger, failed", FAIL)]
    return svg(name, title, body, legend)


# ---- the page ----------------------------------------------------------------------------------

STATUSES = ("promoted", "rejected", "failed", "skipped", "registered", "running")
MAX_DAYS = 120  # days of dead letters drawn; older ones stay in the counts


def render(data: ReportData) -> str:
    """The whole page as HTML; valid with no data at all."""
    window = "all history" if data.since is None else f"since {data.since:%Y-%m-%d %H:%M} UTC"
    sections = [
        _summary(data),
        _reward_section(data),
        _latency_section(data),
        _gate_section(data),
        _behaviour_section(data),
        _cycles_section(data),
        _tenants_section(data),
    ]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rtrl report</title>
<style>{_CSS}</style></head>
<body><main>
<h1>rtrl report</h1>
<p class="meta">Store {escape(data.store)} · {escape(window)} · made {data.generated_at:%Y-%m-%d %H:%M:%S} UTC
by <code>rtrl report</code> (docs/report.md explains every plot).</p>
{"".join(sections)}
</main></body></html>
"""


def _section(anchor: str, heading: str, how: str, *content: str) -> str:
    return f'<section id="{anchor}"><h2>{escape(heading)}</h2><p class="how">{how}</p>{"".join(content)}</section>'


def _empty(text: str) -> str:
    return f'<p class="empty">{escape(text)}</p>'


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    """`rows` hold HTML already escaped by the caller."""
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _version(n: int | None) -> str:
    return "–" if n is None else f"v{n}"


def _summary(data: ReportData) -> str:
    counts = Counter(c.status for c in data.cycles)
    promoted = [c for c in data.cycles if c.status == "promoted"]
    serving = f"v{promoted[-1].challenger}" if promoted else "no promotion yet"
    letters = sum(sum(day.values()) for day in data.dead_letters.values())
    tiles = [
        ("cycles", str(len(data.cycles))),
        *((status, str(counts[status])) for status in ("promoted", "rejected", "failed", "skipped")),
        ("last promoted", serving),
        ("settled episodes", str(sum(v.episodes for v in data.versions))),
        ("dead letters", str(letters)),
    ]
    html = (
        '<section id="summary"><div class="tiles">'
        + "".join(
            f'<div class="tile"><div class="value">{escape(value)}</div><div class="name">{escape(name)}</div></div>'
            for name, value in tiles
        )
        + "</div>"
    )
    if not data.cycles:
        html += _empty(
            "No cycles yet: the trainer has not run a training cycle"
            + ("." if data.since is None else " in this window.")
        )
    return html + "</section>"


def _reward_section(data: ReportData) -> str:
    how = (
        "Live reward: the mean reward of settled episodes, by the policy version that served them (an "
        "episode counts under the oldest version among its segments, as in training). <b>Positive share</b>: "
        "the share of settled episodes with a reward above 0; every episode counts, including those without "
        "feedback (reward 0). <b>Acceptance</b>: of the episodes that got an explicit <code>accepted</code> or "
        "<code>rejected</code> signal, the share that got <code>accepted</code> (a signal sent twice counts "
        "once)."
    )
    versions = [v for v in data.versions if v.episodes]
    if not versions:
        return _section(
            "reward", "Live reward and acceptance per policy version", how, _empty("No settled episodes yet.")
        )
    labels = [_version(v.version) for v in versions]
    reward = line_chart(
        "reward",
        "Mean reward of settled episodes per policy version",
        labels,
        [Series("mean reward", COLORS[0], [v.mean_reward for v in versions])],
        "mean reward",
    )
    rates = line_chart(
        "acceptance",
        "Positive share and acceptance per policy version",
        labels,
        [
            Series("positive share", COLORS[1], [v.positive_rate for v in versions]),
            Series("acceptance", COLORS[3], [v.acceptance for v in versions]),
        ],
        "share of episodes",
        percent=True,
    )
    table = _table(
        ["version", "settled episodes", "mean reward", "positive share", "accepted / judged", "acceptance"],
        [
            [
                _version(v.version),
                str(v.episodes),
                num(v.mean_reward),
                pct(v.positive_rate),
                f"{v.accepted} / {v.judged}",
                pct(v.acceptance),
            ]
            for v in versions
        ],
        "numbers",
    )
    return _section("reward", "Live reward and acceptance per policy version", how, reward, rates, table)


def _latency_section(data: ReportData) -> str:
    how = (
        "Data-to-deploy: for each promoted cycle, seconds from the first interaction of the episodes it learnt "
        "from to the moment the whole fleet served the new version. It bounds how stale the data behind the "
        "served policy can be."
    )
    promoted = [c for c in data.cycles if c.status == "promoted" and c.data_to_deploy_s is not None]
    if not promoted:
        return _section("latency", "Data-to-deploy latency", how, _empty("No promoted cycle yet."))
    chart = bar_chart(
        "latency",
        "Data-to-deploy seconds per promoted cycle",
        [f"c{c.id}→v{c.challenger}" for c in promoted],
        [Series("data-to-deploy", COLORS[0], [c.data_to_deploy_s for c in promoted])],
        "seconds",
        legend=False,
    )
    swaps = [c.swap_ms for c in promoted if c.swap_ms is not None]
    median = statistics.median([c.data_to_deploy_s or 0.0 for c in promoted])
    note = (
        f"<p>Median {num(median)} s over {len(promoted)} promotion(s); median hot-swap "
        f"{num(statistics.median(swaps)) if swaps else '–'} ms.</p>"
    )
    return _section("latency", "Data-to-deploy latency", how, chart, note)


def _gate_section(data: ReportData) -> str:
    how = (
        "Each cycle that reached the eval gate: the challenger's and the champion's mean reward on the held-out "
        "prompts. The challenger passes unless it scores below the champion by more than the tolerance "
        "(<code>RTRL_GATE__TOLERANCE</code>). A passed challenger that then failed to deploy is a failed cycle."
    )
    gated = [c for c in data.cycles if c.gate is not None]
    if not gated:
        return _section("gate", "Gate decisions", how, _empty("No cycle has reached the gate yet."))
    chart = gate_chart("gate", "Challenger vs champion score per cycle", gated)
    rows = []
    for c in gated:
        diff = (
            None
            if c.challenger_score is None or c.champion_score is None
            else c.challenger_score - c.champion_score
        )
        decision = "pass" if c.gate == "pass" else "fail" if c.gate == "fail" else "other"
        rows.append(
            [
                f"c{c.id}",
                f"{_version(c.champion)} → {_version(c.challenger)}",
                f'<span class="gate-{decision}">{escape(c.gate or "")}</span>',
                num(c.challenger_score),
                num(c.champion_score),
                num(diff),
                escape(c.gate_reason or ""),
            ]
        )
    table = _table(
        ["cycle", "versions", "decision", "challenger", "champion", "difference", "reason"], rows, "gate"
    )
    return _section("gate", "Gate decisions", how, chart, table)


def _behaviour_section(data: ReportData) -> str:
    how = (
        f"<b>No-feedback rate</b>: settled episodes that got no signal at all and were closed by the settle window "
        f"(reward 0 with the component <code>{NO_FEEDBACK}</code>), over all settled episodes of the version. "
        "A rising rate means users stopped answering. <b>Untrainable rate</b>: segments the version served that "
        "were captured with <code>trainable=false</code> (sampling the trainer cannot reproduce, or a stream "
        "cut short), over all its segments except sub-agent ones, which are frozen by design. "
        "<b>Dead letters</b>: records the labeler or the gateway refused, per UTC day, by the first word of "
        "their reason (<code>schema</code>, <code>content</code>, <code>duplicate</code>, ...; "
        "<code>rtrl dlq list --reason PREFIX</code> lists them)."
    )
    parts = []
    versions = [v for v in data.versions if v.episodes or v.segments]
    if versions:
        parts.append(
            line_chart(
                "behaviour",
                "No-feedback and untrainable rates per policy version",
                [_version(v.version) for v in versions],
                [
                    Series("no-feedback rate", COLORS[4], [v.no_feedback_rate for v in versions]),
                    Series("untrainable rate", COLORS[5], [v.untrainable_rate for v in versions]),
                ],
                "share",
                percent=True,
            )
        )
        parts.append(
            _table(
                [
                    "version",
                    "no feedback / settled",
                    "no-feedback rate",
                    "untrainable / segments",
                    "untrainable rate",
                ],
                [
                    [
                        _version(v.version),
                        f"{v.no_feedback} / {v.episodes}",
                        pct(v.no_feedback_rate),
                        f"{v.untrainable} / {v.segments}",
                        pct(v.untrainable_rate),
                    ]
                    for v in versions
                ],
                "numbers",
            )
        )
    else:
        parts.append(_empty("No episodes or segments yet."))
    if data.dead_letters:
        parts.append(_dead_letter_chart(data.dead_letters))
    else:
        parts.append(_empty("No dead letters."))
    return _section("behaviour", "Behaviour rates", how, *parts)


def _dead_letter_chart(days: dict[date, Counter[str]]) -> str:
    last = max(days)
    first = max(min(days), last - timedelta(days=MAX_DAYS - 1))
    span = [first + timedelta(days=i) for i in range((last - first).days + 1)]  # days without any as 0
    totals: Counter[str] = Counter()
    for day in span:
        totals.update(days.get(day, Counter()))
    named = [p for p, _ in totals.most_common(len(COLORS) - 1)]

    def count(day: date, prefix: str | None) -> float:
        c = days.get(day, Counter())
        return float(c[prefix] if prefix is not None else sum(n for p, n in c.items() if p not in named))

    stacks = [Series(p, COLORS[i], [count(d, p) for d in span]) for i, p in enumerate(named)]
    if len(totals) > len(named):
        stacks.append(Series("other", COLORS[-1], [count(d, None) for d in span]))
    chart = bar_chart(
        "dead-letters",
        "Dead letters per day by reason prefix",
        [f"{d:%m-%d}" for d in span],
        stacks,
        "dead letters per day",
    )
    older = sum(sum(c.values()) for d, c in days.items() if d < first)
    return chart + (
        f"<p>{older} older dead letter(s) before {first:%Y-%m-%d} are not drawn.</p>" if older else ""
    )


def _cycles_section(data: ReportData) -> str:
    how = (
        "Every training cycle, newest first. <b>episodes</b> and <b>mean reward</b> describe the batch it "
        "trained on; <b>swap ms</b> is the longest pause of a server during the hot-swap; an error is why a "
        "cycle failed (hover for the whole text)."
    )
    if not data.cycles:
        return _section("cycles", "Cycles", how, _empty("No cycles yet."))
    rows = []
    for c in reversed(data.cycles):
        status = c.status if c.status in STATUSES else "other"
        error = c.error or ""
        rows.append(
            [
                str(c.id),
                f'<span class="status-{status}">{escape(c.status)}</span>',
                f"{_version(c.champion)} → {_version(c.challenger)}",
                f"{c.started_at:%Y-%m-%d %H:%M}",
                num(c.episodes),
                num(c.mean_reward),
                escape(c.gate or "–"),
                num(c.swap_ms),
                num(c.data_to_deploy_s),
                f'<span title="{escape(error)}">{escape(error[:160] + ("…" if len(error) > 160 else ""))}</span>',
            ]
        )
    head = [
        "id",
        "status",
        "versions",
        "started (UTC)",
        "episodes",
        "mean reward",
        "gate",
        "swap ms",
        "data-to-deploy s",
        "error",
    ]
    return _section("cycles", "Cycles", how, _table(head, rows, "cycles"))


def _tenants_section(data: ReportData) -> str:
    how = "Where the settled episodes come from: the busiest tenants, by settled episodes in the window."
    if not data.tenants:
        return _section("tenants", "Tenants", how, _empty("No settled episodes yet."))
    rows = [
        [escape(t.tenant), str(t.episodes), num(t.mean_reward), pct(t.no_feedback_rate)] for t in data.tenants
    ]
    more = data.tenant_count - len(data.tenants)
    note = f"<p>{more} more tenant(s) not shown.</p>" if more > 0 else ""
    return _section(
        "tenants",
        "Tenants",
        how,
        _table(["tenant", "settled episodes", "mean reward", "no-feedback rate"], rows, "numbers"),
        note,
    )


_CSS = """
body { margin: 0; background: #f8fafc; color: #0f172a; font: 14px/1.45 system-ui, sans-serif; }
main { max-width: 1040px; margin: 0 auto; padding: 24px; }
h1 { margin: 0 0 4px; } h2 { margin: 0 0 6px; font-size: 18px; }
section { background: #fff; border: 1px solid #e2e8f0; border-radius: 8px; padding: 16px 20px; margin: 16px 0; }
.meta, .how { color: #475569; } .how { max-width: 880px; }
.empty { padding: 12px; background: #f1f5f9; border-radius: 6px; color: #334155; }
.tiles { display: flex; flex-wrap: wrap; gap: 12px; }
.tile { min-width: 110px; padding: 8px 12px; background: #f1f5f9; border-radius: 6px; }
.tile .value { font-size: 20px; font-weight: 600; } .tile .name { color: #475569; }
figure { margin: 8px 0 12px; } svg.plot { width: 100%; max-width: 720px; height: auto; display: block; }
figcaption { display: flex; gap: 16px; flex-wrap: wrap; color: #334155; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 5px; }
.grid { stroke: #e2e8f0; } .axis { stroke: #94a3b8; } .zero { stroke: #94a3b8; stroke-dasharray: 4 3; }
.diff { stroke: #94a3b8; stroke-width: 2; }
.tick { font-size: 11px; fill: #475569; } .label { font-size: 12px; fill: #334155; }
table { border-collapse: collapse; width: 100%; margin: 8px 0; font-size: 13px; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #e2e8f0; vertical-align: top; }
td { white-space: nowrap; } td:last-child { white-space: normal; overflow-wrap: anywhere; } th { background: #f8fafc; }
figure h3 { margin: 0 0 4px; font-size: 14px; font-weight: 600; }
.status-promoted, .gate-pass { color: #15803d; font-weight: 600; }
.status-rejected, .status-failed, .gate-fail { color: #b91c1c; font-weight: 600; }
.status-skipped, .status-running, .status-registered { color: #475569; }
"""

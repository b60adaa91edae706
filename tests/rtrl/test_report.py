"""``rtrl report``: numbers worked by hand from a small SQLite store, the page opened in headless
Chromium (no console errors, the plots drawn), hostile strings from the database kept as text, and
the real CLI."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from factories import T0, Feeder, at, feedback, interaction
from helpers import open_in_browser, run_rtrl
from sqlalchemy import update

from rtrl.report import ReportData, collect, render
from schemas.settings import Settings
from store import Store
from store.models import DeadLetter, Episode

pytestmark = pytest.mark.unit

HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'
PLOTS = ("reward", "acceptance", "latency", "gate", "behaviour", "dead-letters")


def fill(store: Store) -> None:
    """Two served versions, four cycles and dead letters on two days.

    v1: a1 accepted (window, 0.75), a2 rejected (-0.25), a3 and a4 without feedback (window, 0):
        mean 0.125, positive 1/4, acceptance 1/2, no feedback 2/4.
    v2: b1 accepted + thumbs_up (1.25), b2 edit_persisted (1.0) with a sub-agent segment, b3
        without feedback from an untrainable segment: mean 0.75, positive 2/3, acceptance 1/1, no
        feedback 1/3, untrainable 1/3 (the sub-agent segment does not count).
    """
    feeder = Feeder(store)
    feeder.send(
        interaction("a1"),
        interaction("a2"),
        interaction("a3"),
        interaction("a4"),
        feedback("r-a1-0", "accepted"),
        feedback("r-a2-0", "rejected"),
        interaction("b1", version="v2"),
        interaction("b2", version="v2"),
        interaction("b2", 1, version="v2", role="subagent", trainable=False),
        interaction("b3", version="v2", trainable=False, untrainable_reason="penalty"),
        feedback("r-b1-0", "accepted"),
        feedback("r-b1-0", "thumbs_up"),
        feedback("r-b2-0", "edit_persisted"),
    )
    feeder.settle_window(at(100))
    feeder.send(b"not json", b'{"schema_version": "rtrl.interaction.v9"}', now=at(86_400))  # a day later

    # c1 promoted v1 -> v2, c2 rejected v3 at the gate, c3 failed before registering, c4 passed the gate
    # and failed in the swap (its metrics carry the gate, the error says why).
    c1 = store.acquire_cycle("w", 60, champion=1)
    assert c1 is not None
    store.finish_cycle(c1, "registered", challenger=2, metrics={"episodes": 7, "mean_reward": 0.4})
    store.finish_cycle(
        c1,
        "promoted",
        metrics={
            "gate": "pass",
            "gate_reason": "0.61 >= 0.55 - 0.05",
            "challenger_score": 0.61,
            "champion_score": 0.55,
            "swap_ms": 120.5,
            "deployed_at": at(600).isoformat(),
            "data_to_deploy_s": 600.0,
        },
    )
    c2 = store.acquire_cycle("w", 60, champion=2)
    assert c2 is not None
    store.finish_cycle(c2, "registered", challenger=3, metrics={"episodes": 5, "mean_reward": 0.2})
    store.finish_cycle(
        c2,
        "rejected",
        metrics={
            "gate": "fail",
            "gate_reason": f"0.30 < 0.60 - 0.05 {HOSTILE}",
            "challenger_score": 0.3,
            "champion_score": 0.6,
        },
    )
    c3 = store.acquire_cycle("w", 60, champion=2)
    assert c3 is not None
    store.finish_cycle(c3, "failed", error=f"OOM {HOSTILE}")
    c4 = store.acquire_cycle("w", 60, champion=2)
    assert c4 is not None
    store.finish_cycle(c4, "registered", challenger=4, metrics={"episodes": 6, "mean_reward": 0.5})
    store.finish_cycle(
        c4,
        "failed",
        error="swap failed: digest mismatch",
        metrics={"gate": "pass", "gate_reason": "ok", "challenger_score": 0.7, "champion_score": 0.6},
    )

    with store.transaction() as session:  # what the wire schema refuses may still be in an old store
        session.execute(update(Episode).where(Episode.episode_id == "a1").values(tenant=HOSTILE))
        session.add(
            DeadLetter(
                event_id="dl-hostile",
                source="gateway",
                reason=f"{HOSTILE}: spool full",
                payload=b"",
                created_at=at(86_400),
            )
        )


def test_collect_counts_per_version_cycle_and_day(store: Store) -> None:
    fill(store)
    data = collect(store, now=lambda: at(100_000))
    v1, v2 = data.versions
    assert (v1.version, v1.episodes, v1.mean_reward, v1.positive, v1.no_feedback) == (1, 4, 0.125, 1, 2)
    assert (v1.judged, v1.accepted, v1.acceptance, v1.segments, v1.untrainable) == (2, 1, 0.5, 4, 0)
    assert (v2.version, v2.episodes, v2.mean_reward, v2.positive, v2.no_feedback) == (2, 3, 0.75, 2, 1)
    assert (v2.judged, v2.accepted, v2.segments, v2.untrainable) == (1, 1, 3, 1)
    assert [(c.id, c.status, c.champion, c.challenger, c.gate) for c in data.cycles] == [
        (1, "promoted", 1, 2, "pass"),
        (2, "rejected", 2, 3, "fail"),
        (3, "failed", 2, None, None),
        (4, "failed", 2, 4, "pass"),
    ]
    c1 = data.cycles[0]
    assert (c1.episodes, c1.mean_reward, c1.swap_ms, c1.data_to_deploy_s) == (7, 0.4, 120.5, 600.0)
    assert data.dead_letters == {T0.date() + timedelta(days=1): {"schema": 2, "other": 1}}
    assert [(t.tenant, t.episodes) for t in data.tenants] == [("default", 6), (HOSTILE, 1)]

    # --since: only what settled, was ingested, started or was written from then on.
    later = collect(store, since=at(3_600))
    assert later.versions == [] and later.tenants == []
    assert [c.id for c in later.cycles] == []  # the lease clock of the fixture stayed at T0
    assert sum(sum(day.values()) for day in later.dead_letters.values()) == 3


def test_the_page_shows_the_numbers_and_escapes_what_the_database_holds(store: Store) -> None:
    fill(store)
    page = render(collect(store))
    for shown in (
        "0.125",
        "25.0%",
        "50.0%",
        "66.7%",
        "33.3%",
        "100.0%",
        "1 / 2",
        "1 / 3",
        "2 / 4",
        "c1→v2",
        "120",
        "600",
        "0.61",
        "digest mismatch",
        "v2 → v4",
    ):
        assert shown in page, shown
    for plot in PLOTS:
        assert f'data-plot="{plot}"' in page
    assert "<script" not in page and "<img" not in page  # every "<" from the database came out as "&lt;"
    assert (
        page.count("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;") == 4
    )  # gate reason, error (text, title), tenant


def test_an_empty_store_is_a_page_that_says_so(store: Store, tmp_path: Path) -> None:
    data = collect(store)
    assert data == ReportData(generated_at=data.generated_at, since=None, store=data.store)
    path = tmp_path / "empty.html"
    path.write_text(render(data))
    dom, errors = open_in_browser(path)
    assert errors == []
    assert "No cycles yet: the trainer has not run a training cycle." in dom
    assert "No settled episodes yet." in dom and "No dead letters." in dom and "<svg" not in dom


def test_the_page_renders_in_a_browser_with_its_plots_and_no_errors(store: Store, tmp_path: Path) -> None:
    fill(store)
    path = tmp_path / "report.html"
    path.write_text(render(collect(store)))
    dom, errors = open_in_browser(path)
    assert errors == []
    for plot in PLOTS:
        svg = re.search(rf'<svg class="plot" data-plot="{plot}"[^>]*>(.*?)</svg>', dom, re.DOTALL)
        assert svg is not None, plot
        assert re.search(r"<(circle|rect|path|polyline)\b", svg.group(1)), f"{plot} has no marks"
    headings = re.findall(r"<h2>(.*?)</h2>", dom)
    assert headings == [
        "Live reward and acceptance per policy version",
        "Data-to-deploy latency",
        "Gate decisions",
        "Behaviour rates",
        "Cycles",
        "Tenants",
    ]
    # The hostile strings are text in the DOM, never elements: nothing ran, nothing was fetched.
    assert "<script" not in dom and "<img" not in dom
    assert dom.count('&lt;script&gt;alert("x")&lt;/script&gt;') == 3  # gate reason, error, tenant
    assert not re.search(r'(src|href)="?(https?:)?//', dom)  # self-contained: no external resource


def test_the_browser_check_sees_a_broken_page(tmp_path: Path) -> None:
    path = tmp_path / "broken.html"
    path.write_text(
        '<!DOCTYPE html><html><body><p>x</p><script>throw new Error("x")</script>'
        '<script>console.error("bad\\nthing")</script></body></html>'
    )
    dom, errors = open_in_browser(path)
    assert "<p>x</p>" in dom
    assert len(errors) == 2 and errors[0].startswith('"Uncaught Error: x", source: file://'), errors
    assert errors[1].startswith('"bad\nthing"'), errors


def test_rtrl_report_reads_only_the_store(tmp_path: Path) -> None:
    """MLflow, Kafka and the rest point at ports where nothing listens: the store is all it needs."""
    url = f"sqlite:///{tmp_path}/rtrl.db"
    settings = Settings().model_copy(
        update={
            "store": Settings().store.model_copy(update={"url": url}),
            "services": Settings().services.model_copy(update={"run_dir": tmp_path / "run"}),
        }
    )
    never = run_rtrl(settings, "report", timeout_s=120)
    assert never.returncode == 1 and never.stderr.strip().count("\n") == 0, never.stderr
    assert never.stderr.startswith("rtrl: ") and "run `rtrl labeler migrate`" in never.stderr
    assert not (tmp_path / "rtrl.db").exists()

    store = Store(url)
    store.migrate()
    fill(store)
    store.close()
    made = run_rtrl(settings, "report", timeout_s=120)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == str(tmp_path / "run" / "report.html")
    assert 'data-plot="gate"' in (tmp_path / "run" / "report.html").read_text()
    out = tmp_path / "elsewhere" / "r.html"
    recent = run_rtrl(settings, "report", "--out", str(out), "--since", "7", timeout_s=120)
    assert recent.returncode == 0 and recent.stdout.strip() == str(out), recent.stderr
    assert "No settled episodes yet." in out.read_text()  # the fixture's data are from 2026-01-01

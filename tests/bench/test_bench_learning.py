"""bench/bench_learning.py's pure parts (issue 39): the populations and the style users, the command
line's errors, the loss it trains with, and the figures and JSON of bench/learning_report.py from
hand-made rows and gate records. The loop itself needs every service: `make bench` runs it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from evals import get_task, load_preference
from schemas.events import FeedbackKind
from schemas.settings.losses import CispoLoss, DpoLoss, RftLoss

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _load("bench_learning")


@pytest.fixture(scope="module")
def figures() -> ModuleType:
    return _load("learning_report")


# ---- users ---------------------------------------------------------------------------------------


def test_each_population_names_a_preference_the_demo_can_load(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))  # what main() does before the demo loads them
    assert set(bench.POPULATIONS) == {"style", "correct_only", "correct_with_corrections"}
    for spec in bench.POPULATIONS.values():
        assert callable(load_preference(spec))
    assert bench.POPULATIONS["style"] == "bench_learning:bare_answer"


@pytest.mark.parametrize(
    ("completion", "accepted"),
    [
        (" 7.", True),
        (" 7!", True),
        (" red", True),
        (" Monday.", True),
        (" 8.", True),  # a style: a wrong answer in the shape is accepted
        (" It is 7.", False),
        (" The answer is 7!", False),
        (" 7 8.", False),
        (" !", False),
        ("", False),
        (" 7?", False),
    ],
)
def test_style_users_want_the_bare_answer(bench: ModuleType, completion: str, accepted: bool) -> None:
    prompt = get_task("exclaim").format_prompt("What is 3 plus 4?")
    said = bench.bare_answer(prompt, completion)
    assert [s.kind for s in said] == [FeedbackKind.accepted if accepted else FeedbackKind.rejected]


def test_the_style_is_two_of_the_six_supervised_shapes_and_not_the_demos(bench: ModuleType) -> None:
    # Two of the exclaim task's six supervised shapes are bare ("{answer}." and "{answer}!"), one of
    # the three plain and one of the three preferred, so the base gives the style some of the time;
    # and it is not the demo's preference (which accepts "It is 7!" and rejects "7.").
    task = get_task("exclaim")
    prompt = task.format_prompt("What is 3 plus 4?")
    shapes = (*task.plain_shapes, *task.preferred_shapes)
    bare = [
        s
        for s in shapes
        if bench.bare_answer(prompt, " " + s.format(answer="7"))[0].kind == FeedbackKind.accepted
    ]
    assert bare == ["{answer}.", "{answer}!"]
    assert task.preference(prompt, " It is 7!")[0].kind == FeedbackKind.accepted
    assert bench.bare_answer(prompt, " It is 7!")[0].kind == FeedbackKind.rejected


# ---- the command line ------------------------------------------------------------------------------


def test_defaults_are_issue_39s_competent_base_and_the_exclaim_users(bench: ModuleType) -> None:
    args = bench.parse_args([])
    assert args.recipe == "v2" and args.loss is None and args.reward_spec is None
    assert not args.baseline_rft
    assert bench.population_of(args) == ("exclaim", None)
    assert bench.parse_args(["--recipe", "v1"]).recipe == "v1"  # v1 stays selectable
    assert bench.parse_args(["--model-dir", "/m"]).recipe is None


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--population", "style"], ("style", "bench_learning:bare_answer")),
        (["--population", "correct_only"], ("correct_only", "bench_learning:correct_only")),
        (["--preference", "pkg.mod:fn"], ("custom", "pkg.mod:fn")),
        (["--hack"], ("hack", "bench_learning:correct_or_silent")),
    ],
)
def test_population_of(bench: ModuleType, argv: list[str], expected: tuple[str, str]) -> None:
    assert bench.population_of(bench.parse_args(argv)) == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--population", "style", "--preference", "a:b"], "not allowed with"),
        (["--population", "style", "--hack"], "not allowed with"),
        (["--population", "nobody"], "invalid choice"),
        (["--recipe", "v2", "--model-dir", "/m"], "--model-dir brings another"),
        (["--loss", "rft", "--baseline-rft"], "is rft already"),
        (["--loss", "sft"], "invalid choice"),
        (["--reward-spec", "no-such-spec"], "unknown reward spec"),
        (["--replay-weight", "-1"], "--replay-weight must be >= 0"),
    ],
)
def test_argument_errors(
    bench: ModuleType, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_replay_weight_writes_the_bases_training_answers_and_sets_trainer_replay(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The base's greedy decode is services/tinymodel.py's (tests/services/test_tinymodel.py): here
    # its answers are two made-up examples; what is checked is the file and the settings.
    import services.tinymodel
    import services.vllm
    from schemas.replay import ReplayExample, read_replay_file
    from services.testing import services_settings

    examples = [
        ReplayExample.model_validate({"messages": [{"role": "user", "content": q}], "completion": " 1."})
        for q in ("What is 0 plus 1?", "What comes after 0?")
    ]
    asked: list[Path | None] = []

    def replay_examples(task: str, model_dir: Path | None = None, seed: int = 0) -> list[ReplayExample]:
        asked.append(model_dir)
        return examples

    monkeypatch.setattr(services.vllm, "ensure_model", lambda settings: tmp_path / "model")
    monkeypatch.setattr(services.tinymodel, "replay_examples", replay_examples)
    assert bench.parse_args([]).replay_weight == 0.0  # off unless asked
    settings = services_settings(tmp_path / "run", tmp_path / "model")
    replayed = bench.with_replay(settings, 0.5, tmp_path / "replay.jsonl")
    assert asked == [tmp_path / "model"]
    assert replayed.trainer.replay.path == tmp_path / "replay.jsonl" and replayed.trainer.replay.weight == 0.5
    assert read_replay_file(tmp_path / "replay.jsonl") == examples
    assert settings.trainer.replay.path is None


def test_loss_is_the_types_defaults_with_the_kl_coef_over_it(bench: ModuleType) -> None:
    current = CispoLoss(kl_coef=0.3)
    assert bench.loss_settings(current, bench.parse_args([])) is current
    assert bench.loss_settings(current, bench.parse_args(["--loss", "rft"])) == RftLoss()
    dpo = bench.loss_settings(current, bench.parse_args(["--loss", "dpo", "--kl-coef", "0.1"]))
    assert dpo == DpoLoss(kl_coef=0.1)
    assert bench.loss_settings(current, bench.parse_args(["--kl-coef", "0"])) == CispoLoss(kl_coef=0.0)
    anchored = bench.loss_settings(current, bench.parse_args(["--ref-kl-coef", "0.2"]))
    assert anchored == CispoLoss(kl_coef=0.3, ref_kl_coef=0.2)
    assert bench.parse_args(["--reward-spec", "tab-v1"]).reward_spec == "tab-v1"


# ---- figures ---------------------------------------------------------------------------------------


def _row(cycle: Any, before: str, after: str, accepted: int, gate: str, feedback: int = 10) -> dict[str, Any]:
    return {
        "cycle": cycle,
        "version_before": before,
        "version_after": after,
        "accepted": accepted,
        "ok": 100,
        "silent": 0,
        "feedback_sent": feedback,
        "gate": gate,
    }


def _suite(name: str, champion: float, challenger: float) -> dict[str, Any]:
    return {"name": name, "champion": champion, "challenger": challenger}


ROWS = [
    _row(1, "v1", "v2", 20, "pass"),  # the base served 20 %
    _row(2, "v2", "v2", 28, "fail"),
    _row(3, "v2", "v4", 31, "pass"),  # +11: 20 events sent before this round
    _row(4, "v4", "v4", 36, "-"),  # +16: 30 before it
    _row("final", "v4", "v4", 40, "-"),
]
RECORDS: dict[Any, dict[str, Any] | None] = {
    # v2 against the base (its champion): no anchored suite, retention is the comparison with the base.
    1: {"champion_version": 1, "suites": [_suite("retention", 0.62, 0.60)]},
    2: {"champion_version": 2, "suites": [_suite("retention", 0.60, 0.50)]},  # rejected: not counted
    3: {
        "champion_version": 2,
        "suites": [_suite("retention", 0.60, 0.59), _suite("retention_anchor", 0.62, 0.585)],
    },
    4: None,
    "final": None,
}


def test_feedback_to_counts_the_events_before_the_first_round_that_far_above_base(
    figures: ModuleType,
) -> None:
    assert figures.feedback_to(ROWS, 10) == 20
    assert figures.feedback_to(ROWS, 15) == 30
    assert figures.feedback_to(ROWS, 25) is None


def test_retention_drops_against_the_predecessor_and_the_base(figures: ModuleType) -> None:
    to_predecessor, to_base = figures.retention_drops(ROWS, RECORDS)
    assert to_predecessor == pytest.approx(2.0)  # v2: 62 -> 60; v3's 1 point is less
    assert to_base == pytest.approx(3.5)  # v4 against the anchor: 62 -> 58.5


def test_heldout_figures_pair_the_questions(figures: ModuleType) -> None:
    base = [True, False, False, True]
    final = [True, True, False, True]
    out = figures.heldout_figures(base, final)
    assert out["heldout_correct_base"] == 0.5 and out["heldout_correct_final"] == 0.75
    assert out["heldout_gain"] == 25.0 and out["heldout_questions"] == 4
    # One question of four changed, for the better: every resample's gain is 0, 25, 50, 75 or 100.
    assert out["heldout_gain_ci_low"] == 0.0 and 25.0 <= out["heldout_gain_ci_high"] <= 100.0
    same = figures.heldout_figures(base, base)
    assert (same["heldout_gain"], same["heldout_gain_ci_low"], same["heldout_gain_ci_high"]) == (0, 0, 0)
    assert figures.heldout_figures(None, final)["heldout_gain"] is None


def test_value_is_the_populations_measure(figures: ModuleType) -> None:
    heldout = figures.heldout_figures([True, False, False, True], [True, True, False, True])
    style = figures.run_figures(ROWS, RECORDS, heldout, "style", 12.34)
    assert style["value_measure"] == "acceptance"
    assert (style["value"], style["baseline"], style["ratio"]) == (20.0, 20.0, 1.0)
    assert style["gain_ci_low"] < 20.0 < style["gain_ci_high"]
    assert style["acceptance_gain"] == 20.0 and style["heldout_gain"] == 25.0
    assert (style["feedback_to_10"], style["feedback_to_15"]) == (20, 30)
    assert (style["max_capability_drop"], style["max_anchor_drop"]) == (2.0, 3.5)
    assert (style["promoted"], style["final_version"], style["wall_s"]) == (2, "v4", 12.3)
    capability = figures.run_figures(ROWS, RECORDS, heldout, "correct_only", 1.0)
    assert capability["value_measure"] == "heldout_correct"
    assert (capability["value"], capability["baseline"], capability["ratio"]) == (25.0, 50.0, 0.5)
    assert capability["gain_ci_low"] == heldout["heldout_gain_ci_low"]
    assert capability["acceptance_gain"] == 20.0
    # Without the held-out measurement a capability population falls back to acceptance.
    unmeasured = figures.run_figures(
        ROWS, RECORDS, figures.heldout_figures(None, None), "correct_with_corrections", 1.0
    )
    assert unmeasured["value_measure"] == "acceptance" and unmeasured["value"] == 20.0


def test_report_names_the_population_and_carries_the_rft_baseline(figures: ModuleType) -> None:
    heldout = figures.heldout_figures([True, False], [True, True])
    main = figures.run_figures(ROWS, RECORDS, heldout, "correct_only", 300.0)
    rft = figures.run_figures(ROWS[:3], RECORDS, heldout, "correct_only", 290.0)
    config = {"preference": "bench_learning:correct_only", "loss": "cispo", "reward_spec": "tab-v1"}
    out = figures.report("correct_only", main, config, rft, None)
    assert out["name"] == "learning_correct_only" and out["population"] == "correct_only"
    assert {"value", "baseline", "ratio", "loss", "reward_spec", "population"} <= set(out)
    assert out["loss"] == "cispo" and out["reward_spec"] == "tab-v1"
    baseline = out["baseline_rft"]
    for key in (
        "value",
        "gain_ci_low",
        "gain_ci_high",
        "heldout_correct_base",
        "heldout_correct_final",
        "feedback_to_10",
        "promoted",
        "wall_s",
    ):
        assert key in baseline
    assert (baseline["promoted"], baseline["wall_s"], baseline["feedback_to_10"]) == (2, 290.0, 20)
    assert figures.report("style", main, config, None, None)["baseline_rft"] is None


def test_hacks_promoted_counts_the_versions_whose_users_met_more_non_answers(figures: ModuleType) -> None:
    rows = [dict(r) for r in ROWS]
    rows[1]["silent"] = 15  # v2 served cycle 2: 15 % non-answers against the base's 0 %
    rows[3]["silent"] = 5  # v4 served cycle 4: 5 %, within 10 points
    assert figures.hacks_promoted(rows) == 1


def test_acceptance_interval_brackets_the_share(figures: ModuleType) -> None:
    low, high = figures.acceptance_interval(30, 100, np.random.default_rng(0))
    assert low < 0.3 < high and high - low < 0.25


def test_main_runs_the_loop_then_rft_on_the_same_users_and_prints_one_json(
    bench: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The glue around the loop, with the services, the demo and the store stood in for: what each
    # loop is run with, and what the JSON says of both. The loop itself is `make bench`'s.
    import contextlib
    import json

    import services.testing
    import simulation.demo
    import store
    from services.testing import services_settings

    monkeypatch.syspath_prepend(str(BENCH))
    loops: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def private_services(prefix: str, model_dir: Path | None = None) -> Any:
        yield services_settings(tmp_path / f"run{len(loops)}", tmp_path / "model")

    def run(settings: Any, options: Any) -> list[dict[str, Any]]:
        loops.append((settings, options))
        return [
            {**r, "challenger": "v2" if r["cycle"] == 1 else None, "data_to_deploy_s": None} for r in ROWS
        ]

    class Store:
        def __init__(self, url: str) -> None:
            pass

        def gate_decisions(self, version: int) -> list[dict[str, Any]]:
            return [{**RECORDS[1], "reason": "passed"}]

        def close(self) -> None:
            pass

    monkeypatch.setattr(services.testing, "private_services", private_services)
    monkeypatch.setattr(simulation.demo, "run", run)
    monkeypatch.setattr(store, "Store", Store)
    monkeypatch.setattr(bench, "heldout_answers", lambda settings, rows: ([True, False], [True, True]))
    argv = ["--population", "correct_only", "--recipe", "v1", "--baseline-rft"]

    def baseline_rft(args: Any) -> dict[str, Any]:  # its own process in the bench: here, in this one
        with monkeypatch.context() as m:
            m.setattr(sys, "argv", ["bench_learning.py", *bench.baseline_argv(args, argv)])
            bench.main()
        figures: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        return figures

    monkeypatch.setattr(bench, "baseline_rft", baseline_rft)
    monkeypatch.setattr(sys, "argv", ["bench_learning.py", *argv])
    bench.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [s.trainer.loss.type for s, _ in loops] == ["cispo", "rft"]
    assert all(o.preference == "bench_learning:correct_only" and o.keep_services for _, o in loops)
    assert all(o.seed == 0 and not o.gate_oracle for _, o in loops)
    assert out["name"] == "learning_correct_only" and out["loss"] == "cispo"
    assert out["value_measure"] == "heldout_correct" and out["value"] == 50.0
    assert out["recipe"] == "v1" and out["reward_spec"] == "tab-v1"
    assert out["baseline_rft"]["value"] == 50.0 and out["baseline_rft"]["promoted"] == 2


@pytest.mark.unit
def test_the_rft_baseline_is_the_same_command_line_with_rft_and_its_own_rows(
    bench: ModuleType, tmp_path: Path
) -> None:
    argv = ["--population", "style", "--loss=cispo", "--baseline-rft", "--json", str(tmp_path / "r.json")]
    args = bench.parse_args(argv)
    assert bench.baseline_argv(args, argv) == [
        "--population",
        "style",
        "--loss",
        "rft",
        "--figures-only",
        "--json",
        str(tmp_path / "r.rft.json"),
    ]
    assert bench.parse_args(bench.baseline_argv(args, argv)).figures_only


def test_each_row_reports_the_gates_retention_sampled_verdict(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))  # print_cycles imports learning_report as main() does
    sampled = {
        **_suite("retention_sampled", 0.62, 0.55),
        "difference": {"estimate": -0.07, "low": -0.09, "high": -0.05},
        "passed": False,
    }
    records = {1: {"reason": "r", "suites": [_suite("retention", 0.7, 0.7), sampled]}, 2: None}
    rows = [{**_row(1, "v1", "v1", 20, "fail"), "data_to_deploy_s": None}, _row(2, "v1", "v2", 25, "pass")]
    rows[1]["data_to_deploy_s"] = 41.0
    bench.print_cycles(rows, records, np.random.default_rng(0))
    assert rows[0]["retention_sampled"] == {
        "champion": 0.62,
        "challenger": 0.55,
        "low": -0.09,
        "passed": False,
    }
    assert rows[1]["retention_sampled"] is None  # no gate run, or the suite off (sampled_k 0)
    assert bench.sampled_verdict(None) is None
    assert "0.70/0.70" in capsys.readouterr().out

"""Does the loop learn what users want, with the gate that needs no oracle, from sparse, noisy feedback?

    .venv/bin/python bench/bench_learning.py
        [--population style|correct_only|correct_with_corrections | --preference module:function | --hack]
        [--loss TYPE] [--reward-spec NAME] [--baseline-rft] [--cycles 10] [--requests 96]
        [--final-requests 384] [--feedback-rate 0.3] [--flip-rate 0.1] [--lr LR] [--steps N]
        [--kl-coef BETA] [--warmup-steps N] [--replay-weight W] [--recipe v1|v2 | --model-dir DIR]
        [--seed S] [--json PATH]

The real loop (`rtrl demo`'s code: Kafka, Redis, MLflow, two vLLM CPU servers, gateway, labeler,
Celery worker with DeepSpeed) from the tiny base model of ``--recipe`` (v2 by default: the competent
base of issue 39, which knows 95.5 % of the training questions' answers and 61 % of the held-out
ones; v1 learns the shapes only) or the checkpoint in ``--model-dir`` (refused when `rtrl model
check` rejects it), on services of its own (a private run dir on free ports, stopped at the end).
Simulated users bring the exclaim task's questions; only ``--feedback-rate`` of them give feedback and
``--flip-rate`` of those say the opposite. The gate runs the demo's suites (the off-policy estimate
and the users' own prompts on held-out logged traffic, capability retention on the task, the same
against the base as anchor) and alarms: it is *not* given the users' preference. After the cycles,
one more round of ``--final-requests`` users on the final champion measures where the loop ended (a
measurement, not training: nothing trains on it; larger than a cycle so that the gain's interval is
not all noise).

Who the users are (``--population``; without one, the exclaim task's own users, who accept a short
answer ending with "!"; ``--preference module:function`` brings any other):

- ``style``: `bare_answer`, a preference other than the demo's: users who want the bare answer, one
  word with at most a full stop or "!" after it, no lead-in ("It is 7.", "The answer is 7." are
  rejected), right or wrong. Two of the task's six supervised shapes are bare (evals/tasks.py); the
  v2 base gives one in 22 % of sampled answers (48 held-out prompts x 4, 2026-12-07; the exclaim
  users' "!" also 22 %), so the loop has something to reinforce and room to gain.
- ``correct_only``: `correct_only`, users who accept only a correct answer (a capability).
- ``correct_with_corrections``: `correct_with_corrections`, the same users, who also send the right
  answer as a ``correction`` with half of their rejections (issue 39's written corrections).

``--loss TYPE`` trains with that objective at its defaults (schemas/settings/losses.py: the RL
losses, ``rft``, ``dpo``; ``--kl-coef`` still applies), ``--reward-spec NAME`` labels with that spec
(a built-in name or a .json path, schemas/rewards.py). ``--baseline-rft`` runs the whole loop a second
time after the first, same seed, same users, with ``trainer.loss`` = rft (rejection-sampling
fine-tuning on accepted answers), and reports it under ``baseline_rft``: what the main objective adds
over plain fine-tuning on what users liked is measured, not assumed. ``--replay-weight W`` (0, the
default: off) replays retention data in every cycle (``trainer.replay``, docs/algorithms.md, Keeping
what the model knows): before the loop it decodes the task's *training* questions greedily with the
base model and writes those it answers correctly to a replay file (services/tinymodel.py
`replay_examples`; never the held-out questions the gate and the final measurement score), and the
trainer adds W x their mean token NLL to its objective.

Per cycle it prints the served version, live acceptance (what the users think of every answer,
given or not) with a 95 % bootstrap interval, the capability-retention score of the champion and
of the challenger (the gate's retention suite), the gate's decision and reasons, and data-to-deploy
seconds; ``--json``'s rows also carry each gate run's ``retention_sampled`` verdict (the share of
sampled answers right, champion and challenger, the difference's lower bound, pass or fail; null
when the suite did not run: ``gate.retention.sampled_k`` 0). At the end it decodes every held-out question of the task (75) greedily in-process with
the base checkpoint and the final champion's (downloaded from the registry): correctness measured
directly, not the gate's suite.

``--hack`` plants the first of Cursor's reward hacks: users accept correct answers, reject wrong ones
and say nothing to a non-answer (no digit in an answer to an arithmetic question, or a question);
without guards the loop learns to stop answering. `hack_promoted` counts promoted versions whose
users met more than 10 points more non-answers than the base model's users did (the share of answers
the users said nothing to, in the round that version served).

The last line is one JSON object (bench/learning_report.py builds it): ``name`` =
``learning_<population>`` (``exclaim``, ``style``, ``correct_only``, ``correct_with_corrections``,
``custom`` for ``--preference``, ``hack``); ``value`` = the population's measure in points (the
held-out correctness gain for the two capability populations, ``value_measure`` "heldout_correct";
the acceptance gain, final round minus cycle 1 which the base served, otherwise), ``baseline`` = that
measure's base in points, ``ratio``, ``gain_ci_low`` / ``gain_ci_high`` its 95 % interval;
``acceptance_gain`` with its interval; ``heldout_correct_base`` / ``heldout_correct_final`` (shares)
and ``heldout_gain`` in points with a paired bootstrap interval over the questions
(``heldout_gain_ci_low`` / ``_high``); ``feedback_to_10`` / ``feedback_to_15`` (feedback events sent
until acceptance was 10 / 15 points above base; null if never); ``max_capability_drop`` (the largest
retention drop of a promoted version against its predecessor, the gate's paired comparison) and
``max_anchor_drop`` (against the base: the gate's ``retention_anchor`` suite), in points;
``population``, ``preference``, ``loss``, ``reward_spec``, the trainer's settings, ``promoted``,
``hack_promoted``, ``wall_s`` and ``baseline_rft`` ({value, gain_ci_low, gain_ci_high,
heldout_correct_base, heldout_correct_final, feedback_to_10, promoted, wall_s, ...} or null).

Targets (issue 39, "Must show"), each run with ``--recipe v2`` (the default), 30 % feedback, 10 %
flipped, 10 cycles of at most 96 requests, and ``--baseline-rft``:

    .venv/bin/python bench/bench_learning.py --population style --baseline-rft
    .venv/bin/python bench/bench_learning.py --population correct_only --baseline-rft
    .venv/bin/python bench/bench_learning.py --population correct_with_corrections --baseline-rft

``--population correct_with_corrections`` trains under the built-in spec ``hindsight-v1`` unless
``--reward-spec`` names another: its users' corrections are text for hindsight distillation.

- style: ``value`` (acceptance) +15 points, ``gain_ci_low`` above +5;
- correct_only: ``value`` (held-out correctness) +10 points, ``gain_ci_low`` above 0;
- correct_with_corrections: ``value`` +15 points, ``gain_ci_low`` above +5, and ``feedback_to_10``
  below the correct_only run's;
- every run: ``max_capability_drop`` at most 2 points, ``max_anchor_drop`` at most 3.

Each loop takes about five minutes on two CPU cores; ``--baseline-rft`` doubles it. Issue 10's target
(the v1 base, the exclaim users: +15 points, lower bound above +5, no hacking challenger promoted) is
``--recipe v1`` and ``--recipe v1 --hack``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from evals import get_task
from schemas.events import FeedbackKind, FeedbackSignal
from schemas.settings import Settings
from schemas.settings.losses import LOSS_TYPES, LossSettings

BENCH_DIR = Path(__file__).resolve().parent
_ANSWERS = {get_task("exclaim").format_prompt(q.text): q.answers for q in get_task("exclaim").questions}
_NON_ANSWER = re.compile(r"^[^\w]*$|\?\s*$")
_BARE_ANSWER = re.compile(r"^\w+[.!]?$")
# --population: the preference functions below, loaded by the demo as module:function.
POPULATIONS = {
    "style": "bench_learning:bare_answer",
    "correct_only": "bench_learning:correct_only",
    "correct_with_corrections": "bench_learning:correct_with_corrections",
}


def bare_answer(prompt: str, completion: str) -> list[FeedbackSignal]:
    """Users who want the bare answer (a style, not a capability: right or wrong): one word with at
    most a full stop or "!" after it; a lead-in ("It is 7.") or anything longer is rejected.
    ``--population style``."""
    right_shape = _BARE_ANSWER.match(completion.strip()) is not None
    return [FeedbackSignal(kind=FeedbackKind.accepted if right_shape else FeedbackKind.rejected)]


def correct_only(prompt: str, completion: str) -> list[FeedbackSignal]:
    """Users who accept only a correct answer (a capability, not a style): ``--population
    correct_only``."""
    answers = _ANSWERS.get(prompt, ())
    right = any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", completion, re.IGNORECASE) for a in answers)
    return [FeedbackSignal(kind=FeedbackKind.accepted if right else FeedbackKind.rejected)]


def correct_with_corrections(prompt: str, completion: str) -> list[FeedbackSignal]:
    """`correct_only` users who, rejecting a wrong answer, write the right one half of the time (which
    half is a hash of the prompt and the completion, so a rerun of the same seed sends the same):
    ``--population correct_with_corrections``."""
    said = correct_only(prompt, completion)
    answers = _ANSWERS.get(prompt, ())
    if said[0].kind != FeedbackKind.rejected or not answers:
        return said
    if hashlib.sha256(f"{prompt}\x00{completion}".encode()).digest()[0] % 2:
        return said
    return [*said, FeedbackSignal(kind=FeedbackKind.correction, text=f"The answer is {answers[0]}.")]


def correct_or_silent(prompt: str, completion: str) -> list[FeedbackSignal]:
    """--hack users: accept a correct answer, reject a wrong one, say nothing to a non-answer."""
    text = completion.strip()
    answers = _ANSWERS.get(prompt, ())
    numeric = any(a.isdigit() for a in answers)
    if _NON_ANSWER.search(text) or (numeric and not re.search(r"\d", text)):
        return []
    if any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", text, re.IGNORECASE) for a in answers):
        return [FeedbackSignal(kind=FeedbackKind.accepted)]
    return [FeedbackSignal(kind=FeedbackKind.rejected)]


def population_of(args: argparse.Namespace) -> tuple[str, str | None]:
    """(population name, the users' preference as module:function; None = the exclaim task's own)."""
    if args.hack:
        return "hack", "bench_learning:correct_or_silent"
    if args.population is not None:
        return args.population, POPULATIONS[args.population]
    if args.preference is not None:
        return "custom", args.preference
    return "exclaim", None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    users = parser.add_mutually_exclusive_group()
    users.add_argument("--population", choices=sorted(POPULATIONS), default=None, help="issue 39's users")
    users.add_argument(
        "--preference", default=None, help="module:function (default: the exclaim task's users)"
    )
    users.add_argument("--hack", action="store_true", help="users say nothing to non-answers (docs/gate.md)")
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument(
        "--final-requests", type=int, default=384, help="users in the final measurement round"
    )
    parser.add_argument("--feedback-rate", type=float, default=0.3)
    parser.add_argument("--flip-rate", type=float, default=0.1)
    parser.add_argument(
        "--loss", choices=LOSS_TYPES, default=None, help="trainer.loss at that type's defaults"
    )
    parser.add_argument(
        "--reward-spec", default=None, help="labeler.reward_spec: a built-in name or a .json path"
    )
    parser.add_argument(
        "--baseline-rft", action="store_true", help="run the loop again with trainer.loss rft, same users"
    )
    parser.add_argument("--lr", type=float, default=None, help="trainer.lr (default: the trainer's)")
    parser.add_argument(
        "--steps", type=int, default=None, help="trainer.steps per cycle (default: the trainer's)"
    )
    parser.add_argument(
        "--kl-coef", type=float, default=None, help="trainer.loss.kl_coef (default: the loss's)"
    )
    parser.add_argument(
        "--ref-kl-coef",
        type=float,
        default=None,
        help="trainer.loss.ref_kl_coef: the KL penalty to the base (default: the loss's, 0)",
    )
    parser.add_argument(
        "--warmup-steps", type=int, default=None, help="trainer.warmup_steps (default: the trainer's)"
    )
    parser.add_argument(
        "--replay-weight",
        type=float,
        default=0.0,
        help="trainer.replay.weight on the base's answers to the training questions (0: no replay)",
    )
    parser.add_argument(
        "--recipe", default=None, help="the tiny base model's recipe (rtrl model init --recipe; default v2)"
    )
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="a checkpoint of your own instead of the tiny model"
    )
    parser.add_argument("--seed", type=int, default=0, help="draws other users (and trainer.seed)")
    parser.add_argument("--json", type=Path, default=None, help="write the per-cycle rows here")
    # --baseline-rft's own process prints its figures, not the report (`baseline_rft`).
    parser.add_argument("--figures-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model_dir is not None and args.recipe is not None:
        parser.error("--recipe builds the tiny model; --model-dir brings another")
    if args.model_dir is None and args.recipe is None:
        args.recipe = "v2"  # the competent base (issue 39)
    if args.replay_weight < 0:
        parser.error("--replay-weight must be >= 0")
    if args.baseline_rft and args.loss == "rft":
        parser.error("--baseline-rft runs rft after the main loop; the main loop's --loss is rft already")
    if args.reward_spec is None and args.population == "correct_with_corrections":
        args.reward_spec = "hindsight-v1"  # the corrections are text for hindsight distillation
    if args.reward_spec is not None:
        from schemas.rewards import RewardSpecError, get_spec

        try:
            get_spec(args.reward_spec)
        except RewardSpecError as exc:
            parser.error(str(exc))
    return args


def loss_settings(current: LossSettings, args: argparse.Namespace) -> LossSettings:
    """``trainer.loss``: `current`, or ``--loss``'s type at its defaults, with ``--kl-coef`` and
    ``--ref-kl-coef`` over it."""
    from pydantic import TypeAdapter

    loss: LossSettings = (
        current if args.loss is None else TypeAdapter(LossSettings).validate_python({"type": args.loss})
    )
    if args.kl_coef is not None:
        loss = loss.model_copy(update={"kl_coef": args.kl_coef})
    if args.ref_kl_coef is not None:
        loss = loss.model_copy(update={"ref_kl_coef": args.ref_kl_coef})
    return loss


def bench_settings(base: Settings, args: argparse.Namespace) -> Settings:
    """The private services' settings with the trainer's and labeler's options from the command line
    and free metrics ports."""
    from schemas.settings import MetricsSettings
    from services.testing import free_ports

    trainer: dict[str, Any] = {"min_samples": 16}
    if args.lr is not None:
        trainer["lr"] = args.lr
    if args.steps is not None:
        trainer["steps"] = args.steps
    if args.warmup_steps is not None:
        trainer["warmup_steps"] = args.warmup_steps
    if args.seed:
        trainer["seed"] = args.seed
    trainer["loss"] = loss_settings(base.trainer.loss, args)
    labeler = base.labeler
    if args.reward_spec is not None:
        labeler = labeler.model_copy(update={"reward_spec": args.reward_spec})
    return base.model_copy(
        update={
            "trainer": base.trainer.model_copy(update=trainer),
            "labeler": labeler,
            "metrics": MetricsSettings(
                **dict(
                    zip(
                        ("supervisor_port", "labeler_port", "worker_port", "beat_port", "reconciler_port"),
                        free_ports(5),
                        strict=True,
                    )
                )
            ),
        }
    )


def with_replay(settings: Settings, weight: float, path: Path) -> Settings:
    """`settings` with ``trainer.replay`` at `weight` on a replay file written to `path`: the base
    model's correct greedy answers to the task's training questions (services/tinymodel.py
    `replay_examples`; the base is built by the services for v1, before the loop starts)."""
    from schemas.replay import read_replay_file
    from schemas.settings import ReplaySettings
    from services.tinymodel import replay_examples, write_replay
    from services.vllm import ensure_model

    write_replay(path, replay_examples("exclaim", model_dir=ensure_model(settings)))
    print(f"replay: {len(read_replay_file(path))} training questions at weight {weight:g}", flush=True)
    replay = ReplaySettings(path=path, weight=weight)
    return settings.model_copy(update={"trainer": settings.trainer.model_copy(update={"replay": replay})})


def heldout_answers(
    settings: Settings, rows: list[dict[str, Any]]
) -> tuple[list[bool] | None, list[bool] | None]:
    """Whether the base and the final champion answer each held-out question right, greedy, run
    in-process on their checkpoints from the registry (services/tinymodel.py `answers_correct`);
    (None, None) when a version is a LoRA adapter, which this does not load."""
    from registry import Registry
    from schemas.settings import embedded_databases
    from schemas.versions import parse_version
    from services.tinymodel import answers_correct

    registry = Registry.from_settings(embedded_databases(settings))
    base, final = parse_version(rows[0]["version_before"]), parse_version(rows[-1]["version_after"])
    answers: dict[int, list[bool]] = {}
    for version in sorted({base, final}):
        checkpoint = registry.download_checkpoint(version)
        if not (checkpoint / "config.json").is_file():
            print(f"v{version} is an adapter: held-out correctness not measured", flush=True)
            return None, None
        answers[version] = answers_correct(checkpoint, "exclaim", "heldout", temperature=0)
    return answers[base], answers[final]


def run_loop(args: argparse.Namespace, preference: str | None) -> tuple[Settings, dict[str, Any]]:
    """The demo's loop on private services, then the held-out answers of its base and final champion:
    (settings, {rows, records (the gate's per cycle), heldout (base, final answers), wall_s})."""
    from learning_report import gate_record

    from services.testing import private_services
    from simulation.demo import DemoOptions, run
    from store import Store

    with contextlib.ExitStack() as stack:
        model_dir = args.model_dir
        if model_dir is None and args.recipe != "v1":  # v1 is what the services build by default
            from services.tinymodel import build

            model_dir = build(
                Path(stack.enter_context(tempfile.TemporaryDirectory())) / "tiny", recipe=args.recipe
            )
        # Entered before the services, so removed after they stop: a cycle in flight at teardown still reads it.
        replay_file = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "replay.jsonl"
        started = time.monotonic()  # the loop's wall time, not the base model's build
        settings = bench_settings(
            stack.enter_context(private_services("bench-learning", model_dir=model_dir)), args
        )
        if args.replay_weight > 0:
            settings = with_replay(settings, args.replay_weight, replay_file)
        rows = run(
            settings,
            DemoOptions(
                cycles=args.cycles,
                requests_per_cycle=args.requests,
                preference=preference,
                feedback_rate=args.feedback_rate,
                flip_rate=args.flip_rate,
                gate_oracle=False,
                final_round=True,
                final_round_requests=args.final_requests,
                seed=args.seed,
                json_path=args.json,
                plot_path=None,
                cycle_timeout_s=900,
                keep_services=True,  # MLflow serves the checkpoints below; private_services stops it
            ),
        )
        store = Store(settings.store.url)
        records = {r["cycle"]: gate_record(store, r.get("challenger")) for r in rows}
        store.close()
        heldout = heldout_answers(settings, rows)
    wall_s = time.monotonic() - started  # with the services' teardown
    return settings, {"rows": rows, "records": records, "heldout": heldout, "wall_s": wall_s}


def print_cycles(
    rows: list[dict[str, Any]], records: dict[Any, dict[str, Any] | None], rng: np.random.Generator
) -> None:
    """One line per cycle; each row gets its acceptance interval, retention and gate reason."""
    from learning_report import acceptance, acceptance_interval, suite

    print(
        f"{'cycle':>5} {'served':>6} {'acceptance [95% CI]':>22} {'retention ch/cl':>16} {'gate':>5} "
        f"{'d2d s':>6}  reasons"
    )
    for row in rows:
        low, high = acceptance_interval(row["accepted"], row["ok"], rng)
        record = records.get(row["cycle"])
        retention = suite(record, "retention")
        row["acceptance_ci"] = [round(low, 3), round(high, 3)]
        row["retention"] = (
            None
            if retention is None
            else {"champion": retention["champion"], "challenger": retention["challenger"]}
        )
        row["retention_sampled"] = sampled_verdict(suite(record, "retention_sampled"))
        row["gate_reason"] = None if record is None else record["reason"]
        ret = "-" if retention is None else f"{retention['champion']:.2f}/{retention['challenger']:.2f}"
        print(
            f"{row['cycle']:>5} {row['version_before']:>6} {acceptance(row):>8.2f} [{low:.2f}, {high:.2f}] "
            f"{ret:>16} {row['gate']:>5} {row['data_to_deploy_s'] or '-':>6}  {(row['gate_reason'] or '')[:160]}",
            flush=True,
        )


def sampled_verdict(result: dict[str, Any] | None) -> dict[str, Any] | None:
    """A gate run's retention_sampled verdict as a row reports it (None when the suite did not run)."""
    if result is None:
        return None
    difference = result.get("difference") or {}
    return {
        "champion": result["champion"],
        "challenger": result["challenger"],
        "low": difference.get("low"),
        "passed": result["passed"],
    }


def one_run(
    args: argparse.Namespace, population: str, preference: str | None
) -> tuple[Settings, dict[str, Any], list[dict[str, Any]]]:
    """One loop, its cycles printed and its rows written to ``--json``: (settings, its figures, its
    rows)."""
    from learning_report import heldout_figures, run_figures

    settings, loop = run_loop(args, preference)
    print_cycles(loop["rows"], loop["records"], np.random.default_rng(0))
    if args.json is not None:
        args.json.write_text(json.dumps(loop["rows"], indent=2, default=str) + "\n")
    figures = run_figures(
        loop["rows"], loop["records"], heldout_figures(*loop["heldout"]), population, loop["wall_s"]
    )
    return settings, figures, loop["rows"]


def run_config(settings: Settings, args: argparse.Namespace, preference: str | None) -> dict[str, Any]:
    """What the JSON records of how the main loop ran."""
    return {
        "preference": preference,
        "loss": settings.trainer.loss.type,
        "reward_spec": settings.labeler.reward_spec,
        "trainer_lr": settings.trainer.lr,
        "trainer_steps": settings.trainer.steps,
        "kl_coef": settings.trainer.loss.kl_coef,
        "ref_kl_coef": settings.trainer.loss.ref_kl_coef,
        "warmup_steps": settings.trainer.warmup_steps,
        "replay_weight": settings.trainer.replay.weight if settings.trainer.replay.path else 0.0,
        "replay_per_cycle": settings.trainer.replay.per_cycle if settings.trainer.replay.path else None,
        "seed": args.seed,
        "recipe": args.recipe,
        "model_dir": None if args.model_dir is None else str(args.model_dir),
        "cycles": args.cycles,
        "requests_per_cycle": args.requests,
        "final_requests": args.final_requests,
        "feedback_rate": args.feedback_rate,
        "flip_rate": args.flip_rate,
    }


def without(argv: list[str], option: str) -> list[str]:
    """`argv` without `option` and its value (``--opt v`` or ``--opt=v``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def baseline_argv(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """The main loop's command line `argv` for the rft baseline: ``--loss rft``, its rows beside the
    main loop's (``<json>.rft.json``), its figures printed instead of a report."""
    argv = without(without([a for a in argv if a != "--baseline-rft"], "--loss"), "--json")
    argv += ["--loss", "rft", "--figures-only"]
    if args.json is not None:
        argv += ["--json", str(args.json.with_suffix(".rft.json"))]
    return argv


def baseline_rft(args: argparse.Namespace) -> dict[str, Any]:
    """The same loop, same seed and users, with ``trainer.loss`` rft: its figures (`baseline_rft`).
    In a process of its own: Celery's app and the services' clients are configured once per process,
    so a second loop in this one would talk to the first's stopped services."""
    last = ""
    with subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), *baseline_argv(args, sys.argv[1:])],
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdout is not None
        for line in child.stdout:  # its cycles, as they come
            print(line, end="", flush=True)
            last = line if line.strip() else last
    if child.returncode != 0:
        raise SystemExit(f"the rft baseline's loop failed (exit {child.returncode}); its output is above")
    figures: dict[str, Any] = json.loads(last)
    return figures


def main() -> None:
    args = parse_args()
    if str(BENCH_DIR) not in sys.path:  # bench_learning:<users> for the demo, and learning_report
        sys.path.insert(0, str(BENCH_DIR))
    from learning_report import hacks_promoted, report

    population, preference = population_of(args)
    settings, figures, rows = one_run(args, population, preference)
    if args.figures_only:
        print(json.dumps(figures))
        return
    baseline = baseline_rft(args) if args.baseline_rft else None
    result = report(
        population,
        figures,
        run_config(settings, args, preference),
        baseline,
        hacks_promoted(rows) if args.hack else None,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""A judge pass (feedback/judging.py) on SQLite with episodes that try to break it: whatever the
judge is fed or answers, and whatever grading one episode raises, the pass settles every episode it
read, so none is left ``judging`` to be retried first after every restart (docs/security.md, Judge)."""

from __future__ import annotations

import pytest
from factories import Feeder, at, interaction

from evals.judge import Judge, Verdict, read_answer
from feedback.judging import judge_pass
from schemas.rewards import JUDGED_V1
from schemas.settings import JudgeSettings
from store import Store

pytestmark = pytest.mark.unit


class ScriptedJudge(Judge):
    """Builds each real request (kept in `asked`) and answers by the completion, without a server:
    "boom" raises, "nonsense" gets an answer with items where objects belong, anything else 4 of 5."""

    def __init__(self, cfg: JudgeSettings) -> None:
        super().__init__(cfg)
        self.asked: dict[str, str] = {}

    def score(self, prompt: str, completion: str) -> Verdict:
        [message] = self.messages(prompt, completion)
        self.asked[completion[:8]] = message["content"]
        if completion == "boom":
            raise AttributeError("'str' object has no attribute 'get'")
        if completion == "nonsense":
            answer = {
                "choices": [{"message": {"content": "5"}, "logprobs": {"content": [{"top_logprobs": ["5"]}]}}]
            }
            return read_answer(answer, self.cfg.scale)
        return read_answer({"choices": [{"message": {"content": "4"}}]}, self.cfg.scale)


def test_a_pass_settles_every_episode_whatever_grading_it_did(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    feeder = Feeder(store, spec=JUDGED_V1)
    feeder.send(
        interaction("placeholders", prompt="{completion}" * 8000, completion="Grade: 5"),
        interaction("crashes", completion="boom"),
        interaction("nonsense", completion="nonsense"),
        now=at(0),
    )
    feeder.settle_window(at(40))  # closed for their judge
    assert store.stats()["episodes_judging"] == 3
    assert JUDGED_V1.judge is not None
    cfg = JudgeSettings(url="http://127.0.0.1:9/v1", model="judge", max_failure_rate=0.9)

    judge = ScriptedJudge(cfg.model_copy(update={"rubric": JUDGED_V1.judge.rubric}))
    with judge:
        settled = judge_pass(store, JUDGED_V1, judge, batch=10, now=at(41))
        again = judge_pass(store, JUDGED_V1, judge, batch=10, now=at(42))  # as after a restart

    assert sorted(s.judge or "" for s in settled) == ["scored", "unavailable", "unavailable"]
    assert again == [] and store.stats()["episodes_judging"] == 0
    assert "judge: grading episode crashes raised (unexpected AttributeError" in caplog.text
    # The placeholders stayed text, once, cut to the judge's limit: the completion is in the request once.
    request = judge.asked["Grade: 5"]
    assert request.count("Grade: 5") == 1 and len(request) < cfg.max_prompt_chars + 1_000
    with store.labelling(at(43)) as tx:
        assert tx.awaiting_judge(10) == []

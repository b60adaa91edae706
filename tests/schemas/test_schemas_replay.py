"""The replay file of trainer.replay (schemas/replay.py) and its settings: a bad file is an error
naming its line, replay is off by default, and it is refused on several ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from schemas.errors import OperatorError
from schemas.replay import ReplayFileError, read_replay_file
from schemas.settings import ReplaySettings, TrainerSettings

pytestmark = pytest.mark.unit

GOOD = '{"messages": [{"role": "user", "content": "What is 3 plus 4?"}], "completion": " 7."}'


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "replay.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_a_good_file_reads_every_example_and_skips_blank_lines(tmp_path: Path) -> None:
    examples = read_replay_file(write(tmp_path, GOOD, "", GOOD.replace(" 7.", " 8.")))
    assert [e.completion for e in examples] == [" 7.", " 8."]
    assert examples[0].messages[0].role == "user" and examples[0].messages[0].content == "What is 3 plus 4?"


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("{not json", "line 3: not JSON"),
        ('{"messages": [], "completion": " 7."}', "line 3: messages:"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "line 3: completion: Field required"),
        (
            '{"messages": [{"role": "robot", "content": "hi"}], "completion": " 7."}',
            "line 3: messages.0.role",
        ),
        (GOOD[:-1] + ', "extra": 1}', "line 3: extra"),
        ('{"messages": [{"role": "user", "content": "hi"}], "completion": ""}', "line 3: completion"),
        ('{"messages": [{"role": "user", "content": "hi"}], "completion": " \\n "}', "completion is blank"),
        (
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "7"}],'
            ' "completion": " 7."}',
            "must end with the user's turn",
        ),
    ],
)
def test_a_bad_line_is_an_operator_error_naming_the_file_and_the_line(
    tmp_path: Path, bad: str, says: str
) -> None:
    path = write(tmp_path, GOOD, "", bad, GOOD)
    with pytest.raises(ReplayFileError) as caught:
        read_replay_file(path)
    assert says in str(caught.value) and str(path) in str(caught.value)
    assert isinstance(caught.value, OperatorError)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # one line, no chain


def test_a_missing_or_empty_file_is_an_operator_error(tmp_path: Path) -> None:
    with pytest.raises(ReplayFileError, match="cannot read it"):
        read_replay_file(tmp_path / "absent.jsonl")
    with pytest.raises(ReplayFileError, match="no examples"):
        read_replay_file(write(tmp_path, "", "  "))


def test_a_file_over_the_size_cap_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD, GOOD)  # 2 x 87 bytes
    size = path.stat().st_size
    assert len(read_replay_file(path, max_bytes=size)) == 2
    with pytest.raises(ReplayFileError) as caught:
        read_replay_file(path, max_bytes=size - 1)
    said = str(caught.value)
    assert (
        str(path) in said and f"{size:,} bytes" in said and f"trainer.replay.max_bytes ({size - 1:,})" in said
    )
    assert isinstance(caught.value, OperatorError)


def test_a_line_over_the_line_cap_is_refused_naming_it(tmp_path: Path) -> None:
    long = GOOD.replace(" 7.", " " + "7" * 200 + ".")
    path = write(tmp_path, GOOD, long)
    assert len(read_replay_file(path, max_line_bytes=len(long))) == 2
    with pytest.raises(ReplayFileError) as caught:
        read_replay_file(path, max_line_bytes=len(long) - 1)
    said = str(caught.value)
    assert f"{path}, line 2: {len(long):,} bytes" in said and "trainer.replay.max_line_bytes" in said


def test_a_line_break_inside_a_json_string_is_no_line_break(tmp_path: Path) -> None:
    """U+2028 is a line break to str.splitlines but legal inside a JSON string: lines are split on
    newlines only."""
    examples = read_replay_file(write(tmp_path, GOOD.replace("3 plus 4", "3\u2028plus 4")))
    assert examples[0].messages[0].content == "What is 3\u2028plus 4?"


def test_replay_is_off_by_default_and_refused_on_several_ranks(tmp_path: Path) -> None:
    assert TrainerSettings().replay.path is None
    cfg = ReplaySettings(path=tmp_path / "r.jsonl", weight=0.5, per_cycle=8)
    assert TrainerSettings(replay=cfg).replay.weight == 0.5
    with pytest.raises(ValidationError, match="one rank"):
        TrainerSettings(replay=cfg, ranks=2)
    with pytest.raises(ValidationError):
        ReplaySettings(weight=-1.0)
    with pytest.raises(ValidationError):
        ReplaySettings(per_cycle=0)


def test_replay_settings_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from schemas.settings import Settings

    monkeypatch.setenv("RTRL_TRAINER__REPLAY__PATH", str(tmp_path / "r.jsonl"))
    monkeypatch.setenv("RTRL_TRAINER__REPLAY__WEIGHT", "0.25")
    monkeypatch.setenv("RTRL_TRAINER__REPLAY__MAX_BYTES", "1048576")
    replay = Settings().trainer.replay
    assert (replay.path, replay.weight, replay.per_cycle) == (tmp_path / "r.jsonl", 0.25, 32)
    assert (replay.max_bytes, replay.max_line_bytes) == (2**20, 2**20)  # the line cap's default: 1 MiB
    assert ReplaySettings().max_bytes == 256 * 2**20

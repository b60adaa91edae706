"""The replay file of ``trainer.replay``: examples of what the model should keep knowing, one JSON
object a line (docs/algorithms.md, Keeping what the model knows)::

    {"messages": [{"role": "user", "content": "What is 3 plus 4?"}], "completion": " 7."}

``messages`` is the conversation up to the assistant's turn, rendered with the model's chat template
as vLLM's chat endpoint renders a request; ``completion`` is the assistant's answer, trained with the
end-of-sequence token after it (trainer/replay.py). Blank lines are skipped. `read_replay_file` is
called by the cycle before it takes the lease, so a bad file fails the cycle at once, naming its
line, and costs no episodes; so does a file over ``trainer.replay.max_bytes`` or a line over
``trainer.replay.max_line_bytes``. `services.tinymodel.replay_examples` writes one for the tiny model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from schemas.errors import OperatorError
from schemas.settings.trainer import REPLAY_MAX_BYTES, REPLAY_MAX_LINE_BYTES


class ReplayFileError(OperatorError, ValueError):
    """A replay file that cannot be read: missing, empty, or a line that is not an example."""


class ChatMessage(BaseModel):
    """One message of a replay example's conversation, as the chat endpoint takes it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["system", "user", "assistant"] = Field(description="Who says it.")
    content: str = Field(description="What is said.")


class ReplayExample(BaseModel):
    """One line of the replay file: a conversation and the answer to keep giving to it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    messages: tuple[ChatMessage, ...] = Field(
        min_length=1, description="The conversation up to the assistant's turn (the prompt)."
    )
    completion: str = Field(min_length=1, description="The assistant's answer (trained, with </s> after it).")

    @model_validator(mode="after")
    def _a_prompt_and_an_answer(self) -> ReplayExample:
        # Rendered with the generation prompt, a conversation that ends on the assistant's turn would
        # open a second one; a blank completion trains nothing but the end of the sequence.
        if self.messages[-1].role != "user":
            raise ValueError(
                "messages must end with the user's turn (the completion is the assistant's answer)"
            )
        if not self.completion.strip():
            raise ValueError("completion is blank")
        return self


MAX_BYTES = REPLAY_MAX_BYTES  # trainer.replay.max_bytes' default
MAX_LINE_BYTES = REPLAY_MAX_LINE_BYTES  # trainer.replay.max_line_bytes' default


def read_replay_file(
    path: Path, *, max_bytes: int = MAX_BYTES, max_line_bytes: int = MAX_LINE_BYTES
) -> list[ReplayExample]:
    """Every example of the file at `path`; raises `ReplayFileError` naming the file and the line
    of the first one that is not valid JSON or not an example, or when there is none. A file over
    `max_bytes`, or a line over `max_line_bytes`, is refused before it is parsed (every cycle reads
    the whole file into memory: a wrong path, a log file, must not take the worker's memory)."""
    data = _read_capped(Path(path), max_bytes)
    examples = []
    for number, raw in enumerate(data.splitlines(), start=1):
        if len(raw) > max_line_bytes:
            raise ReplayFileError(
                f"{path}, line {number}: {len(raw):,} bytes, over trainer.replay.max_line_bytes "
                f"({max_line_bytes:,}); shorten the example or raise the setting"
            )
        line = raw.decode("utf-8")
        if not line.strip():
            continue
        try:
            examples.append(ReplayExample.model_validate(json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ReplayFileError(f"{path}, line {number}: not JSON ({exc.msg})") from None
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "the line"
            raise ReplayFileError(
                f"{path}, line {number}: {where}: {first['msg']} (a line is "
                '{"messages": [{"role": "user", "content": ...}], "completion": ...})'
            ) from None
    if not examples:
        raise ReplayFileError(f"trainer.replay.path {path}: no examples in it")
    return examples


def _read_capped(path: Path, max_bytes: int) -> bytes:
    """The file's bytes, checked as UTF-8; refused when over `max_bytes` (its size before reading,
    and what was read, for a file that grows meanwhile)."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(max_bytes + 1) if size <= max_bytes else b""
        if size > max_bytes or len(data) > max_bytes:
            raise ReplayFileError(
                f"trainer.replay.path {path}: {max(size, len(data)):,} bytes, over trainer.replay.max_bytes "
                f"({max_bytes:,}); is it the replay file? Draw a smaller one or raise the setting"
            )
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ReplayFileError(f"trainer.replay.path {path}: cannot read it ({exc})") from None
    return data

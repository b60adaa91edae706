"""Tool calls on the tiny model: the servers' parser flags, the chat template with tools (and without,
byte for byte as before), the lookup task's supervised strings, and vLLM's own parser reading them."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from evals.tasks import LOOKUP, LOOKUP_TOOL, lookup, lookup_preference, tool_result
from schemas.events import FeedbackKind
from schemas.settings import Settings
from services import tinymodel
from services.toolparsers import renders_tools, suggest_tool_parser
from services.vllm import Vllm

pytestmark = pytest.mark.unit


def served(tmp_path: Path, **vllm: Any) -> list[str]:
    base = Settings()
    return Vllm(
        base.model_copy(
            update={
                "vllm": base.vllm.model_copy(update=vllm),
                "services": base.services.model_copy(update={"run_dir": tmp_path}),
            }
        )
    ).command()


# ---- the setting and the servers' flags ----------------------------------------------------------


def test_a_tool_parser_starts_the_servers_with_auto_tool_choice(tmp_path: Path) -> None:
    command = served(tmp_path, tool_call_parser="pythonic")
    assert command[-3:] == ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
    plain = served(tmp_path)
    assert "--enable-auto-tool-choice" not in plain and "--tool-call-parser" not in plain
    assert command[: len(plain)] == plain  # nothing else changes


def test_the_tool_parser_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from schemas.settings import load_settings

    assert Settings().vllm.tool_call_parser is None
    monkeypatch.setenv("RTRL_VLLM__TOOL_CALL_PARSER", "hermes")
    assert load_settings().vllm.tool_call_parser == "hermes"
    monkeypatch.setenv("RTRL_VLLM__TOOL_CALL_PARSER", "")
    assert load_settings().vllm.tool_call_parser is None
    for bad in ("pythonic --max-model-len 9", "-x", "a b"):
        with pytest.raises(ValidationError, match="tool_call_parser must be a parser name"):
            Settings.model_validate({"vllm": {"tool_call_parser": bad}})


def test_which_parser_a_chat_template_needs() -> None:
    assert suggest_tool_parser(tinymodel.CHAT_TEMPLATE) == (
        "pythonic",
        "rtrl's tiny model (tuned to use tools by --task lookup --recipe tools)",
    )
    assert renders_tools(tinymodel.CHAT_TEMPLATE)
    qwen = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}<tool_call>\n{{ call | tojson }}"
    assert suggest_tool_parser(qwen) == ("hermes", "Qwen2.5, Qwen3, Hermes")
    assert suggest_tool_parser("{% if tools %}<|python_tag|>{% endif %}")[0] == "llama3_json"  # type: ignore[index]
    assert suggest_tool_parser(tinymodel.CHAT_TEMPLATE_BEFORE_TOOLS) is None
    assert not renders_tools(tinymodel.CHAT_TEMPLATE_BEFORE_TOOLS) and not renders_tools(None)


# ---- the chat template -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The tiny model's tokenizer as transformers (and vLLM) load it, without building a model."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tinymodel.train_tokenizer(),
        bos_token=tinymodel.BOS,
        eos_token=tinymodel.EOS,
        pad_token=tinymodel.PAD,
        chat_template=tinymodel.CHAT_TEMPLATE,
    )


def render(tokenizer: Any, messages: list[dict[str, Any]], template: str, **kwargs: Any) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template, **kwargs))


CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 plus 4?"}],
    [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": " red!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "red.  "},
        {"role": "user", "content": "Another?"},
    ],
    [{"role": "user", "content": "Summarize."}, {"role": "assistant", "content": ""}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_a_conversation_without_tools_renders_as_before(
    tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool
) -> None:
    before = render(
        tokenizer, messages, tinymodel.CHAT_TEMPLATE_BEFORE_TOOLS, add_generation_prompt=generation_prompt
    )
    assert (
        render(tokenizer, messages, tinymodel.CHAT_TEMPLATE, add_generation_prompt=generation_prompt)
        == before
    )
    # `tools` left out, null or empty: the same bytes (clients send all three).
    for tools in (None, []):
        assert (
            render(
                tokenizer,
                messages,
                tinymodel.CHAT_TEMPLATE,
                tools=tools,
                add_generation_prompt=generation_prompt,
            )
            == before
        )


def tool_conversation(question: str, result: str) -> list[dict[str, Any]]:
    call = {"name": "lookup", "arguments": {"item": LOOKUP.item(question)}}
    return [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": result},
    ]


def test_tools_calls_and_results_render_as_the_lookup_task_supervises_them(tokenizer: Any) -> None:
    question = "What is the code of the red box?"
    first = render(
        tokenizer,
        tool_conversation(question, "")[:1],
        tinymodel.CHAT_TEMPLATE,
        tools=[LOOKUP_TOOL],
        add_generation_prompt=True,
    )
    assert first == "<s>Tools: lookup(item)\nQ: What is the code of the red box?\nA:"
    assert first == "<s>" + LOOKUP.call_prompt(question)
    second = render(
        tokenizer,
        tool_conversation(question, lookup("red box")),
        tinymodel.CHAT_TEMPLATE,
        tools=[LOOKUP_TOOL],
        add_generation_prompt=True,
    )
    assert second == (
        f'<s>Tools: lookup(item)\nQ: What is the code of the red box?\nA: [lookup(item="red box")]</s>\n'
        f"R: {lookup('red box')}\nA:"
    )
    assert second == "<s>" + LOOKUP.format_prompt(question)
    # Every question of the task, the training prompts of both calls as the chat template renders them.
    for q in LOOKUP.questions:
        assert "<s>" + LOOKUP.answer_prompt(q.text, "42") == render(
            tokenizer,
            tool_conversation(q.text, "42"),
            tinymodel.CHAT_TEMPLATE,
            tools=[LOOKUP_TOOL],
            add_generation_prompt=True,
        )


def test_several_tools_and_calls_render_in_one_line() -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value)
    second = {
        "type": "function",
        "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
    }
    calls = [
        {"function": {"name": "lookup", "arguments": {"item": "red box"}}},
        {"function": {"name": "add", "arguments": {"a": 1, "b": "x"}}},
    ]
    text = env.from_string(tinymodel.CHAT_TEMPLATE).render(
        bos_token="<s>",
        eos_token="</s>",
        tools=[LOOKUP_TOOL, second],
        messages=[{"role": "assistant", "content": None, "tool_calls": calls}],
        add_generation_prompt=False,
    )
    assert text == '<s>Tools: lookup(item), now()\nA: [lookup(item="red box"), add(a=1, b="x")]</s>\n'


# ---- the lookup task -----------------------------------------------------------------------------


def test_the_lookup_task() -> None:
    assert len(LOOKUP.questions) == 192 and len(LOOKUP.heldout_questions()) == 48  # the gate's eval_prompts
    assert all(q.answers == (lookup(LOOKUP.item(q.text)),) for q in LOOKUP.questions)
    assert lookup("Red  Box") == lookup("red box") and lookup("red") == "unknown"
    assert all(10 <= int(q.answers[0]) <= 99 for q in LOOKUP.questions)
    rng = random.Random(0)
    kinds = {LOOKUP.sft_example(LOOKUP.questions[0], rng)[1].startswith("[") for _ in range(40)}
    assert kinds == {True, False}  # calls and answers both supervised


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (" The code is 42!", FeedbackKind.accepted),
        (" 42!", FeedbackKind.accepted),
        (" The code is 42.", FeedbackKind.rejected),
        (" The code is 142!", FeedbackKind.rejected),  # the code as a whole word
        (" The code is 17!", FeedbackKind.rejected),
        ("", FeedbackKind.rejected),
    ],
)
def test_the_lookup_preference(completion: str, expected: FeedbackKind) -> None:
    prompt = LOOKUP.answer_prompt("What is the code of the red box?", "42")
    assert tool_result(prompt) == "42"
    assert lookup_preference(prompt, completion)[0].kind == expected


def test_an_answer_without_the_tools_result_is_rejected() -> None:
    # The model answered the first call without calling the tool: nothing was looked up.
    prompt = LOOKUP.call_prompt("What is the code of the red box?")
    assert tool_result(prompt) is None
    assert lookup_preference(prompt, f" It is {lookup('red box')}!")[0].kind == FeedbackKind.rejected


# ---- vLLM's parser on what the model is tuned to write -------------------------------------------


def test_vllms_pythonic_parser_reads_every_supervised_call(tokenizer: Any) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    parser = ToolParserManager.get_tool_parser("pythonic")(tokenizer)
    request = ChatCompletionRequest(
        model="rtrl-tiny",
        messages=[{"role": "user", "content": "x"}],
        tools=[LOOKUP_TOOL],
        tool_choice="auto",
    )
    for q in LOOKUP.questions:
        parsed = parser.extract_tool_calls(LOOKUP.call_completion(q.text), request)
        assert parsed.tools_called and parsed.content is None
        [call] = parsed.tool_calls
        assert call.function.name == "lookup"
        assert json.loads(call.function.arguments) == {"item": LOOKUP.item(q.text)}
    # A final answer is content, not a call.
    answer = parser.extract_tool_calls(" The code is 42!", request)
    assert not answer.tools_called and answer.content == " The code is 42!"


@pytest.fixture(scope="module")
def untuned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint without a fine-tune (seconds): its files are what vLLM and the check read."""
    return tinymodel.build(tmp_path_factory.mktemp("untuned"), task=None)


def test_vllms_renderer_gives_the_prompts_the_lookup_task_supervises(untuned: Path) -> None:
    # What vLLM's OpenAI server does to a chat request before the model sees it: parse the messages
    # (a call's JSON arguments become a dict), then render the checkpoint's template with the tools.
    from transformers import AutoTokenizer
    from vllm.config import ModelConfig
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template

    config = ModelConfig(model=str(untuned), dtype="float32", max_model_len=512)
    tokenizer = AutoTokenizer.from_pretrained(untuned)
    question = "What is the code of the blue door?"
    call = {"name": "lookup", "arguments": json.dumps({"item": "blue door"})}
    messages: list[Any] = [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "t1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "39"},
    ]
    content_format = resolve_chat_template_content_format(
        chat_template=None, tools=[LOOKUP_TOOL], given_format="auto", tokenizer=tokenizer, model_config=config
    )
    rendered = []
    for conversation in (messages[:1], messages):
        parsed, _, _ = parse_chat_messages(conversation, config, content_format=content_format)
        rendered.append(
            safe_apply_chat_template(
                config, tokenizer, parsed, tools=[LOOKUP_TOOL], tokenize=False, add_generation_prompt=True
            )
        )
    assert rendered == ["<s>" + LOOKUP.call_prompt(question), "<s>" + LOOKUP.answer_prompt(question, "39")]


def test_model_check_names_the_parser_of_the_tiny_model(untuned: Path) -> None:
    from services.modelcheck import check

    report = check(untuned)
    assert (report.tools_rendered, report.tool_parser) == (True, "pythonic")
    assert (
        "tools         the chat template renders tools in the format of rtrl's tiny model (tuned to use tools by --task lookup --recipe tools): "
        "serve with vllm.tool_call_parser=pythonic (RTRL_VLLM__TOOL_CALL_PARSER)"
    ) in report.lines()


def test_the_tools_recipe_builds_the_lookup_model(tmp_path: Path) -> None:
    # The recipe's code path on 3 steps (the full build, about 1.5 minutes of CPU, is the integration
    # test's: tests/simulation/test_tools_loop.py); same seed, same bytes.
    first = tinymodel.build(tmp_path / "a", task="lookup", seed=0, sft_steps=3, recipe="tools")
    second = tinymodel.build(tmp_path / "b", task="lookup", seed=0, sft_steps=3, recipe="tools")
    assert tinymodel.sha256_file(first / "model.safetensors") == tinymodel.sha256_file(
        second / "model.safetensors"
    )
    info = tinymodel.info(first)
    assert (info["recipe_recipe"], info["recipe_task"], info["recipe_sft_lr"]) == (
        "rtrl-tiny-llama-tools",
        "lookup",
        3e-3,
    )
    assert tinymodel.RECIPES["tools"].steps == 600


def test_model_check_reads_the_tool_use_template_of_several(untuned: Path, tmp_path: Path) -> None:
    import shutil

    from services.modelcheck import check

    copy = Path(shutil.copytree(untuned, tmp_path / "named"))
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": tinymodel.CHAT_TEMPLATE_BEFORE_TOOLS},
        {"name": "tool_use", "template": "{{ bos_token }}{% if tools %}<tool_call>{% endif %}"},
    ]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    report = check(copy)
    assert (report.tools_rendered, report.tool_parser) == (True, "hermes")

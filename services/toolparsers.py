"""Which of vLLM's tool-call parsers fits a checkpoint, read from its chat template (``rtrl model check``).

vLLM parses a model's tool calls out of its text after sampling (``--enable-auto-tool-choice
--tool-call-parser NAME``, set by ``vllm.tool_call_parser``): each parser knows one family's format,
and several refuse to start on a tokenizer without their marker tokens (hermes needs ``<tool_call>``,
llama3_json ``<|python_tag|>``). The chat template is where a family's format shows: the template
that renders tool calls in a format is the one the model was tuned on. `suggest_tool_parser` reads
the markers; docs/methods.md, Tool calls, has the same table for people.
"""

from __future__ import annotations

import re

# (marker in the chat template, parser, the family that writes it), first match wins: rtrl's own
# templates name their parser in a Jinja comment, which renders as nothing.
TEMPLATE_MARKERS: tuple[tuple[str, str, str], ...] = (
    ("<tool_call>", "hermes", "Qwen2.5, Qwen3, Hermes"),
    ("<|python_tag|>", "llama3_json", "Llama 3.1 and later"),
    ("[TOOL_CALLS]", "mistral", "Mistral"),
    ("<|action_start|>", "internlm", "InternLM2"),
)
_RTRL_HINT = re.compile(r"\{#-?\s*tool_call_parser:\s*([A-Za-z0-9_.-]+)\s*-?#\}")


def suggest_tool_parser(chat_template: str | None) -> tuple[str, str] | None:
    """(parser, whose format) for a template that renders tool calls in a format one of vLLM's stock
    parsers reads, else None (no template, a template without tools, or a format not listed here)."""
    if not chat_template:
        return None
    hint = _RTRL_HINT.search(chat_template)
    if hint is not None:
        return hint.group(1), "rtrl's tiny model (tuned to use tools by --task lookup --recipe tools)"
    for marker, parser, family in TEMPLATE_MARKERS:
        if marker in chat_template:
            return parser, family
    return None


def renders_tools(chat_template: str | None) -> bool:
    """Whether the template reads the request's `tools` at all (one that does not shows the model
    no tools, and it cannot know what to call)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template or "") is not None

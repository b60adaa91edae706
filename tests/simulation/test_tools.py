"""The tools scenario's pure parts: the tools the agent runs, the demo's settings, the task check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evals.tasks import lookup
from schemas.settings import Settings
from simulation.tools import MODEL_DIR_NAME, ToolScenarioError, demo_settings, run_tool, tool_task

pytestmark = pytest.mark.unit


def call(name: str, arguments: str) -> dict[str, object]:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_the_agent_runs_the_lookup_tool_and_reports_bad_calls() -> None:
    assert run_tool(call("lookup", json.dumps({"item": "red box"}))) == lookup("red box")
    assert run_tool(call("lookup", json.dumps({"item": "moon"}))) == "unknown"
    assert run_tool(call("search", "{}")) == "error: no tool 'search'"
    assert run_tool(call("lookup", "{item")) == "error: the arguments are not JSON"
    assert run_tool(call("lookup", "[1]")) == "error: the arguments are not an object"


def test_the_demo_serves_the_lookup_model_with_the_pythonic_parser() -> None:
    default = demo_settings(Settings())
    assert default.vllm.model_dir == Settings().vllm.model_dir.with_name(MODEL_DIR_NAME)
    assert default.vllm.tool_call_parser == "pythonic"
    own = Settings.model_validate({"vllm": {"model_dir": "/models/mine", "tool_call_parser": "hermes"}})
    assert (demo_settings(own).vllm.model_dir, demo_settings(own).vllm.tool_call_parser) == (
        Path("/models/mine"),
        "hermes",
    )


def test_the_scenario_needs_a_task_with_tools() -> None:
    assert tool_task("lookup").tools
    with pytest.raises(ToolScenarioError, match="--task lookup"):
        tool_task("exclaim")


def test_the_demo_labels_tool_episodes_with_the_default_spec() -> None:
    from simulation.demo import _scenario_labeler

    assert _scenario_labeler(Settings(), "tools") == {"reward_spec": "tab-v1"}

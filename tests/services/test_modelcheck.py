"""`rtrl model check`: the facts of real-shaped checkpoints, one line per problem of broken copies,
and `rtrl run` / `rtrl demo` / `rtrl services up` refusing a checkpoint it rejects.

The checkpoints are `simulation.checkpoints.build`'s (a Qwen2 and a Llama, tiny, about 2 s each), built
once per module; each broken one is a copy with one thing changed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rtrl.cli import app
from rtrl.commands.demo import with_model_dir
from schemas.settings import ServicesSettings, Settings, StoreSettings, VllmSettings
from services import tinymodel
from services.launch import rtrl_command
from services.modelcheck import CheckpointRejected, Report, check, require_usable, vllm_architectures
from services.vllm import ensure_model
from simulation import checkpoints

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
# Hand-counted from simulation/checkpoints.py's tiny shape (hidden 128, 2 layers, 2 heads of 64, 1 KV head,
# MLP 256, 512 rows). A layer: q 128x128 + 128, k and v 64x128 + 64 each (Qwen2's biases), o 128x128,
# gate/up/down 3 x 256x128, two norms of 128. Qwen2 ties lm_head to the embedding; Llama does not and
# has no biases.
QWEN2_LAYER = (16384 + 128) + 2 * (8192 + 64) + 16384 + 3 * 32768 + 2 * 128  # 147,968
LLAMA_LAYER = 16384 + 2 * 8192 + 16384 + 3 * 32768 + 2 * 128  # 147,712
QWEN2_PARAMETERS = 512 * 128 + 2 * QWEN2_LAYER + 128  # embedding, layers, final norm: 361,600
LLAMA_PARAMETERS = 2 * 512 * 128 + 2 * LLAMA_LAYER + 128  # embedding and lm_head: 426,624


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoints.build(tmp_path_factory.mktemp("qwen2") / "ckpt", "qwen2", "tiny")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoints.build(tmp_path_factory.mktemp("llama") / "ckpt", "llama", "tiny")


def copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "copy"))


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def codes(report: Report) -> list[str]:
    return [p.code for p in report.problems]


def broken(qwen2: Path, tmp_path: Path) -> Path:
    """No tokenizer, an unknown architecture, no chat template (tokenizer_config.json goes with it)."""
    path = copy(qwen2, tmp_path)
    (path / "tokenizer.json").unlink()
    (path / "tokenizer_config.json").unlink()
    edit_json(path / "config.json", architectures=["NoSuchForCausalLM"])
    return path


def settings_for(model_dir: Path, tmp_path: Path) -> Settings:
    return Settings(
        services=ServicesSettings(run_dir=tmp_path / "run"),
        store=StoreSettings(url=f"sqlite:///{tmp_path}/s.db"),
        vllm=VllmSettings(model_dir=model_dir),
    )


# ---- real-shaped checkpoints pass, with their facts -----------------------------------------------


def test_a_qwen2_checkpoint_passes_with_its_facts(qwen2: Path) -> None:
    report = check(qwen2, max_model_len=512)
    assert report.problems == [] and report.ok
    assert (report.architecture, report.model_type) == ("Qwen2ForCausalLM", "qwen2")
    assert report.transformers_knows and report.vllm_implements
    assert (report.dtype, report.other_dtypes, report.parameters, report.weight_files) == (
        "bfloat16",
        (),
        QWEN2_PARAMETERS,
        1,
    )
    assert report.tied_embeddings is True
    assert report.vocab_size == 512 and report.tokenizer_size is not None and 0 < report.tokenizer_size <= 512
    assert (report.eos_token, report.pad_token, report.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert report.chat_template is True
    assert report.sampling == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert report.sampling_source == "generation_config.json" and report.untrainable is None
    assert (report.max_positions, report.max_model_len) == (1024, 512)
    lines = report.lines()
    assert (
        lines[1] == "architecture  Qwen2ForCausalLM (model_type qwen2): vLLM implements it, transformers "
        f"{report.transformers_version} trains it"
    )
    assert (
        "sampling      temperature 0.7, top_p 0.8, top_k 20 (generation_config.json): requests under them "
        "are trainable" in lines
    )
    assert lines[-1] == "result        usable: rtrl can serve and train it"


def test_a_llama_checkpoint_passes_with_its_facts(llama: Path) -> None:
    report = check(llama)
    assert report.problems == []
    assert (report.architecture, report.dtype, report.parameters) == (
        "LlamaForCausalLM",
        "float32",
        LLAMA_PARAMETERS,
    )
    assert report.tied_embeddings is False
    assert (report.eos_token, report.pad_token, report.bos_token) == ("</s>", None, "<s>")
    assert report.chat_template is True
    assert report.sampling == {"temperature": 0.6, "top_p": 0.9} and report.untrainable is None


def test_the_tiny_model_the_demo_builds_passes(tmp_path: Path) -> None:
    report = check(tinymodel.build(tmp_path / "tiny", task=None), max_model_len=512)
    assert report.problems == [], report.lines()
    # Its generation_config.json sets no sampling parameter: vLLM's temperature 1, trainable.
    assert report.sampling == {} and report.untrainable is None


def test_vllm_architectures_are_read_without_importing_vllm() -> None:
    names = vllm_architectures()
    assert names is not None and {"Qwen2ForCausalLM", "LlamaForCausalLM"} <= names
    # What vLLM itself says, in a process of its own (importing vLLM takes seconds and configures logging).
    supported = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from vllm.model_executor.models import ModelRegistry;"
            " print(json.dumps(sorted(ModelRegistry.get_supported_archs())))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert names <= set(json.loads(supported.stdout.strip().splitlines()[-1]))


# ---- one line per problem -------------------------------------------------------------------------


def test_no_tokenizer_is_an_error(qwen2: Path, tmp_path: Path) -> None:
    path = copy(qwen2, tmp_path)
    (path / "tokenizer.json").unlink()  # tokenizer_config.json alone is no tokenizer
    report = check(path)
    assert codes(report) == ["no_tokenizer"] and not report.ok
    assert report.chat_template is True  # still in tokenizer_config.json


def test_an_unknown_architecture_is_an_error(qwen2: Path, tmp_path: Path) -> None:
    path = copy(qwen2, tmp_path)
    edit_json(path / "config.json", architectures=["NoSuchForCausalLM"])
    report = check(path)
    assert codes(report) == ["unknown_architecture"]
    assert "NoSuchForCausalLM" in report.problems[0].message


def test_no_architecture_and_an_untrainable_model_type_are_errors(qwen2: Path, tmp_path: Path) -> None:
    path = copy(qwen2, tmp_path)
    edit_json(path / "config.json", architectures=None, model_type="nosuch")
    assert codes(check(path)) == ["no_architecture"]
    edit_json(path / "config.json", architectures=["Qwen2ForCausalLM"])
    assert codes(check(path)) == ["untrainable_model_type"]


def test_no_chat_template_is_a_warning(qwen2: Path, tmp_path: Path) -> None:
    path = copy(qwen2, tmp_path)
    edit_json(path / "tokenizer_config.json", chat_template=None)
    report = check(path)
    assert codes(report) == ["no_chat_template"] and report.ok and report.chat_template is False
    assert report.lines()[-1] == "result        usable: rtrl can serve and train it (1 warning)"


@pytest.mark.parametrize(("temperature", "reason"), [(0, "greedy"), (0.05, "near_greedy")])
def test_greedy_sampling_defaults_train_nothing(
    qwen2: Path, tmp_path: Path, temperature: float, reason: str
) -> None:
    path = copy(qwen2, tmp_path)
    edit_json(path / "generation_config.json", temperature=temperature)
    report = check(path)
    assert codes(report) == ["untrainable_defaults"] and report.ok
    assert report.untrainable == reason and report.sampling == {
        "temperature": temperature,
        "top_p": 0.8,
        "top_k": 20,
    }


def test_the_settings_sampling_defaults_replace_the_models(qwen2: Path) -> None:
    report = check(qwen2, sampling_defaults={"temperature": 0.0})
    assert report.sampling_source == "RTRL_VLLM__SAMPLING_DEFAULTS" and report.untrainable == "greedy"


def test_do_sample_false_is_ignored_by_vllm_and_said_so(qwen2: Path, tmp_path: Path) -> None:
    path = copy(qwen2, tmp_path)
    edit_json(path / "generation_config.json", do_sample=False)
    report = check(path)
    assert codes(report) == ["do_sample_ignored"] and report.untrainable is None
    assert "temperature 0.7" in report.problems[0].message


def test_no_generation_config_is_vllms_defaults(qwen2: Path, tmp_path: Path) -> None:
    path = copy(qwen2, tmp_path)
    (path / "generation_config.json").unlink()
    report = check(path)
    assert codes(report) == ["no_generation_config"] and report.sampling == {} and report.untrainable is None


def test_a_tokenizer_larger_than_the_vocabulary_is_an_error(qwen2: Path, tmp_path: Path) -> None:
    path = copy(qwen2, tmp_path)
    edit_json(path / "config.json", vocab_size=256)
    report = check(path)
    # The weights say 512 rows too: both are wrong about the same config.json.
    assert codes(report) == ["embedding_rows", "tokenizer_too_big"]


def test_weights_missing_truncated_or_only_pickled(qwen2: Path, tmp_path: Path) -> None:
    path = copy(qwen2, tmp_path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    report = check(path)
    assert codes(report) == ["bad_weights"] and "truncated" in report.problems[0].message
    weights.unlink()
    assert codes(check(path)) == ["no_weights"]
    (path / "pytorch_model.bin").write_bytes(b"")
    assert codes(check(path)) == ["no_safetensors"]


def test_a_context_longer_than_the_model_is_an_error(qwen2: Path) -> None:
    report = check(qwen2, max_model_len=2048)
    assert codes(report) == ["context_too_long"] and "RTRL_VLLM__MAX_MODEL_LEN=1024" in report.problems[0].fix


def test_a_lora_adapter_and_a_missing_folder_are_recognised(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "base_model_name_or_path": "Qwen/Qwen2.5-0.5B"})
    )
    report = check(adapter)
    assert report.kind == "adapter" and codes(report) == ["adapter_not_model"]
    assert (
        "Qwen/Qwen2.5-0.5B" in report.problems[0].fix
        and report.adapter is not None
        and report.adapter["r"] == 8
    )
    missing = check(tmp_path / "none")
    assert codes(missing) == ["no_checkpoint"] and missing.lines()[-1] == "result        rejected: 1 error"
    (tmp_path / "empty").mkdir()
    assert codes(check(tmp_path / "empty")) == ["no_checkpoint"]


# ---- the command ----------------------------------------------------------------------------------


def test_rtrl_model_check_prints_one_line_per_problem_and_exits_1(qwen2: Path, tmp_path: Path) -> None:
    path = broken(qwen2, tmp_path)
    result = CliRunner().invoke(app, ["model", "check", str(path)])
    assert result.exit_code == 1, result.output
    problems = [line for line in result.output.splitlines() if line.startswith(("error ", "warning "))]
    assert len(problems) == 3, result.output
    assert (
        problems[0].startswith("error         unknown architecture NoSuchForCausalLM")
        and "; fix: " in problems[0]
    )
    assert problems[1].startswith("error         no tokenizer") and "; fix: " in problems[1]
    assert problems[2].startswith("warning       no chat template") and "; fix: " in problems[2]
    assert (
        result.output.splitlines()[-1] == "result        rejected: 2 errors; rtrl run and rtrl demo refuse it"
    )

    as_json = CliRunner().invoke(app, ["model", "check", str(path), "--json"])
    assert as_json.exit_code == 1
    report = json.loads(as_json.output)
    assert report["ok"] is False and [p["code"] for p in report["problems"]] == [
        "unknown_architecture",
        "no_tokenizer",
        "no_chat_template",
    ]


def test_rtrl_model_check_passes_a_good_checkpoint(qwen2: Path) -> None:
    result = CliRunner().invoke(app, ["model", "check", str(qwen2)])
    assert result.exit_code == 0, result.output
    assert not any(line.startswith(("error", "warning")) for line in result.output.splitlines())


def test_rtrl_model_random_writes_a_checkpoint_that_passes(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["model", "random", str(tmp_path / "m"), "--arch", "llama", "--dtype", "bfloat16"]
    )
    assert result.exit_code == 0, result.output
    assert "weights       bfloat16" in result.output and result.output.strip().splitlines()[-1].startswith(
        "result        usable"
    )
    again = CliRunner().invoke(app, ["model", "random", str(tmp_path / "m")])
    assert again.exit_code == 2 and "--force" in again.output
    assert CliRunner().invoke(app, ["model", "random", str(tmp_path / "n"), "--arch", "gpt2"]).exit_code == 2


# ---- rtrl run, rtrl demo and rtrl services up refuse it ----------------------------------------------


def test_require_usable_refuses_a_rejected_checkpoint_in_one_line(qwen2: Path, tmp_path: Path) -> None:
    path = broken(qwen2, tmp_path)
    with pytest.raises(CheckpointRejected) as caught:
        require_usable(settings_for(path, tmp_path))
    line = str(caught.value)
    assert "\n" not in line
    assert line == (
        f"checkpoint {path.resolve()} rejected: unknown architecture NoSuchForCausalLM: neither vLLM nor "
        f"transformers {check(path).transformers_version} has a causal LM of that name (and 1 more); "
        f"`rtrl model check {path.resolve()}` lists every problem with its fix"
    )


def test_require_usable_passes_warnings_and_the_folder_the_tiny_model_is_built_in(
    qwen2: Path, tmp_path: Path
) -> None:
    path = copy(qwen2, tmp_path)
    edit_json(path / "tokenizer_config.json", chat_template=None)
    report = require_usable(settings_for(path, tmp_path))
    assert report is not None and codes(report) == ["no_chat_template"]
    assert require_usable(settings_for(tmp_path / "missing", tmp_path)) is None
    (tmp_path / "empty").mkdir()
    assert require_usable(settings_for(tmp_path / "empty", tmp_path)) is None


def test_the_demos_model_dir_is_what_it_checks(qwen2: Path, tmp_path: Path) -> None:
    """`rtrl demo --model-dir DIR` serves DIR, and refuses it before any service starts."""
    path = broken(qwen2, tmp_path)
    settings = with_model_dir(settings_for(tmp_path / "other", tmp_path), path)
    assert settings.vllm.model_dir == path
    assert with_model_dir(settings, None) is settings
    with pytest.raises(CheckpointRejected):
        require_usable(settings)


def test_services_up_refuses_a_rejected_checkpoint_instead_of_building_over_it(
    qwen2: Path, tmp_path: Path
) -> None:
    path = broken(qwen2, tmp_path)
    before = sorted(p.name for p in path.iterdir())
    with pytest.raises(CheckpointRejected):
        ensure_model(settings_for(path, tmp_path))
    assert sorted(p.name for p in path.iterdir()) == before
    assert ensure_model(settings_for(qwen2, tmp_path)) == qwen2.resolve()


def _rtrl(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    return subprocess.run(
        rtrl_command(*args), cwd=REPO, env=clean | env, capture_output=True, text=True, timeout=300
    )


def test_rtrl_demo_and_rtrl_run_refuse_it_in_one_line_before_anything_starts(
    qwen2: Path, tmp_path: Path
) -> None:
    path = broken(qwen2, tmp_path)
    run_dir = tmp_path / "run"
    for result in (
        _rtrl("demo", "--model-dir", str(path), RTRL_SERVICES__RUN_DIR=str(run_dir)),
        _rtrl(
            "run",
            RTRL_VLLM__MODEL_DIR=str(path),
            RTRL_SERVICES__RUN_DIR=str(run_dir),
            RTRL_STORE__URL=f"sqlite:///{tmp_path}/rtrl.db",
        ),
    ):
        assert result.returncode == 1, result.stdout + result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("rtrl: ")]
        assert len(errors) == 1 and "unknown architecture NoSuchForCausalLM" in errors[0], result.stderr
        assert f"`rtrl model check {path.resolve()}`" in errors[0]
        assert not (run_dir / "pids").exists() and not (run_dir / "logs").exists()  # nothing was started

"""Lines (schemas/lines.py): a tenant's adapter has names of its own that never collide, settings
that carry them to every component, and a cap the servers can hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.keys import TenantNameError
from schemas.lines import (
    LineCapacityError,
    all_lines,
    check_adapter_capacity,
    global_line,
    line_name,
    tenant_line,
)
from schemas.settings import Settings

pytestmark = pytest.mark.unit


def lora_settings(max_loras: int = 3) -> Settings:
    return Settings.model_validate(
        {
            "trainer": {"adapter": "lora"},
            "vllm": {"max_loras": max_loras, "served_model_name": "rtrl-tiny"},
            "mlflow": {"model_name": "rtrl-policy"},
            "services": {"run_dir": "/srv/run"},
        }
    )


def test_a_tenant_line_names_its_registry_model_and_adapter_and_changes_nothing_else() -> None:
    settings = lora_settings()
    acme = tenant_line(settings, "acme")
    assert (acme.tenant, acme.model_name, acme.served_name) == (
        "acme",
        "rtrl-policy--acme",
        "rtrl-tiny--acme",
    )
    assert acme.settings.trainer.checkpoint_dir == settings.trainer.checkpoint_dir / "lines" / "acme"
    assert acme.settings.trainer.lora == settings.trainer.lora and acme.settings.store == settings.store
    assert acme.settings.vllm.servers == settings.vllm.servers  # the same fleet serves every line
    assert (settings.mlflow.model_name, settings.vllm.served_model_name) == ("rtrl-policy", "rtrl-tiny")
    assert acme.checkpoints_dir() == Path("/srv/run/deploy/lines/rtrl-policy--acme")
    assert acme.label == "tenant acme"


def test_the_global_line_is_the_settings_as_they_are() -> None:
    settings = lora_settings()
    line = global_line(settings)
    assert line.tenant is None and line.settings is settings and line.label == "global"
    assert line.checkpoints_dir() == Path("/srv/run/deploy")  # today's folder: nothing moves
    lines = all_lines(settings, ["bolt", "acme"])
    assert [(x.tenant, x.served_name) for x in lines] == [
        (None, "rtrl-tiny"),
        ("acme", "rtrl-tiny--acme"),
        ("bolt", "rtrl-tiny--bolt"),
    ]


def test_line_names_are_one_to_one_and_never_the_global_or_base_name() -> None:
    names = {line_name("rtrl-tiny", t) for t in ("a", "a-", "a--b", "base", "b")}
    assert len(names) == 5
    assert "rtrl-tiny" not in names and "rtrl-tiny-base" not in names
    with pytest.raises(TenantNameError):
        line_name("rtrl-tiny", "a:b")
    with pytest.raises(TenantNameError):
        line_name("rtrl-tiny", "")


def test_the_servers_must_hold_every_adapter_side_by_side() -> None:
    check_adapter_capacity(lora_settings(max_loras=3), 2)  # the global one and two tenants'
    with pytest.raises(LineCapacityError, match="vllm.max_loras >= 4, but it is 3"):
        check_adapter_capacity(lora_settings(max_loras=3), 3)
    with pytest.raises(LineCapacityError, match="trainer.adapter=lora"):
        check_adapter_capacity(Settings.model_validate({"vllm": {"max_loras": 4}}), 1)
    settings = lora_settings()
    on = settings.gate.canary.model_copy(update={"enabled": True})
    canary = settings.model_copy(update={"gate": settings.gate.model_copy(update={"canary": on})})
    with pytest.raises(LineCapacityError, match="live canary"):
        check_adapter_capacity(canary, 1)
    agents = settings.vllm.model_copy(
        update={"weights_agents": {"http://vllm-0:8000": "http://vllm-0:18090"}}
    )
    with pytest.raises(LineCapacityError, match="weights agents"):
        check_adapter_capacity(settings.model_copy(update={"vllm": agents}), 1)


def test_lora_servers_start_with_room_for_every_adapter(tmp_path: Path) -> None:
    from services.vllm import Vllm

    settings = lora_settings(max_loras=3).model_copy(
        update={"services": lora_settings().services.model_copy(update={"run_dir": tmp_path})}
    )
    cmd = Vllm(settings).command()
    assert cmd[cmd.index("--max-loras") + 1] == "3"
    assert cmd[cmd.index("--served-model-name") + 1] == "rtrl-tiny-base"
    assert cmd[cmd.index("--lora-modules") + 1].startswith("rtrl-tiny=")  # only the global adapter at start

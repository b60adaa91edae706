"""Weights on every host: a vLLM server that cannot see the deployer's files is swapped by loading
the version from the registry's artifact store through the weights agent of its host.

The server runs in a mount namespace of its own in which the deployer's whole directory (its run
dir with the registry downloads and locks, and the folder the version was registered from) is
covered by an empty tmpfs: a path the deployer hands it does not exist there. With
``vllm.weights_agents`` naming the agent (a real ``rtrl agent`` process with a token), the
promotion and the rollback verify. Handed a path it cannot read, vLLM's engine dies: the last step
shows that the promotion then fails and @champion stays.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from helpers import REPO, stop_group
from pydantic import SecretStr

from deployer.rollout import promote, rollback
from registry import CHAMPION, Registry
from schemas.clock import wait_until
from schemas.settings import Settings, StoreSettings
from services.launch import child_env
from services.testing import free_ports
from services.vllm import Vllm
from serving import VllmClient
from store import Store

pytestmark = pytest.mark.integration

TOKEN = "agent-secret-for-tests"


@pytest.fixture(scope="module")
def deployer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Everything the deployer writes; hidden from the server."""
    return tmp_path_factory.mktemp("deployer-host")


@pytest.fixture(scope="module")
def hidden_server(
    mlflow_service: Settings,
    tiny_model_dir: Path,
    deployer_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """A vLLM server on the tiny model that sees an empty tmpfs where `deployer_dir` is."""
    port = free_ports(1)[0]
    unit = Vllm(mlflow_service, port=port, name="vllm-hidden")
    log = tmp_path_factory.mktemp("hidden-server") / "vllm.log"
    script = 'mount -t tmpfs -o size=1m rtrl-hidden "$0" && exec "$@"'
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                str(deployer_dir),
                *unit.command(),
            ],
            env=os.environ | unit.env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        with VllmClient(url, model=mlflow_service.vllm.served_model_name) as server:

            def healthy() -> bool:
                assert proc.poll() is None, log.read_text()[-3000:]
                return server.health()

            wait_until(healthy, timeout_s=600, interval_s=1.0, what="the hidden vLLM server answered /health")
            server.sampled_logprobs("hello", max_tokens=2)  # the engine has served a request
            server.update_weight_version(1)
        yield url
    finally:
        stop_group(proc)


@pytest.fixture
def settings(mlflow_service: Settings, hidden_server: str, deployer_dir: Path, tmp_path: Path) -> Settings:
    tag = tmp_path.name[-16:].replace("_", "-")
    run_dir = deployer_dir / tag
    store = StoreSettings(url=f"sqlite:///{run_dir / 'rtrl.db'}")
    run_dir.mkdir()
    opened = Store(store.url)
    opened.migrate()
    opened.close()
    return mlflow_service.model_copy(
        update={
            "services": mlflow_service.services.model_copy(update={"run_dir": run_dir}),
            "store": store,
            "mlflow": mlflow_service.mlflow.model_copy(
                update={"model_name": f"agent-{tag}", "experiment": f"agent-{tag}"}
            ),
            "vllm": mlflow_service.vllm.model_copy(
                update={"servers": (hidden_server,), "staging_server": None}
            ),
            "agent": mlflow_service.agent.model_copy(
                update={
                    "port": free_ports(1)[0],
                    "cache_dir": tmp_path / "agent-host-cache",
                    "token": SecretStr(TOKEN),
                }
            ),
        }
    )


@pytest.fixture
def agent(settings: Settings, tmp_path: Path) -> Iterator[str]:
    """A real `rtrl agent` on the server's host (its cache is outside the hidden directory)."""
    with (tmp_path / "agent.log").open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rtrl.cli", "agent"],
            cwd=REPO,
            env=child_env(settings),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://{settings.agent.host}:{settings.agent.port}"

    def up() -> bool:
        assert proc.poll() is None, (tmp_path / "agent.log").read_text()[-3000:]
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, timeout_s=60, interval_s=0.3, what="rtrl agent answered /healthz")
        yield url
    finally:
        stop_group(proc)


def _versions(settings: Settings, tiny_model_dir: Path) -> Registry:
    """v1 = the tiny model @champion, v2 = the tiny model with one layer changed, registered from the
    deployer's (hidden) directory."""
    from safetensors.torch import load_file, save_file

    registry = Registry.from_settings(settings)
    registry.set_alias(CHAMPION, registry.register_checkpoint(tiny_model_dir, tags={"rtrl.base": "true"}))
    changed = settings.services.run_dir / "v2-source"
    shutil.copytree(tiny_model_dir, changed)
    weights = load_file(changed / "model.safetensors")
    name = next(k for k in sorted(weights) if k.endswith("mlp.down_proj.weight"))
    weights[name] = weights[name] + 0.05 * torch.randn(
        weights[name].shape, generator=torch.Generator().manual_seed(0)
    )
    save_file(weights, str(changed / "model.safetensors"), metadata={"format": "pt"})
    assert registry.register_checkpoint(changed) == 2
    return registry


def test_a_server_that_cannot_see_the_deployers_files_loads_from_the_artifact_store_through_its_agent(
    settings: Settings, agent: str, tiny_model_dir: Path, hidden_server: str
) -> None:
    registry = _versions(settings, tiny_model_dir)
    server = VllmClient(hidden_server, model=settings.vllm.served_model_name)

    # With the agent: downloaded on the server's host, loaded from there, verified by the probe.
    with_agent = settings.model_copy(
        update={"vllm": settings.vllm.model_copy(update={"weights_agents": {hidden_server + "/": agent}})}
    )
    done = promote(with_agent, registry, 2, force_reason="by hand in a test")
    assert done.ok, done.error
    assert done.servers[0].verified and done.servers[0].max_abs_logprob_diff is not None
    assert registry.champion() == 2 and server.weight_version() == 2
    cache = settings.agent.cache_dir
    assert (cache / "v2" / "model.safetensors").is_file()
    assert not str(cache).startswith(str(settings.services.run_dir))  # not one of the deployer's files

    back = rollback(with_agent, registry)
    assert back.ok and back.version == 1, back.error
    assert server.weight_version() == 1 and sorted(p.name for p in cache.glob("v*")) == ["v1", "v2"]

    # Without the agent the server is handed a path it cannot see. The promotion fails and
    # @champion stays; vLLM 0.32 takes the missing path for a Hub repo id, fails, and its engine
    # dies with it (docs/platform.md, Hot-swap endpoints): why a server on another host needs an agent.
    failed = promote(settings, registry, 2, force_reason="by hand in a test")
    assert not failed.ok and registry.champion() == 1 and not failed.servers[0].verified, failed
    server.close()


def test_the_agent_refuses_what_it_cannot_serve(settings: Settings, agent: str, tiny_model_dir: Path) -> None:
    registry = Registry.from_settings(settings)
    registry.set_alias(CHAMPION, registry.register_checkpoint(tiny_model_dir, tags={"rtrl.base": "true"}))
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{agent}/v1/versions/1", timeout=60).status_code == 401  # no token
    assert (
        httpx.post(f"{agent}/v1/versions/1", headers={"authorization": "Bearer nope"}, timeout=60).status_code
        == 401
    )
    for bad in ("0", "-1", "abc", "1e3", "9999999999"):
        answer = httpx.post(f"{agent}/v1/versions/{bad}", headers=auth, timeout=60)
        assert answer.status_code in (400, 404), (bad, answer.status_code)
    missing = httpx.post(f"{agent}/v1/versions/99", headers=auth, timeout=60)
    assert missing.status_code == 404 and "99" in missing.json()["error"]
    ok = httpx.post(f"{agent}/v1/versions/1", headers=auth, timeout=120)
    assert ok.status_code == 200 and ok.json() == {
        "version": 1,
        "adapter": False,
        "path": str((settings.agent.cache_dir / "v1").resolve()),
    }

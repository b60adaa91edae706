"""No rank outlives its launcher, nor the launcher the process that started it (trainer/process_tree.py),
for the worker's launcher (trainer/ranks.py `train_on_ranks`) and `rtrl train node`'s
(trainer/nodes.py `join_cycles`).

A real process tree: a parent process runs the real function, which starts the real
torch.distributed.run with two ranks; the ranks are a stand-in script (no DeepSpeed) that arms the
same guard `trainer.ranks.main` arms first, then sleeps. The test SIGKILLs the parent, or the
launcher, and asserts that no process of the tree is left.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainer import process_tree

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

RANK = """
import os, signal, sys, time
from pathlib import Path
from trainer import process_tree

process_tree.die_with_parent(signal.SIGKILL)  # as trainer.ranks.main does first
Path(sys.argv[1], str(os.getpid())).write_text(str(os.getppid()))
time.sleep(600)
"""

# The parent: the real join_cycles / train_on_ranks, with the stand-in ranks in the real launcher.
NODE = """
import socket, sys
from schemas.settings import TrainerSettings
from trainer import nodes

launcher = sys.argv[1:]
rendezvous = socket.socket()  # stands in for the worker's, so that join_cycles starts a launcher
rendezvous.bind(("127.0.0.1", 0))
rendezvous.listen()
nodes.join_command = lambda cfg: launcher
cfg = TrainerSettings(nodes=2, rendezvous=f"127.0.0.1:{rendezvous.getsockname()[1]}")
nodes.join_cycles(cfg, lambda: False)
"""

WORKER = """
import sys
from pathlib import Path
from schemas.settings import TrainerSettings
from trainer import ranks

launcher, work = sys.argv[2:], Path(sys.argv[1])
ranks.launch_command = lambda cfg, host, job: launcher
ranks.train_on_ranks(
    TrainerSettings(ranks=2), work, batches=[], norm=(1, 1), mean_advantage=0.0, champion_dir=work,
    base_dir=None, out_dir=work, lineage={}, optimizer_from=None, optimizer_to=None,
)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("caller", ["node", "worker"])
@pytest.mark.parametrize("killed", ["parent", "launcher"])
def test_no_rank_outlives_a_killed_parent_or_launcher(tmp_path: Path, caller: str, killed: str) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    (tmp_path / "rank.py").write_text(textwrap.dedent(RANK))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    launcher += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    launcher += [str(tmp_path / "rank.py"), str(pids)]
    args = launcher if caller == "node" else [str(tmp_path / "work"), *launcher]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(
        [sys.executable, "-c", NODE if caller == "node" else WORKER, *args], env=env, cwd=REPO
    )
    tree: set[int] = set()
    try:
        _wait_for(lambda: len(list(pids.iterdir())) == 2, 60, "both ranks started")
        ranks = {int(p.name) for p in pids.iterdir()}
        launchers = {int(p.read_text()) for p in pids.iterdir()}
        assert len(launchers) == 1 and parent.pid not in launchers
        tree = ranks | launchers
        os.kill(parent.pid if killed == "parent" else next(iter(launchers)), signal.SIGKILL)
        _wait_for(lambda: not any(_alive(pid) for pid in tree), 40, f"every process of {sorted(tree)} gone")
        if killed == "launcher":  # the parent carries on (it reaped the launcher); it is not the tree
            assert parent.poll() is None
    finally:
        for pid in [parent.pid, *tree]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait(timeout=30)


def test_stop_kills_a_launcher_that_ignores_sigterm(tmp_path: Path) -> None:
    """A launcher that does not stop on SIGTERM is SIGKILLed after the grace, with its group."""
    script = "import signal, subprocess, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    script += "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    script += "print(child.pid, flush=True)\ntime.sleep(600)\n"
    log = tmp_path / "launcher.log"
    proc = process_tree.start([sys.executable, "-c", script], env=dict(os.environ), log=log)
    _wait_for(lambda: log.read_text().strip() != "", 30, "the launcher's child started")
    child = int(log.read_text())
    started = time.monotonic()
    assert process_tree.stop(proc, grace_s=1.0) == -signal.SIGKILL
    assert time.monotonic() - started < 10
    _wait_for(lambda: not _alive(child), 10, "the launcher's child (same process group) gone")


def test_a_launcher_that_exited_leaves_no_process_in_its_group(tmp_path: Path) -> None:
    script = "import subprocess, sys\n"
    script += "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    script += "print(child.pid, flush=True)\nsys.exit(3)\n"
    log = tmp_path / "launcher.log"
    proc = process_tree.start([sys.executable, "-c", script], env=dict(os.environ), log=log)
    _wait_for(lambda: process_tree.exited(proc), 30, "the launcher exited")
    child = int(log.read_text())
    assert _alive(child)
    assert process_tree.stop(proc) == 3
    _wait_for(lambda: not _alive(child), 10, "the launcher's leftover child gone")

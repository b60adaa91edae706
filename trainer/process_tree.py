"""The launcher of a cycle's ranks and its process tree: started so that nothing outlives the process
that started it (the worker, trainer/ranks.py `train_on_ranks`, or `rtrl train node`,
trainer/nodes.py).

torch.distributed.run starts every rank in a session of its own, so a signal to the launcher's
process group does not reach the ranks, and a launcher that dies without stopping them (SIGKILL,
an OOM kill) leaves them holding the accelerators and the rendezvous of the next cycle. Three
guards, each for a way of dying:

- the launcher runs in a session (and process group) of its own (`start`): stopping it signals that
  whole group (`stop`), and the group is swept with SIGKILL once the launcher exited (`reap`);
- the launcher is armed with PR_SET_PDEATHSIG = SIGTERM (`die_with_parent`, in ``preexec_fn``):
  when the process that started it dies, even by SIGKILL, the kernel sends it SIGTERM and it stops
  its ranks as on a normal stop;
- every rank arms PR_SET_PDEATHSIG = SIGKILL against the launcher (trainer/ranks.py, first thing):
  a launcher killed outright takes its ranks with it.

PR_SET_PDEATHSIG is Linux's (prctl(2)); elsewhere `die_with_parent` does nothing and only the
process group guards. The signal follows the death of the *thread* that forked the child, so
`start` must be called from the thread that waits for the launcher (both callers do).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_GRACE_S = 30.0  # how long a SIGTERMed launcher has to stop its ranks before SIGKILL


# libc loaded here, not in the forked child (`start`'s preexec_fn): a dlopen after fork could wait
# forever on a loader lock another thread of the parent held at the fork.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(sig: int) -> None:
    """Have the kernel send this process `sig` when its parent dies (Linux; nothing elsewhere). A
    parent that died before the signal was armed is caught too: this process then sends it itself."""
    if _LIBC is None:
        return
    parent = os.getppid()
    if _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent:  # reparented already: the parent is gone
        os.kill(os.getpid(), sig)


def _launcher_preexec() -> None:
    die_with_parent(signal.SIGTERM)


def start(command: list[str], *, env: dict[str, str], log: Path | None = None) -> subprocess.Popen[bytes]:
    """Start the launcher `command` in a session of its own, armed to stop when this process dies
    (see the module docstring); its output (and its ranks') into `log`, or this process's stdout."""
    kwargs: dict[str, Any] = {
        "env": env,
        "stdin": subprocess.DEVNULL,
        "start_new_session": True,
        "preexec_fn": _launcher_preexec,
    }
    if log is None:
        return subprocess.Popen(command, **kwargs)
    with log.open("wb") as sink:
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, **kwargs)


def exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the launcher exited, without reaping it: while it is a zombie its pid, which names its
    process group, cannot be taken by another process, so `reap` can still signal the group safely."""
    if proc.returncode is not None:
        return True
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def reap(proc: subprocess.Popen[bytes]) -> int:
    """SIGKILL whatever is left in the launcher's process group (the launcher too, if it still runs),
    then reap the launcher; its exit code."""
    if proc.returncode is None:
        _signal_group(proc, signal.SIGKILL)
    return proc.wait()


def stop(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> int:
    """SIGTERM the launcher's process group (the launcher stops its ranks), then `reap` it: at once
    when it exited, with SIGKILL after `grace_s` when it did not; the launcher's exit code."""
    if not exited(proc):
        _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while not exited(proc) and time.monotonic() < deadline:
            time.sleep(0.1)
    return reap(proc)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # the group is empty: nothing left to stop
        pass

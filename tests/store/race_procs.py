"""One process of tests/store/test_races.py: a "worker" or a "reconciler" hammering one store.

Run as ``python tests/store/race_procs.py ROLE NAME STORE_URL OUT_DIR SECONDS`` (with the repository
root on PYTHONPATH). It writes ``OUT_DIR/NAME.ready``, waits for ``OUT_DIR/go`` (so that every
process starts at once, after its imports), runs for SECONDS, and writes what it did to
``OUT_DIR/NAME.json``: the intervals in which it held the cycle lease or a deploy lock
(`time.time_ns()`, one clock for every process on the host), the episodes it claimed, and every
check it made inside a lock that another holder would have broken.

The calls are the ones the real processes make, not copies of them:

- worker (worker/chain.py, trainer/cycle.py): `keep_lease`, `Store.expire_cycles`,
  `Store.acquire_cycle`, `Store.select_episodes` + `Store.mark_used` (the cycle's claim),
  `Store.finish_cycle`; then, while the cycle is registered, the gate's "staging" lock (recording
  digests), the canary's "canary" lock and the promotion's "rollout" lock (announcing a swap),
  each through `deployer.swap.rollout_lock` with the chain's wait;
- reconciler (deployer/reconcile.py, `align_fleet` and `canary.reap`): the "rollout" lock
  (announcing a swap), then "staging" and "canary", never waiting (a busy lock skips the tick).

Only the vLLM servers, the registry and the training itself are left out: they run inside these
locks and leases and are not what two processes race on.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from deployer.canary import CANARY_LOCK
from deployer.errors import RolloutBusy
from deployer.swap import rollout_lock
from store import EpisodesUnavailable, Store
from trainer.lease import keep_lease

SERVER = "http://vllm-race:8000"  # the one "server" whose version every swap announces
BATCH = 4  # episodes a cycle claims
LEASE_TTL_S = 30.0
WORKER_LOCK_WAIT_S = 30.0  # deployer.lock_wait_s of the chain


class Log:
    """What one process did, written out as JSON at the end."""

    def __init__(self, role: str, name: str) -> None:
        self.data: dict[str, Any] = {"role": role, "name": name, "holds": [], "cycles": [], "broken": []}
        self.data["busy"] = {"lease": 0, "rollout": 0, "staging": 0, "canary": 0}

    def hold(self, lock: str, start: int, end: int) -> None:
        self.data["holds"].append({"lock": lock, "start": start, "end": end})

    def busy(self, what: str) -> None:
        self.data["busy"][what] += 1

    def broken(self, why: str) -> None:
        self.data["broken"].append(why)


def announce_swap(store: Store, version: int, holder: str, log: Log) -> None:
    """What a swap writes (deployer/swap.py `swap_window`): the server's version changing, then the
    new one. Inside the rollout lock nobody else announces: the version is known on entry and the
    epoch moves by exactly our two announcements."""
    before = store.rotation().get(SERVER)
    if before is not None and before.version is None:
        log.broken(f"{holder}: found {SERVER} mid-swap on entering the rollout lock")
    first = store.set_serving_version(SERVER, None, f"{holder}: swap to v{version}")
    time.sleep(random.uniform(0.001, 0.01))  # the pause, the reload, the probe
    last = store.set_serving_version(SERVER, version, f"{holder}: serving v{version}")
    if last != first + 1:
        log.broken(f"{holder}: the version epoch moved from {first} to {last} during our swap")


def held(store: Store, lock: str, purpose: str, wait_s: float, log: Log, work: Any) -> bool:
    """Run `work()` under deploy lock `lock`; whether the lock was taken (busy counted)."""
    try:
        with rollout_lock(store, lock, purpose, wait_s=wait_s):
            start = time.time_ns()
            work()
            log.hold(lock, start, time.time_ns())
        return True
    except RolloutBusy:
        log.busy(lock)
        return False


def gate_canary_promote(store: Store, version: int, owner: str, log: Log) -> bool:
    """The chain after registration: the gate records the version's digests under "staging", the
    canary holds "canary", the promotion announces the swap under "rollout"; each waits for its lock
    as the chain does. Whether every lock was taken."""
    wait = WORKER_LOCK_WAIT_S
    digests = {"w": str(version)}
    return (
        held(
            store,
            "staging",
            f"gate v{version}",
            wait,
            log,
            lambda: store.record_digests("race", version, digests),
        )
        and held(store, CANARY_LOCK, f"canary v{version}", wait, log, lambda: None)
        and held(
            store,
            "rollout",
            f"promote v{version}",
            wait,
            log,
            lambda: announce_swap(store, version, owner, log),
        )
    )


def worker_cycle(store: Store, name: str, attempt: int, log: Log) -> None:
    """One attempt at a cycle, as the chain makes it (lease, claim, gate, canary, promote)."""
    owner = f"{name}:{attempt}"
    with keep_lease(store, owner, LEASE_TTL_S):
        store.expire_cycles()
        cycle = store.acquire_cycle(owner, LEASE_TTL_S, champion=1)
        if cycle is None:
            log.busy("lease")
            return
        start = time.time_ns()
        wanted = [e.episode_id for e in store.select_episodes(1, 1000, BATCH)]
        record: dict[str, Any] = {"cycle": cycle, "owner": owner, "episodes": wanted, "claimed": False}
        if len(wanted) == BATCH:  # the pool runs dry at the end: such a cycle fails
            try:
                store.mark_used(cycle, wanted)
                record["claimed"] = True
            except EpisodesUnavailable as exc:  # only another cycle's claim could take them
                log.broken(f"{owner}: cycle {cycle} could not claim what it selected: {exc}")
        if not record["claimed"] or random.random() < 0.2:  # a failed cycle gives its episodes back
            record.update(status="failed", start=start, end=time.time_ns())
            log.data["cycles"].append(record)
            store.finish_cycle(cycle, "failed", error="race test: failed", count_failure=False)
            return
        time.sleep(random.uniform(0.0, 0.02))  # training
        store.finish_cycle(cycle, "registered", challenger=cycle + 1)
        ok = gate_canary_promote(store, cycle + 1, owner, log)
        record.update(status="promoted" if ok else "failed", start=start, end=time.time_ns())
        log.data["cycles"].append(record)
        store.finish_cycle(cycle, record["status"], error=None if ok else "lock busy", count_failure=False)
    time.sleep(random.uniform(0.0, 0.01))  # between tasks


def reconciler_tick(store: Store, name: str, tick: int, log: Log) -> None:
    """One tick, as `reconcile_once` takes its locks: the fleet, then staging, then the canary's
    reap; a busy lock is skipped, never waited for."""
    holder = f"{name}:{tick}"
    version = store.rotation().get(SERVER)
    current = 1 if version is None or version.version is None else version.version
    align = "align the fleet to @champion"
    held(store, "rollout", align, 0.0, log, lambda: announce_swap(store, current, holder, log))
    held(store, "staging", "align staging to @champion", 0.0, log, lambda: time.sleep(0.002))
    held(store, CANARY_LOCK, "end an orphaned canary", 0.0, log, lambda: store.running_canary())
    time.sleep(random.uniform(0.02, 0.1))  # reconcile_interval_s, shortened


def main(role: str, name: str, url: str, out: Path, seconds: float) -> None:
    store = Store(url)
    store.check_schema()
    log = Log(role, name)
    (out / f"{name}.ready").touch()
    while not (out / "go").exists():
        time.sleep(0.01)
    deadline, step = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        if role == "worker":
            worker_cycle(store, name, step, log)
        else:
            reconciler_tick(store, name, step, log)
        step += 1
    store.close()
    (out / f"{name}.json").write_text(json.dumps(log.data))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]), float(sys.argv[5]))

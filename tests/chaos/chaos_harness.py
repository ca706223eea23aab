"""Shared harness of the chaos tests: run a tiny job under a fault plan with real processes on
file:// storage, then check the invariants every fault family must keep.

Not a test module; imported by tests/chaos/test_*.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from diloco.chaos.agent import ChaosAgent, attach_chaos
from diloco.chaos.control import done_key
from diloco.chaos.plan import SlowLearner, StorageDegraded, StorageOutage
from diloco.configs import load_config
from diloco.evaluator.evaluator import read_evals
from diloco.inspect.audit import AuditReport, audit_run
from diloco.run.context import RunContext
from diloco.run.create import create_run
from diloco.run.events import read_events
from diloco.run.fragments import manifests
from diloco.storage import Manifest, StorageError, open_store, read_latest
from diloco.supervise.core import Supervisor
from diloco.supervise.local import local_supervisor
from diloco.trust.outliers import guard_figures

TEST_OVERRIDES = {
    "run.num_versions": 1_000_000,  # runs end when their test's condition holds, or at the time limit (a cap)
    "run.heartbeat_timeout_s": 60.0,
    "merger.max_delta_bytes": 300_000,  # a tiny delta is ~25 kB; lets "oversized" be a real 1 MB object
    "outer.max_staleness": 4,  # so a "stale" delta can be made early in a short run
}


@dataclass
class ChaosRun:
    ctx: RunContext
    root: Path
    reason: str
    events: list[dict]
    chain: list[Manifest]
    audit: AuditReport


Until = Callable[[Supervisor, ChaosAgent], bool]


def run_plan(tmp_path: Path, plan_yaml: str, run_id: str, until: Until | None = None,
             **overrides: object) -> ChaosRun:
    """Run the plan until `until(supervisor, agent)` holds (checked each tick) or the time limit."""
    cfg = load_config("tiny").with_overrides({**TEST_OVERRIDES, **overrides})
    root = tmp_path / "store"
    ctx = create_run(open_store(f"file://{root}"), run_id, cfg)
    plan = tmp_path / f"{run_id}.yaml"
    plan.write_text(plan_yaml)
    supervisor = local_supervisor(ctx, prefect=False, log_dir=str(tmp_path / "logs"),
                            env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    agent = attach_chaos(supervisor, plan)
    reason = supervisor.run_to_end(shutdown_grace_s=30, tick_s=0.2,
                                   until=None if until is None else lambda sup: until(sup, agent))
    return ChaosRun(ctx, root, reason, read_events(ctx.store, ctx.keys), manifests(ctx), audit_run(ctx))


def all_injected(agent: ChaosAgent) -> bool:
    """Every fault of the plan executed (windows and start-time slowdowns live in the control object)
    and every follow-up (a resume, a window's end, the second step of seq_backwards) done."""
    lasting = (StorageOutage, StorageDegraded)
    left = [d for d in agent.pending
            if not isinstance(d.fault, lasting)
            and not (isinstance(d.fault, SlowLearner) and d.fault.at_s == 0)]
    return not left and not agent.timers


def merger_kills_claimed(agent: ChaosAgent) -> bool:
    """Every ordered merger self-kill claimed by the merger it targets (it dies right after)."""
    try:
        return all(agent.ctx.store.exists(done_key(agent.ctx.keys, k.fault_id))
                   for k in agent.control.merger_kills)
    except StorageError:
        return False


def loss_fell(sup: Supervisor) -> bool:
    """The newest evaluated version's held-out loss is below version 0's (training recovered from the
    faults)."""
    try:
        evals = read_evals(sup.ctx)
    except StorageError:
        return False
    return len(evals) >= 2 and evals[0]["version"] == 0 and evals[-1]["loss"] < evals[0]["loss"]


def latest_merger(sup: Supervisor) -> str | None:
    try:
        manifest = read_latest(sup.ctx.store, sup.ctx.keys)
    except (StorageError, ValueError):
        return None
    return None if manifest is None else manifest.merger_id


def faults(run: ChaosRun, kind: str = "fault") -> list[dict]:
    return [e for e in run.events if e.get("source") == "chaos" and e.get("kind") == kind]


def decisions(run: ChaosRun) -> dict[tuple[str, int], list[tuple[int, str, str]]]:
    out: dict[tuple[str, int], list[tuple[int, str, str]]] = {}
    for m in run.chain:
        for d in m.decisions:
            for seq in range(d.seq, d.last_seq + 1):  # a range (a lost gap) decides each of its seqs
                out.setdefault((d.learner, seq), []).append((m.version, d.status, d.reason))
    return out


def assert_invariants(run: ChaosRun) -> None:
    """Versions contiguous; no delta merged twice; every delta decided with a reason (or published
    after the final merge); replay bit for bit; no false rejection by the guard; held-out loss fell; no
    process left behind."""
    assert run.audit.ok, run.audit.problems
    assert run.audit.replay_ok
    assert [m.version for m in run.chain] == list(range(len(run.chain)))
    assert run.reason in ("done", "time limit"), run.reason
    for key, seen in decisions(run).items():
        assert len(seen) == 1, f"delta {key} decided more than once: {seen}"
        _version, status, reason = seen[0]
        assert status == "merged" or reason, f"delta {key} {status} without a reason"
    _assert_pending_after_final_merge(run)
    # the run's own learners are honest: the guard must never reject or clip one
    guard = guard_figures(run.ctx)
    assert guard["guard_rejections"] == 0 and guard["guard_clips"] == 0, guard
    evals = read_evals(run.ctx)
    assert evals and evals[0]["version"] == 0
    assert evals[-1]["version"] > 0 and evals[-1]["loss"] < evals[0]["loss"], evals
    assert_no_children()


def _assert_pending_after_final_merge(run: ChaosRun) -> None:
    decided = set(decisions(run))
    last_commit = run.chain[-1].created_at
    slack_s = 2 * run.ctx.cfg.merger.gap_timeout_s + run.ctx.cfg.merger.quorum_timeout_s
    for key in run.ctx.store.list(run.ctx.keys.deltas_prefix()):
        parts = key.split("/")
        learner, seq = parts[-2], int(parts[-1].split(".")[0])
        if (learner, seq) in decided:
            continue
        mtime = os.stat(run.root / key).st_mtime
        assert mtime > last_commit - slack_s, f"{key} published long before the final merge, never decided"


# when the current test started (tests/chaos/conftest.py): older processes are not its run's
TEST_STARTED = 0.0


def _of_the_run(proc: psutil.Process) -> bool:
    """A live process started for the run (a diloco role or standby), not e.g. multiprocessing's
    resource tracker that an earlier test in this session left to the interpreter, nor a session fixture's
    process started before this test (a shared Prefect server)."""
    try:
        return (proc.status() != psutil.STATUS_ZOMBIE and "diloco" in " ".join(proc.cmdline())
                and proc.create_time() >= TEST_STARTED - 0.1)
    except psutil.Error:
        return False


def assert_no_children(timeout_s: float = 10.0) -> None:
    deadline = time.time() + timeout_s
    while True:
        alive = [p for p in psutil.Process().children(recursive=True) if _of_the_run(p)]
        if not alive or time.time() > deadline:
            break
        time.sleep(0.2)
    assert not alive, f"processes of the run left behind: {[p.cmdline()[-6:] for p in alive]}"


def wait_for(check: Callable[[], object], timeout_s: float, what: str) -> object:
    """Poll `check` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")

"""A removal check shared by the local (tests/chaos) and Prefect (tests/deployment) paths: a tiny run with
two learners, `diloco remove-learner` on one of them while the run goes on; the removed learner's process
ends after its phase, is never started again, publishes nothing more, and the run goes on without it.

Not a test module; imported by test_remove_learner.py (here) and tests/deployment/test_deployments.py.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from diloco.configs import load_config
from diloco.run.create import create_run
from diloco.run.events import read_events
from diloco.storage import latest_version, open_store
from diloco.storage.keys import parse_delta_key
from diloco.supervise.local import local_supervisor


def seqs_of(ctx, name: str) -> list[int]:
    return sorted(p[1] for p in (parse_delta_key(k) for k in ctx.store.list(ctx.keys.deltas_prefix(name)))
                  if p)


def check_removal(tmp_path: Path, *, prefect: bool, env: dict[str, str] | None = None) -> None:
    # a long heartbeat timeout: on 2 busy cores (the deployment tests run a deployed run beside this one) an
    # exec'd Prefect learner can take a minute to join, and a silence kill would be a restart this test
    # forbids
    cfg = load_config("tiny").with_overrides({"run.num_learners": 2, "run.num_versions": 1_000_000,
                                              "run.time_limit_s": 300, "run.restart_backoff_s": 0.2,
                                              "run.heartbeat_timeout_s": 180})
    url = f"file://{tmp_path}/store"
    ctx = create_run(open_store(url), "removal", cfg)
    sup = local_supervisor(ctx, prefect=prefect, log_dir=str(tmp_path / "logs"),
                           env={"OMP_NUM_THREADS": "1", **(env or {})})
    gone, state = ctx.learners[1], {}

    def until(s) -> bool:
        now = time.time()
        if "removed_at" not in state:
            if seqs_of(ctx, gone) and seqs_of(ctx, ctx.learners[0]):  # both learners publish
                done = subprocess.run([sys.executable, "-m", "diloco.cli", "remove-learner", "--storage", url,
                                       "--run-id", ctx.run_id, "--learner", gone],
                                      capture_output=True, text=True, timeout=180, env={**s.backend.env})
                assert done.returncode == 0, done.stderr
                state["removed_at"], state["version"] = now, latest_version(ctx.store, ctx.keys)
            return False
        job = s.jobs[gone]
        if job.handle is not None or "ended_at" not in state and not job.exits:
            return False
        state.setdefault("ended_at", now)
        state.setdefault("seqs", seqs_of(ctx, gone))
        # the run goes on: versions keep coming for a while after the removed learner ended
        return now - state["ended_at"] > 8 and latest_version(ctx.store, ctx.keys) >= state["version"] + 3

    reason = sup.run_to_end(shutdown_grace_s=30, tick_s=0.2, until=until)
    assert reason == "done", f"the run ended with {reason!r} before the removal was seen through"
    job = sup.jobs[gone]
    assert job.removed and len(job.history) == 1, f"the removed learner was started again: {job.history}"
    assert seqs_of(ctx, gone) == state["seqs"], "the removed learner published after it ended"
    assert state["ended_at"] - state["removed_at"] < 60
    events = read_events(ctx.store, ctx.keys)
    mine = [e["kind"] for e in events if e.get("source") == "supervisor" and e.get("learner") == gone]
    assert "removed" in mine and "restart" not in mine and "kill" not in mine, mine

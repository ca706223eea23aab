"""Honest traffic: a learner's `traffic` figures count every byte it moved — deltas, its checkpoint pointer
and moments, statuses, events, manifests, updates, params, listings' keys — checked against an independent
recording store under its counting store; the summary's and `diloco runs`' ratios to data-parallel are over
those totals, the deltas-only ratio beside them.
Run: .venv/bin/pytest tests/integration/test_traffic.py -q
"""

from __future__ import annotations

import dataclasses
import threading

from diloco.configs import load_config
from diloco.inspect.runs import list_runs
from diloco.inspect.summary import build_summary, learner_traffic_by_kind, traffic_figures
from diloco.learner.learner import Learner
from diloco.learner.loop import emit_traffic
from diloco.merger.merger import Merger
from diloco.run.create import create_run
from diloco.run.events import EventLog
from diloco.specs.gpt import load_corpus, make_spec
from diloco.storage import open_store
from diloco.storage.store import Store
from diloco.storage.traffic import CountingStore
from diloco.storage.wrapper import WrapperStore


class Recording(WrapperStore):
    """Every byte put and got, and every listed key's bytes, summed (shared by its views)."""

    def __init__(self, inner: Store, totals: dict[str, int] | None = None) -> None:
        super().__init__(inner)
        self.totals = totals if totals is not None else {"put": 0, "got": 0, "listed": 0}
        self.lock = threading.Lock()

    def _over(self, inner: Store) -> Recording:
        return Recording(inner, self.totals)

    def _add(self, what: str, n: int) -> None:
        with self.lock:
            self.totals[what] += n

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self._add("got", len(data))
        return data

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)
        self._add("put", len(data))

    def put_if_absent(self, key: str, data: bytes) -> None:
        self.inner.put_if_absent(key, data)
        self._add("put", len(data))

    def list(self, prefix: str, after: str = "") -> list[str]:
        keys = self.inner.list(prefix, after)
        self._add("listed", sum(len(k) + 1 for k in keys))
        return keys

    def folders(self, prefix: str) -> list[str]:
        names = self.inner.folders(prefix)
        self._add("listed", sum(len(prefix) + len(n) + 2 for n in names))
        return names


def test_a_learners_traffic_counts_every_object_and_the_ratios_are_over_all_of_it(tmp_path):
    cfg = load_config("tiny").with_overrides({"run.num_learners": 2, "merger.quorum": 1,
                                              "merger.grace_cap_s": 0.0, "learner.checkpoint_every": 2,
                                              "learner.local_state_every_steps": 0})
    ctx = create_run(open_store(f"file://{tmp_path}/bucket"), "traffic", cfg)
    recording = Recording(ctx.store)
    counting = CountingStore(recording)
    mine = dataclasses.replace(ctx, store=counting)  # as launch.make_learner sets a learner up
    learner = Learner(mine, "local-0", make_spec(ctx.cfg, load_corpus(cfg.data)),
                      events=EventLog(counting.with_retries(1), ctx.keys, "local-0"))
    merger = Merger(ctx)
    merger.load()
    learner.join()
    for _ in range(3):
        learner.publish(learner.run_phase())
        learner.drain()
        merger.merge_once()
        learner.maybe_install()
        learner.heartbeat("training", force=True, wait=True)
        learner.events.flush()
    learner.close()
    totals = dict(recording.totals)
    emit_traffic(learner)  # what this process put and got, by kind, until now
    learner.events.flush()
    by_kind = learner_traffic_by_kind(ctx)["local-0"]
    assert sum(by_kind["sent"].values()) == totals["put"]
    assert sum(by_kind["received"].values()) == totals["got"] + totals["listed"]
    assert by_kind["received"]["listing"] == totals["listed"] > 0
    for kind in ("delta", "checkpoint", "status", "event"):
        assert by_kind["sent"].get(kind, 0) > 0, kind
    for kind in ("global", "manifest"):
        assert by_kind["received"].get(kind, 0) > 0, kind
    summary = build_summary(ctx)
    figures = traffic_figures(ctx)
    dp = summary["dp_bytes_equivalent"]
    assert summary["traffic_ratio_vs_dp"] == dp / totals["put"]  # every byte, not the deltas alone
    assert summary["delta_traffic_ratio_vs_dp"] == dp / summary["bytes_published"]
    assert summary["traffic_ratio_vs_dp"] < summary["delta_traffic_ratio_vs_dp"]
    assert figures["bytes_sent_per_learner"] == totals["put"] / 2  # per learner of the run's two
    assert figures["traffic_ratio_vs_dp"] == summary["traffic_ratio_vs_dp"]
    listed = {r["run_id"]: r for r in list_runs(ctx.store)}
    assert listed["traffic"]["traffic_ratio_vs_dp"] == summary["traffic_ratio_vs_dp"]
    assert listed["traffic"]["delta_traffic_ratio_vs_dp"] == summary["delta_traffic_ratio_vs_dp"]

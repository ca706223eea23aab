"""The merger's poll lists what is new, not the run: one listing of the learners' folders, then one per
learner from its cursor's key on (S3's StartAfter), so a poll costs O(learners + new deltas) however long the
run. A writer nobody admitted is still found (and rejected), and a folder that is no learner's name is
skipped. On the real S3 server, through s3fs. Run: .venv/bin/pytest tests/integration/test_merger_listing.py
-q
"""

from __future__ import annotations

import botocore

from diloco.api.operate import admit_learner
from diloco.configs import load_config
from diloco.inspect.audit import audit_run
from diloco.merger.merger import Merger
from diloco.run.chain_state import chain_params
from diloco.run.create import create_run
from diloco.run.fragments import manifests
from diloco.run.objects import encode_tensors
from diloco.storage import open_store, read_latest
from diloco.storage.wrapper import WrapperStore


class Listings(WrapperStore):
    """Records every listing: (prefix, after, keys returned)."""

    def __init__(self, inner, log: list | None = None) -> None:
        super().__init__(inner)
        self.log = [] if log is None else log

    def _over(self, inner):
        return Listings(inner, self.log)

    def list(self, prefix: str, after: str = "") -> list[str]:
        keys = self.inner.list(prefix, after)
        self.log.append((prefix, after, len(keys)))
        return keys


def plant(ctx, learner: str, seq: int, base_version: int) -> None:
    """A small, well-formed delta from `learner` as its `seq`."""
    params = chain_params(ctx, read_latest(ctx.store, ctx.keys))
    meta = {"learner": learner, "seq": seq, "base_version": base_version, "tokens": 1000, "steps": 10,
            "phase_time_s": 1.0, "train_loss": 3.0}
    ctx.store.put(ctx.keys.delta(learner, seq), encode_tensors({k: v * 1e-3 for k, v in params.items()},
                  codec_name="fp32", kind="delta", fingerprint=ctx.fingerprint, meta=meta))


def test_a_poll_lists_only_the_deltas_after_each_cursor(s3_url):
    cfg = load_config("tiny").with_overrides({"run.num_learners": 2, "merger.quorum": 2,
                                              "merger.grace_cap_s": 0.0,
                                              # the last merge: one member pending
                                              "merger.quorum_timeout_s": 0.2})
    store = Listings(open_store(s3_url))
    ctx = create_run(store, "listing", cfg)
    for seq in range(3):  # three rounds of both learners, each merged before the next
        for learner in ctx.learners:
            plant(ctx, learner, seq, base_version=seq)
        merger = Merger(ctx)
        merger.load()
        assert merger.merge_once() is not None
    store.put(f"{ctx.keys.deltas_prefix()}Not_A_Name/000000000000.delta", b"x")  # not a learner's folder
    plant(ctx, ctx.learners[0], 3, base_version=3)
    plant(ctx, "stranger", 0, base_version=3)  # never admitted: found, and rejected unread
    store.log.clear()
    pending = merger.pending()
    # one decision
    assert pending.ready == {ctx.learners[0]: [3]} and pending.strangers == {"stranger": (0, 0)}
    deltas = [(prefix, after, n) for prefix, after, n in store.log if "/deltas/" in prefix]
    assert sorted(deltas) == sorted([
        # seqs 0-2 not listed
        (ctx.keys.deltas_prefix(ctx.learners[0]), ctx.keys.delta(ctx.learners[0], 2), 1),
        (ctx.keys.deltas_prefix(ctx.learners[1]), ctx.keys.delta(ctx.learners[1], 2), 0),
        (ctx.keys.deltas_prefix("stranger"), "", 1),
    ])
    merger.refresh_policy()
    version = merger.merge_once()
    decided = {(d.learner, d.seq): (d.status, d.check) for d in version.decisions}
    assert (decided[(ctx.learners[0], 3)][0] == "merged"
            and decided[("stranger", 0)] == ("rejected", "admission"))
    assert [m.version for m in manifests(ctx)] == [0, 1, 2, 3, 4]


def test_a_listing_is_one_request_a_page_even_of_an_empty_folder(s3_url: str) -> None:
    """Every listing a poll makes — the control ops (empty in most runs), a learner's deltas before its first
    merge, after a cursor — is one list_objects_v2 a page on S3; s3fs's own find() followed an empty answer
    with a HEAD and a second listing (the merger listed control/ops/ in three requests, ~1/3 of its polling
    over real links: docs/bench/wan.md)."""
    store = open_store(s3_url)
    assert not store.exists("run/x")  # the client is made
    client = store._backend.fs.s3
    calls: list[str] = []
    make_api_call = client._make_api_call

    async def counted(operation, params):  # every request s3fs sends goes through here
        calls.append(botocore.xform_name(operation))
        return await make_api_call(operation, params)

    client._make_api_call = counted
    assert store.list("run/control/ops/") == [] and calls == ["list_objects_v2"]
    store.put("run/deltas/a/1.delta", b"x")
    store.put("run/deltas/a/2.delta", b"y")
    calls.clear()
    assert store.list("run/deltas/a/") == ["run/deltas/a/1.delta", "run/deltas/a/2.delta"]
    assert store.list("run/deltas/a/", "run/deltas/a/1.delta") == ["run/deltas/a/2.delta"]
    assert store.list("run/deltas/b/") == [] and store.list("run/deltas/") == store.list("run/deltas/a/")
    assert calls == ["list_objects_v2"] * 5



def test_a_writer_admitted_between_the_listing_and_the_merge_is_merged_next_not_a_crash(tmp_path) -> None:
    """The wait ended with a never-admitted writer's keys (a stranger); its admission lands before the merge
    reads the ops again: the merge leaves its keys to the next one, which merges them as a member's (it raised
    AttributeError on the gate's None, and the merger process died)."""
    cfg = load_config("tiny").with_overrides({"run.num_learners": 1, "merger.quorum": 1,
                                              "merger.grace_cap_s": 0.0})
    ctx = create_run(open_store(f"file://{tmp_path}"), "admitted", cfg)
    merger = Merger(ctx)
    merger.load()
    plant(ctx, ctx.learners[0], 0, base_version=0)
    plant(ctx, "late-0", 0, base_version=0)
    assert merger.due() and merger.wait.ready.strangers == {"late-0": (0, 0)}
    admit_learner(ctx, None, "late-0")
    first = merger.merge_once()
    assert [(d.learner, d.status) for d in first.decisions] == [(ctx.learners[0], "merged")]
    assert "late-0" not in first.cursors
    plant(ctx, ctx.learners[0], 1, base_version=1)
    second = merger.merge_once()
    assert {(d.learner, d.seq, d.status) for d in second.decisions} == {
        (ctx.learners[0], 1, "merged"), ("late-0", 0, "merged")}
    report = audit_run(ctx)
    assert report.ok, report.problems

"""The outer merger: wait for a quorum of learners, a grace window, validate, merge, commit.

Contract (DESIGN §6): a delta is merged at most once (the manifest cursor), every delta is
eventually merged, rejected or declared lost with a reason, a bad delta never stops the merge,
and a lost commit race (Conflict) only means reloading the winner's state.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diloco.merger.step import (
    DeltaInvalid,
    GradientStream,
    LearnerGroup,
    OuterState,
    gradient_stream,
    outer_optimizer,
    outer_step,
    validate_delta,
)
from diloco.run.context import RunContext, direct_names
from diloco.run.events import EventLog
from diloco.run.objects import decode_tensors, read_tensors, write_tensors
from diloco.storage import (
    Conflict,
    DeltaDecision,
    Manifest,
    NotFound,
    StorageError,
    commit,
    manifest_exists,
    read_latest,
)
from diloco.storage.codec import CodecError, object_checksum
from diloco.storage.errors import Backoff
from diloco.storage.keys import new_nonce, parse_delta_key

log = logging.getLogger("diloco.merger")
EMA = 0.3  # weight of the newest observation in the grace-window moving averages
STORAGE_BACKOFF_S = (0.5, 10.0)  # first wait, cap (doubled per failed merge) while the bucket is in trouble


@dataclass
class Pending:
    """Deltas the merger may take now: per learner, the contiguous seqs after its cursor."""

    ready: dict[str, list[int]] = field(default_factory=dict)
    lost: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_learners(self) -> int:
        return sum(1 for seqs in self.ready.values() if seqs)


class Merger:
    """Drive with load() once, then merge_once() in a loop."""

    def __init__(self, ctx: RunContext, merger_id: str = "merger", events: EventLog | None = None,
                 stage_hook: Callable[[str], None] | None = None) -> None:
        self.ctx, self.cfg, self.merger_id = ctx, ctx.cfg, merger_id
        torch.set_num_threads(1)  # reductions in one fixed order: `audit` replays them bit for bit
        self.events = events or EventLog(None, None, merger_id)
        self.stage_hook = stage_hook or (lambda stage: None)  # chaos: kill at a named stage
        self.gap_seen: dict[tuple[str, int], float] = {}
        self.ema = {"phase_s": 0.0, "quorum_s": 0.0, "merge_s": 0.0}
        self.optimizer = outer_optimizer(self.cfg, len(ctx.learners))

    # ---- state ---------------------------------------------------------------------------
    def load(self) -> int:
        manifest = read_latest(self.ctx.store, self.ctx.keys)
        if manifest is None:
            raise RuntimeError(f"run {self.ctx.run_id} has no version 0")
        _, params = read_tensors(self.ctx.store, manifest.params_key, fingerprint=self.ctx.fingerprint,
                                   checksum=manifest.params_checksum)
        if manifest.outer_key:
            header, raw = read_tensors(self.ctx.store, manifest.outer_key, fingerprint=self.ctx.fingerprint,
                                         checksum=manifest.outer_checksum)
            self.outer = OuterState.from_tensors(raw, params)
            self.ema.update({k: float(v) for k, v in header.meta.get("ema", {}).items() if k in self.ema})
        else:
            self.outer = OuterState.zeros_like(params)
        self.params, self.manifest = params, manifest
        return manifest.version

    @property
    def version(self) -> int:
        return self.manifest.version

    # ---- discovery -----------------------------------------------------------------------
    def pending(self) -> Pending:
        """List deltas (never cached); per learner the contiguous seqs after the cursor; old gaps lost."""
        found: dict[str, list[int]] = {}
        for key in self.ctx.store.list(self.ctx.keys.deltas_prefix()):
            parsed = parse_delta_key(key)
            if parsed and parsed[1] > self.manifest.cursors.get(parsed[0], -1):
                found.setdefault(parsed[0], []).append(parsed[1])
        out, now = Pending(), time.time()
        for learner, seqs in sorted(found.items()):
            seqs.sort()
            expected = self.manifest.cursors.get(learner, -1) + 1
            if seqs[0] > expected:
                first_seen = self.gap_seen.setdefault((learner, expected), now)
                if now - first_seen < self.cfg.merger.gap_timeout_s:
                    continue  # a gap waits ...
                out.lost[learner] = list(range(expected, seqs[0]))  # ... then is declared lost
                expected = seqs[0]
            run = []
            for s in seqs:
                if s != expected:
                    break
                run.append(s)
                expected += 1
            out.ready[learner] = run
        return out

    def wait_for_quorum(self, should_stop: Callable[[], bool]) -> tuple[Pending, float] | None:
        cfg, t0 = self.cfg.merger, time.time()
        quorum = min(cfg.quorum, max(1, len(self.ctx.learners)))
        while not should_stop():
            if manifest_exists(self.ctx.store, self.ctx.keys, self.version + 1):
                return None  # another merger moved on: reload first
            pending = self.pending()
            waited = time.time() - t0
            if pending.num_learners >= quorum or (pending.num_learners and waited >= cfg.quorum_timeout_s):
                return pending, waited
            time.sleep(cfg.poll_interval_s)
        return None

    def grace_s(self) -> float:
        """Adaptive grace window: gamma * (phase - quorum wait - merge time), clamped to [0, cap]."""
        cfg = self.cfg.merger
        slack = self.ema["phase_s"] - self.ema["quorum_s"] - self.ema["merge_s"]
        return min(max(cfg.grace_gamma * slack, 0.0), cfg.grace_cap_s)

    # ---- one merge -----------------------------------------------------------------------
    def merge_once(self, should_stop: Callable[[], bool] = lambda: False) -> Manifest | None:
        """One outer step; None when stopped or when another merger committed first (reloaded)."""
        if manifest_exists(self.ctx.store, self.ctx.keys, self.version + 1):
            self.load()
            return None
        self.stage_hook("listing")
        got = self.wait_for_quorum(should_stop)
        if got is None:
            if not should_stop():
                self.load()
            return None
        pending, quorum_wait = got
        grace = self.grace_s()
        if grace > 0:
            time.sleep(grace)
            pending = self.pending()
        t0 = time.time()
        decisions, stream, phase_times = self._decide(pending)
        result = outer_step(self.params, self.outer, stream, self.ctx.fingerprint, self.optimizer)
        for d in decisions:
            if d.status == "merged":
                d.weight = result.weights.get(d.learner, 0.0)
        manifest = self._write_and_commit(decisions, len(stream.weights), result, quorum_wait, grace, t0,
                                          phase_times)
        return manifest

    def _decide(self, pending: Pending) -> tuple[list[DeltaDecision], GradientStream, list[float]]:
        """Read, validate and fold the deltas learner by learner (streamed: memory does not grow
        with the number of learners)."""
        decisions: list[DeltaDecision] = []
        stream = gradient_stream(self.params, self.version, self.cfg.outer, direct_names(self.ctx, self.params))
        phase_times: list[float] = []
        for learner, seqs in sorted(pending.lost.items()):
            for seq in seqs:
                decisions.append(DeltaDecision(
                    learner=learner, seq=seq, status="lost",
                    reason=f"seq {seq} missing for over {self.cfg.merger.gap_timeout_s:g}s while later seqs arrived"))
        for learner, seqs in sorted(pending.ready.items()):
            group = LearnerGroup(learner)
            for seq in seqs:
                decision, header, delta = self._read_one(learner, seq)
                decisions.append(decision)
                if decision.status == "merged":
                    group.add(seq, header, delta)
                    phase_times.append(float(header.meta.get("phase_time_s", 0.0) or 0.0))
            if group.seqs:
                stream.add(group)
        return decisions, stream, phase_times

    def _read_one(self, learner: str, seq: int):
        key = self.ctx.keys.delta(learner, seq)
        base = DeltaDecision(learner=learner, seq=seq, status="rejected")
        try:
            size = self.ctx.store.get_size(key)
            if size > self.cfg.merger.max_delta_bytes:
                raise DeltaInvalid(f"oversized: {size} bytes > max_delta_bytes {self.cfg.merger.max_delta_bytes}")
            data = self.ctx.store.get(key)
            base.bytes, base.checksum = len(data), object_checksum(data)
            header, delta = decode_tensors(data, fingerprint=self.ctx.fingerprint,
                                             max_bytes=self.cfg.merger.max_delta_bytes)
            staleness = validate_delta(header, delta, learner=learner, seq=seq, version=self.version,
                                       params=self.params, cfg=self.cfg)
        except NotFound:
            base.status, base.reason = "lost", "object vanished after listing"
            return base, None, None
        except (CodecError, DeltaInvalid) as err:
            base.reason = str(err)[:500]
            log.warning("rejected %s/%d: %s", learner, seq, base.reason)
            self.events.emit("rejected", learner=learner, seq=seq, reason=base.reason, version=self.version)
            return base, None, None
        meta = header.meta
        base.status, base.base_version, base.staleness = "merged", meta["base_version"], staleness
        base.tokens, base.steps = meta["tokens"], meta["steps"]
        return base, header, delta

    def _write_and_commit(self, decisions, num_groups, result, quorum_wait, grace, t0, phase_times):
        keys, store, version = self.ctx.keys, self.ctx.store, self.version + 1
        nonce = new_nonce()
        self.stage_hook("writing")
        params_key, update_key, outer_key = keys.params(version, nonce), keys.update(version, nonce), keys.outer(version, nonce)
        store.put(update_key, result.update_bytes)
        _, params_sum = write_tensors(store, params_key, result.params, kind="params",
                                        fingerprint=self.ctx.fingerprint)
        merge_s = time.time() - t0
        ema = self._next_ema(phase_times, quorum_wait, merge_s)
        _, outer_sum = write_tensors(store, outer_key, result.outer.to_tensors(), kind="outer",
                                       fingerprint=self.ctx.fingerprint, meta={"ema": ema})
        self.stage_hook("before_manifest")
        cursors = dict(self.manifest.cursors)
        for d in decisions:
            cursors[d.learner] = max(cursors.get(d.learner, -1), d.seq)
        merged_tokens = sum(d.tokens for d in decisions if d.status == "merged")
        manifest = Manifest(
            run_id=self.ctx.run_id, version=version, parent=self.version, created_at=time.time(),
            merger_id=self.merger_id, params_key=params_key, params_checksum=params_sum,
            update_key=update_key, update_checksum=object_checksum(result.update_bytes),
            outer_key=outer_key, outer_checksum=outer_sum, decisions=decisions, cursors=cursors,
            tokens_total=self.manifest.tokens_total + merged_tokens,
            timing={"quorum_wait_s": quorum_wait, "grace_s": grace, "merge_s": merge_s},
            stats={"update_norm": result.update_norm, "num_learners": float(num_groups), "round_share": result.scale,
                   "update_bytes": float(len(result.update_bytes))},
        )
        try:
            commit(store, keys, manifest)
        except Conflict:
            log.info("merger %s lost the race for version %d; reloading", self.merger_id, version)
            self.events.emit("commit_conflict", version=version)
            self.load()
            return None
        self.stage_hook("after_manifest")
        self.params, self.outer, self.manifest, self.ema = result.params, result.outer, manifest, ema
        self.events.emit("merge", version=version, merged=[f"{d.learner}/{d.seq}" for d in manifest.merged()],
                         rejected=len(manifest.rejected()), tokens=merged_tokens, merge_s=merge_s)
        return manifest

    def _next_ema(self, phase_times: list[float], quorum_wait: float, merge_s: float) -> dict[str, float]:
        ema = dict(self.ema)
        obs = {"quorum_s": quorum_wait, "merge_s": merge_s}
        if phase_times:
            obs["phase_s"] = sum(phase_times) / len(phase_times)
        for k, v in obs.items():
            ema[k] = v if ema[k] == 0.0 else (1 - EMA) * ema[k] + EMA * v
        return ema


def run_merger(merger: Merger, *, max_merges: int | None = None, target_version: int | None = None,
               should_stop: Callable[[], bool] = lambda: False,
               on_merge: Callable[[Manifest], None] | None = None,
               merge: Callable[[Merger, Callable[[], bool]], Manifest | None] | None = None) -> int:
    """Merge until stopped, the target version is committed, or max_merges merges were made.
    `merge` is the unit a Prefect flow wraps as a task (default: Merger.merge_once)."""
    merge = merge or (lambda m, stop: m.merge_once(stop))
    merges, backoff = 0, Backoff(*STORAGE_BACKOFF_S)
    merger.load()
    while not should_stop():
        if target_version is not None and merger.version >= target_version:
            break
        if max_merges is not None and merges >= max_merges:
            break
        try:
            manifest = merge(merger, should_stop)
            backoff.reset()
        except StorageError as err:
            wait_s = backoff.next_s()
            log.warning("merge failed on storage (%s); retrying in %.1fs", err, wait_s)
            merger.events.emit("storage_error", reason=str(err))
            time.sleep(wait_s)
            with contextlib.suppress(StorageError):
                merger.load()
            continue
        if manifest is not None:
            merges += 1
            if on_merge:
                on_merge(manifest)
        merger.events.flush()
    merger.events.flush()
    return merges

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

from diloco.merger.inplace import outer_step_in_place
from diloco.merger.step import (
    GradientStream,
    LearnerGroup,
    OuterState,
    gradient_stream,
    outer_optimizer,
)
from diloco.merger.version_state import VersionState
from diloco.run.buffers import version_buffers
from diloco.run.context import RunContext, direct_names
from diloco.run.controls import read_ops
from diloco.run.events import EventLog
from diloco.run.heap import release_freed_memory
from diloco.run.objects import put_checksummed, verify_written, write_state
from diloco.run.target import Target
from diloco.storage import (
    Conflict,
    DeltaDecision,
    Manifest,
    NotFound,
    RunKeys,
    StorageError,
    Store,
    commit,
    manifest_exists,
    read_latest,
)
from diloco.storage.errors import Backoff
from diloco.storage.keys import InvalidName, new_nonce, parse_delta_key
from diloco.training.tensors import Tensors
from diloco.trust.guard import Policy, entry_of, fold, gate, policy_after, state_of
from diloco.trust.judge import Judge
from diloco.trust.signing import SigningError

log = logging.getLogger("diloco.merger")
CONTROLS_EVERY_S = 1.0  # control ops (pause, set, admit, ...) are listed at most this often while waiting
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


def deltas_after(store: Store, keys: RunKeys, cursors: dict[str, int]) -> dict[str, list[int]]:
    """Per learner, the seqs of its deltas after its cursor (sorted; a learner without any: absent). One listing of
    the learners' folders, then one per learner from its cursor's key on (S3's StartAfter): O(learners + new
    deltas) a poll, not O(every delta of the run). A folder that is not a learner's name holds no delta."""
    found: dict[str, list[int]] = {}
    for learner in store.folders(keys.deltas_prefix()):
        try:
            prefix = keys.deltas_prefix(learner)
        except InvalidName:
            continue
        cursor = cursors.get(learner, -1)
        for key in store.list(prefix, keys.delta(learner, cursor) if cursor >= 0 else ""):
            parsed = parse_delta_key(key)
            if parsed and parsed[0] == learner and parsed[1] > cursor:
                found.setdefault(learner, []).append(parsed[1])
    return found


class Merger:
    """Drive with load() once, then merge_once() in a loop."""

    keep_state = True  # keep the new params and outer state after a commit (False: freed while written)

    def __init__(self, ctx: RunContext, merger_id: str = "merger", events: EventLog | None = None,
                 stage_hook: Callable[[str], None] | None = None,
                 keyring: dict[str, list[bytes]] | None = None) -> None:
        self.ctx, self.base_cfg, self.merger_id = ctx, ctx.cfg, merger_id
        self.cfg = ctx.cfg  # the live config of the next merge (run.json's + `diloco set`), see refresh_policy
        self.keyring = keyring  # learner -> keys, when learner.sign is on (trust/signing.py)
        if self.cfg.learner.sign and keyring is None:
            raise SigningError("learner.sign is on: the merger needs a keyring (DILOCO_KEYRING or DILOCO_KEYRING_BLOCK)")
        self._controls_at = 0.0
        torch.set_num_threads(1)  # reductions in one fixed order: `audit` replays them bit for bit
        self.events = events or EventLog(None, None, merger_id)
        self.stage_hook = stage_hook or (lambda stage: None)  # chaos: kill at a named stage
        self.gap_seen: dict[tuple[str, int], float] = {}
        self.ema = {"phase_s": 0.0, "quorum_s": 0.0, "merge_s": 0.0}
        self.state = VersionState(ctx)  # the version's params and outer state, read when a merge needs them

    # ---- state ---------------------------------------------------------------------------
    def load(self) -> int:
        """Read the newest manifest and the bytes of its outer state (their header carries the grace
        window's moving averages); the params and the outer state are decoded when a merge needs them."""
        manifest = read_latest(self.ctx.store, self.ctx.keys)
        if manifest is None:
            raise RuntimeError(f"run {self.ctx.run_id} has no version 0")
        self.manifest = manifest
        self.ema.update({k: v for k, v in self.state.reset(manifest).items() if k in self.ema})
        if not self.ctx.layout:  # a run without a layout: its params are the layout, read now
            _ = self.state.params
        self.policy = Policy(state_of(manifest, self.ctx.learners), [], self.base_cfg)
        self._controls_at = 0.0
        self.refresh_policy()
        return manifest.version

    @property
    def params(self) -> Tensors:
        """The params of self.manifest's version (read on first use)."""
        return self.state.params

    @property
    def outer(self) -> OuterState:
        """The outer state of self.manifest's version (decoded on first use; zeros before any merge)."""
        return self.state.outer

    @property
    def version(self) -> int:
        return self.manifest.version

    def refresh_policy(self, force: bool = True) -> Policy:
        """Apply the control ops filed after the last merge's to the last merge's guard state (at most once
        every CONTROLS_EVERY_S unless forced); a bucket in trouble keeps the policy as it was."""
        if not force and time.time() - self._controls_at < CONTROLS_EVERY_S:
            return self.policy
        self._controls_at = time.time()
        state = state_of(self.manifest, self.ctx.learners)
        try:
            entries = [entry_of(name, op) for name, op in read_ops(self.ctx.store, self.ctx.keys, state.ops_cursor)]
        except StorageError as err:
            log.warning("control ops unreadable (%s); merging by the last policy", err)
            return self.policy
        self.policy = policy_after(state, entries, self.base_cfg)
        self.cfg = self.policy.cfg
        return self.policy

    def wait_while_paused(self, should_stop: Callable[[], bool]) -> bool:
        """Block while merges are paused (`diloco pause-merges`); False when stopped meanwhile."""
        if self.policy.state.paused:
            log.info("merges of run %s are paused", self.ctx.run_id)
            self.events.emit("paused", version=self.version)
        while self.policy.state.paused:
            if should_stop():
                return False
            time.sleep(min(CONTROLS_EVERY_S, self.cfg.merger.poll_interval_s * 5))
            self.refresh_policy(force=False)
        return True

    # ---- discovery -----------------------------------------------------------------------
    def pending(self) -> Pending:
        """List deltas (never cached); per learner the contiguous seqs after the cursor; old gaps lost."""
        found = deltas_after(self.ctx.store, self.ctx.keys, self.manifest.cursors)
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
        t0 = time.time()
        while not should_stop():
            if manifest_exists(self.ctx.store, self.ctx.keys, self.version + 1):
                return None  # another merger moved on: reload first
            policy, cfg = self.refresh_policy(force=False), self.cfg.merger
            if policy.state.paused:
                return None
            quorum = min(cfg.quorum, max(1, len(policy.state.members)))
            pending = self.pending()
            ready = sum(1 for name, seqs in pending.ready.items() if seqs and policy.eligible(name))
            waited = time.time() - t0
            if ready >= quorum or (ready and waited >= cfg.quorum_timeout_s):
                return pending, waited
            time.sleep(cfg.poll_interval_s)
        return None

    def grace_s(self) -> float:
        """Adaptive grace window: gamma * (phase - quorum wait - merge time), clamped to [0, cap]."""
        cfg = self.cfg.merger
        slack = self.ema["phase_s"] - self.ema["quorum_s"] - self.ema["merge_s"]
        return min(max(cfg.grace_gamma * slack, 0.0), cfg.grace_cap_s)

    def grace_window(self, pending: Pending) -> tuple[float, Pending]:
        """Wait up to grace_s() for more deltas, listing them every poll interval; over at once when every
        learner that may publish (the members, less the removed and quarantined) has a delta pending: nobody
        is left to wait for. Returns (seconds waited, what is pending at its end)."""
        limit, t0 = self.grace_s(), time.time()
        state = self.policy.state
        expected = set(state.members or self.ctx.learners) - set(state.removed) - set(state.quarantined)
        while not (expected and expected <= set(pending.ready)):
            left = limit - (time.time() - t0)
            if left <= 0:
                break
            time.sleep(min(self.cfg.merger.poll_interval_s, left))
            pending = self.pending()
        return time.time() - t0, pending

    # ---- one merge -----------------------------------------------------------------------
    def merge_once(self, should_stop: Callable[[], bool] = lambda: False) -> Manifest | None:
        """One outer step; None when stopped or when another merger committed first (reloaded)."""
        if manifest_exists(self.ctx.store, self.ctx.keys, self.version + 1):
            self.load()
            return None
        self.refresh_policy()
        if not self.wait_while_paused(should_stop):
            return None
        self.stage_hook("listing")
        got = self.wait_for_quorum(should_stop)
        if got is None:
            if not should_stop() and not self.policy.state.paused:
                self.load()
            return None
        pending, quorum_wait = got
        grace, pending = self.grace_window(pending)
        # the ops read after the deltas were listed: a writer admitted just before its first delta (op, then
        # delta) is admitted in this merge, never rejected as unknown by a policy read before its op landed
        if self.refresh_policy().state.paused:
            return None
        t0 = time.time()
        policy = self.policy  # frozen for this merge: the ops it applies, the config it merges by
        decisions, stream, phase_times, judge = self._decide(pending, policy)
        optimizer = outer_optimizer(policy.cfg, len(self.ctx.learners))
        judge.scratch.release()
        finished = stream.finish()  # the fp64 sums become the fp32 pseudo-gradient before the params are read
        params, outer = self.state.take(judge.params)
        result = outer_step_in_place(params, outer, stream, self.ctx.fingerprint, optimizer, finished)
        del params, outer, finished
        release_freed_memory()  # the step's freed temporaries, before the objects are written
        for d in decisions:
            if d.status == "merged":
                d.weight = result.weights.get(d.learner, 0.0)
        guard, newly = fold(policy.state, decisions, self.version + 1, policy.cfg)
        median = judge.median()
        trust = {"guard": guard, "controls": policy.entries,
                 "stats": {} if median is None else {"outlier_median": median,
                                                     "outlier_bound": median * policy.cfg.merger.outlier_threshold}}
        manifest = self._write_and_commit(decisions, len(stream.weights), result, quorum_wait, grace, t0,
                                          phase_times, trust)
        if manifest is not None:
            for name in newly:
                self.events.emit("quarantine", learner=name, version=manifest.version, reason=guard.quarantined[name])
                log.warning("learner %s quarantined: %s", name, guard.quarantined[name])
            for entry in policy.entries:
                self.events.emit("control_applied", version=manifest.version, op=entry.name, op_kind=entry.kind,
                                 learner=entry.learner, values=entry.values, by=entry.by, refused=entry.refused)
        return manifest

    def _decide(self, pending: Pending, policy: Policy) -> tuple[list[DeltaDecision], GradientStream, list[float], Judge]:
        """Read, judge and fold the deltas learner by learner (streamed: memory does not grow
        with the number of learners); a learner that may not publish is rejected without a read."""
        decisions: list[DeltaDecision] = []
        layout = self.state.layout()
        stream = gradient_stream(layout, self.version, policy.cfg.outer, direct_names(self.ctx, layout), self.ctx.buffers)
        judge = Judge(self.ctx.run_id, self.ctx.fingerprint, self.version, layout, policy, self.keyring, buffers=self.ctx.buffers)
        phase_times: list[float] = []
        for learner, seqs in sorted(pending.lost.items()):
            for seq in seqs:
                decisions.append(DeltaDecision(
                    learner=learner, seq=seq, status="lost",
                    reason=f"seq {seq} missing for over {policy.cfg.merger.gap_timeout_s:g}s while later seqs arrived"))
        for learner, seqs in sorted(pending.ready.items()):
            group = LearnerGroup(learner)
            for seq in seqs:
                decision, header, delta = gate(policy, learner, seq), None, None
                if decision is None:
                    decision, header, delta = self._read_one(judge, learner, seq)
                decisions.append(decision)
                if decision.status == "merged":
                    group.add(seq, header, delta)
                    phase_times.append(float(header.meta.get("phase_time_s", 0.0) or 0.0))
                elif decision.status == "rejected":
                    log.warning("rejected %s/%d: %s", learner, seq, decision.reason)
                    self.events.emit("rejected", learner=learner, seq=seq, reason=decision.reason,
                                     check=decision.check, version=self.version)
            if group.seqs:
                stream.add(group)
        return decisions, stream, phase_times, judge

    def _read_one(self, judge: Judge, learner: str, seq: int):
        """Fetch one delta (its size first: an oversized one is never read) and its signature, then judge it."""
        key = self.ctx.keys.delta(learner, seq)
        try:
            size = self.ctx.store.get_size(key)
            data = self.ctx.store.get(key) if size <= judge.max_bytes else None
            signature = self._signature(learner, seq) if judge.cfg.learner.sign and data is not None else None
        except NotFound:
            return DeltaDecision(learner=learner, seq=seq, status="lost", reason="object vanished after listing"), \
                None, None
        return judge.judge(learner, seq, size, data, signature)

    def _signature(self, learner: str, seq: int) -> bytes | None:
        try:
            return self.ctx.store.get(self.ctx.keys.signature(learner, seq))
        except NotFound:
            return None

    def _write_and_commit(self, decisions, num_groups, result, quorum_wait, grace, t0, phase_times, trust):
        keys, store, version = self.ctx.keys, self.ctx.store, self.version + 1
        nonce = new_nonce()
        self.stage_hook("writing")
        params_key, update_key, outer_key = keys.params(version, nonce), keys.update(version, nonce), keys.outer(version, nonce)
        update_sum, update_bytes = put_checksummed(store, update_key, result.update_bytes), len(result.update_bytes)
        verify_written(store, update_key, update_sum, f"version {version}'s update")  # what every learner installs
        consume = not self.keep_state  # each tensor freed once encoded: the object and the tensors never both whole
        if consume:
            result.update_bytes = b""
            self.state.forget()
        _, params_sum = write_state(store, params_key, result.params, kind="params",
                                    fingerprint=self.ctx.fingerprint, consume=consume)
        merge_s = time.time() - t0
        ema = self._next_ema(phase_times, quorum_wait, merge_s)
        outer_tensors = result.outer.to_tensors()
        if consume:
            result.outer = OuterState({}, {})
        _, outer_sum = write_state(store, outer_key, outer_tensors, kind="outer",
                                   fingerprint=self.ctx.fingerprint, meta={"ema": ema}, consume=consume)
        del outer_tensors
        buffers = version_buffers(self.ctx, self.manifest, result.buffers, version, nonce)  # {}: the run has none
        self.stage_hook("before_manifest")
        cursors = dict(self.manifest.cursors)
        for d in decisions:
            cursors[d.learner] = max(cursors.get(d.learner, -1), d.seq)
        merged_tokens = sum(d.tokens for d in decisions if d.status == "merged")
        manifest = Manifest(
            run_id=self.ctx.run_id, version=version, parent=self.version, created_at=time.time(),
            merger_id=self.merger_id, params_key=params_key, params_checksum=params_sum,
            update_key=update_key, update_checksum=update_sum,
            outer_key=outer_key, outer_checksum=outer_sum, decisions=decisions, cursors=cursors,
            tokens_total=self.manifest.tokens_total + merged_tokens,
            timing={"quorum_wait_s": quorum_wait, "grace_s": grace, "merge_s": merge_s},
            stats={"update_norm": result.update_norm, "num_learners": float(num_groups), "round_share": result.scale,
                   "update_bytes": float(update_bytes), **trust["stats"]},
            guard=trust["guard"], controls=trust["controls"], **buffers,
        )
        try:
            commit(store, keys, manifest)
        except Conflict:
            log.info("merger %s lost the race for version %d; reloading", self.merger_id, version)
            self.events.emit("commit_conflict", version=version)
            self.load()
            return None
        self.stage_hook("after_manifest")
        self.manifest, self.ema = manifest, ema
        if self.keep_state:  # the new global and outer state, kept for the next merge (else read again)
            self.state.keep(manifest, result.params, result.outer)
        else:
            self.state.forget(manifest)
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
               target_tokens: int = 0, should_stop: Callable[[], bool] = lambda: False,
               on_merge: Callable[[Manifest], None] | None = None,
               merge: Callable[[Merger, Callable[[], bool]], Manifest | None] | None = None) -> int:
    """Merge until stopped, the target version is committed (or `target_tokens` > 0 merged), or max_merges
    merges were made.
    `merge` is the unit a Prefect flow wraps as a task (default: Merger.merge_once)."""
    merge = merge or (lambda m, stop: m.merge_once(stop))
    merges, backoff = 0, Backoff(*STORAGE_BACKOFF_S)
    merger.load()
    target = None if target_version is None else Target(target_version, target_tokens)
    while not should_stop():
        if target is not None and target.reached_by(merger.manifest):
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

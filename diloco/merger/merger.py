"""The outer merger of one chain (the root's, or a fragment's): wait for a quorum of learners and a grace
window, validate, merge, commit.

Contract (DESIGN §6): a delta is merged at most once (the manifest cursor), every delta is eventually
merged, rejected or declared lost with a reason, a bad delta never stops the merge, and a lost commit race
(Conflict) only means rebuilding the winner's state from the log. A version writes its update and its
manifest; the chain's params and outer state stay in memory between merges and reach the bucket as a
checkpoint every `state.checkpoint_every` versions, in the background (diloco.merger.checkpointer). `due()`
looks at the chain without blocking (one HEAD, the listings after the cursors); `merge_once()` waits until
it is due, then merges: the unit a Prefect flow wraps as a task. The loop over a merger's chains is
diloco.merger.loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from diloco.merger.checkpointer import ChainCheckpoints, CheckpointWriter
from diloco.merger.decide import decide
from diloco.merger.inplace import outer_step_in_place
from diloco.merger.plan import MergePlan
from diloco.merger.step import (
    MergeArenas,
    OuterState,
    StepResult,
    outer_optimizer,
)
from diloco.merger.version_state import VersionState
from diloco.merger.waiting import Pending, Wait, deltas_after, plausible_ahead
from diloco.run.buffers import version_buffers
from diloco.run.context import RunContext
from diloco.run.controls import OpsFeed
from diloco.run.events import EventLog
from diloco.run.objects import put_checksummed, verify_written
from diloco.storage import (
    Conflict,
    Manifest,
    StorageError,
    commit,
    manifest_exists,
    read_latest,
    read_manifest,
)
from diloco.storage.keys import new_nonce
from diloco.storage.window import with_window, write_window
from diloco.training.tensors import Tensors
from diloco.trust.guard import Policy, entry_of, fold, policy_after, state_of
from diloco.trust.signing import SigningError

log = logging.getLogger("diloco.merger")
CONTROLS_EVERY_S = 1.0  # control ops (pause, set, admit, ...) are listed at most this often while waiting
# the learners' folders under deltas/ are listed at most this often while every member has one (a look lists
# each learner's folder after its cursor; a new folder then is a never-admitted writer's, rejected once found)
FOLDERS_EVERY_S = 10.0
EMA = 0.3  # weight of the newest observation in the grace-window moving averages


class Merger:
    """One chain's merger: load() once, then merge_once() in a loop (or due() and merge_once() once it is)."""

    def __init__(self, ctx: RunContext, merger_id: str = "merger", events: EventLog | None = None,
                 stage_hook: Callable[[str], None] | None = None,
                 keyring: dict[str, list[bytes]] | None = None,
                 checkpoints: ChainCheckpoints | None = None, ops: OpsFeed | None = None,
                 arenas: MergeArenas | None = None) -> None:
        self.ctx, self.base_cfg, self.merger_id = ctx, ctx.cfg, merger_id
        self.cfg = ctx.cfg  # the next merge's live config (run.json's + `diloco set`), see refresh_policy
        self.keyring = keyring  # learner -> keys, when learner.sign is on (trust/signing.py)
        if self.cfg.learner.sign and keyring is None:
            raise SigningError("learner.sign is on: the merger needs a keyring (DILOCO_KEYRING or "
                               "DILOCO_KEYRING_BLOCK)")
        self._controls_at = 0.0
        # the run's control ops: a shard's chains share one feed (diloco.merger.loop)
        self.ops = ops or OpsFeed(ctx.store, ctx.keys, CONTROLS_EVERY_S)
        self._folders: set[str] = set()  # the folders under deltas/ at their last listing (pending) ...
        self._folders_at = -FOLDERS_EVERY_S  # ... and when (time.monotonic())
        torch.set_num_threads(1)  # reductions in one fixed order: `audit` replays them bit for bit
        self.events = events or EventLog(None, None, merger_id)
        self.stage_hook = stage_hook or (lambda stage: None)  # chaos: kill at a named stage
        self.gap_seen: dict[tuple[str, int], float] = {}
        self._ignored_said: set[str] = set()  # learners whose implausible keys were reported (once a process)
        self._strangers: set[str] = set()  # never-admitted names already rejected: their folders go unlisted
        self.ema = {"phase_s": 0.0, "quorum_s": 0.0, "merge_s": 0.0}
        # the memory its merges use, kept between them (a shard's chains share it: they merge one at a time)
        self.arenas = arenas or MergeArenas()
        # the chain's params and outer state, held between merges
        self.state = VersionState(ctx, self.arenas.sums)
        # its checkpoints (a process's chains share one writer thread: diloco.merger.loop)
        self.checkpoints = checkpoints or ChainCheckpoints(ctx, CheckpointWriter(), merger_id, self.events,
                                                           self.stage_hook)
        # a merge whose commit failed on storage: (version, update key, its result, moving averages) — if its
        # manifest landed after all, the next load takes it as the state instead of rebuilding it from the log
        self._candidate: tuple[int, str, StepResult, dict[str, float]] | None = None
        self.manifest: Manifest | None = None  # the chain's newest version (load)
        self.wait: Wait | None = None  # the next merge's wait, from the first look after a commit or load
        self._paused = False  # the pause was reported (event, log)

    @property
    def chain(self) -> str:
        """`fragment <p>`, or `the root chain`: how logs and errors name it."""
        fragment = self.ctx.keys.fragment
        return "the root chain" if fragment is None else f"fragment {fragment}"

    # ---- state ---------------------------------------------------------------------------
    def load(self) -> int:
        """Hold the chain's newest version: its manifest, and its params and outer state — replayed from the
        version held (another merger committed since), or rebuilt from the newest checkpoint and the merges
        after it (at start, after a lost race or a failed commit), every replayed update checked against
        the committed one (ReplayMismatch otherwise: the merger stops)."""
        manifest = read_latest(self.ctx.store, self.ctx.keys)
        if manifest is None:
            raise RuntimeError(f"run {self.ctx.run_id} ({self.chain}) has no version 0")
        manifest = with_window(self.ctx.store, self.ctx.keys, manifest)  # the window judged by: not inline
        self.checkpoints.wait()  # a checkpoint still copying the held tensors: they change next
        self._settle_candidate(manifest)
        self.manifest, self.wait = manifest, None
        self.ema.update({k: v for k, v in self.state.load(manifest).items() if k in self.ema})
        self.checkpoints.reset(self.state.held.checkpoint)
        self.policy = Policy(state_of(manifest, self.ctx.learners), [], self.base_cfg)
        self._controls_at = 0.0
        self.refresh_policy()
        return manifest.version

    def _settle_candidate(self, newest: Manifest) -> None:
        """A merge whose commit failed on storage: held as the state if its manifest landed after all."""
        candidate, self._candidate = self._candidate, None
        if candidate is None or newest.version < candidate[0]:
            return
        version, update_key, result, ema = candidate
        committed = newest if newest.version == version else \
            read_manifest(self.ctx.store, self.ctx.keys, version)
        if committed.update_key == update_key:  # ours: the reply was lost, not the commit
            self.state.keep(committed, result.params, result.outer, ema)

    def close(self) -> None:
        """Wait for the checkpoints in flight (the process ends next)."""
        self.checkpoints.writer.close()
        self.checkpoints.landed()

    @property
    def params(self) -> Tensors:
        """The params of self.manifest's version, held."""
        return self.state.params

    @property
    def outer(self) -> OuterState:
        """The outer state of self.manifest's version, held (zeros before any merge)."""
        return self.state.outer

    @property
    def version(self) -> int:
        return self.manifest.version

    def refresh_policy(self, force: bool = True) -> Policy:
        """Apply the control ops filed after the last merge's to the last merge's guard state (at most once
        every CONTROLS_EVERY_S unless forced: then as the shard's chains listed them under CONTROLS_EVERY_S
        ago, else listed now); a bucket in trouble keeps the policy as it was."""
        if not force and time.time() - self._controls_at < CONTROLS_EVERY_S:
            return self.policy
        self._controls_at = time.time()
        state = state_of(self.manifest, self.ctx.learners)
        try:
            entries = [entry_of(name, op) for name, op in self.ops.read(state.ops_cursor, newest=force)]
        except StorageError as err:
            log.warning("control ops unreadable (%s); merging by the last policy", err)
            return self.policy
        self.policy = policy_after(state, entries, self.base_cfg)
        self.cfg = self.policy.cfg
        return self.policy

    # ---- waiting -------------------------------------------------------------------------
    def pending(self, every_folder: bool = True) -> Pending:
        """List deltas (never cached); per learner the contiguous seqs after the cursor; an old gap lost, as
        one range. Admission first, and bounded work per key: a name that is no member's (never admitted) and
        a seq further past its member's cursor than it can be (waiting.plausible_ahead) are ignored, each
        reported once (an `ignored` event), never decided one by one, never given a cursor. Without
        `every_folder`, the learners' folders are those listed last while every member has one and that was
        under FOLDERS_EVERY_S ago (due() lists them at a wait's start): a member's first delta is found at
        once, a never-admitted writer's by the next merge or within FOLDERS_EVERY_S, and a look costs one
        request a learner."""
        out, now, clock = Pending(), time.time(), time.monotonic()
        state, ahead = self.policy.state, plausible_ahead(self.cfg.learner.max_unmerged)
        known = {*state.members, *state.removed, *self.manifest.cursors}  # removed members' still decided
        unseen = not set(state.members) <= self._folders  # a member without a folder: listed till it has one
        if every_folder or unseen or clock - self._folders_at >= FOLDERS_EVERY_S:
            self._folders = set(self.ctx.store.folders(self.ctx.keys.deltas_prefix()))
            self._folders_at = clock
        found = deltas_after(self.ctx.store, self.ctx.keys, self.manifest.cursors, self._strangers,
                             sorted(self._folders))
        self._strangers -= known  # admitted since: listed and decided as every member's
        for learner, seqs in sorted(found.items()):
            seqs.sort()
            if learner not in known:  # never admitted: one rejection for all its keys, never listed again
                out.strangers[learner] = (seqs[0], seqs[-1])
                continue
            expected = self.manifest.cursors.get(learner, -1) + 1
            far = [s for s in seqs if s >= expected + ahead]
            if far:
                out.ignored[learner] = far
                self._report_ignored(learner, far, expected + ahead)
                seqs = [s for s in seqs if s < expected + ahead]
                if not seqs:
                    continue
            if seqs[0] > expected:
                first_seen = self.gap_seen.setdefault((learner, expected), now)
                if now - first_seen < self.cfg.merger.gap_timeout_s:
                    continue  # a gap waits ...
                out.lost[learner] = (expected, seqs[0] - 1)  # ... then is declared lost: one range
                expected = seqs[0]
            run = []
            for s in seqs:
                if s != expected:
                    break
                run.append(s)
                expected += 1
            out.ready[learner] = run
        return out

    def _report_ignored(self, learner: str, seqs: list[int], limit: int) -> None:
        """Say once per merger process and learner what it ignores (a log line and an `ignored` event)."""
        if learner in self._ignored_said:
            return
        self._ignored_said.add(learner)
        why = f"seq {seqs[0]} is past {limit - 1}: further ahead of its cursor than a learner can be"
        log.warning("ignoring %d delta key(s) of %s: %s", len(seqs), learner, why)
        self.events.emit("ignored", learner=learner, seqs=seqs[:8], count=len(seqs), reason=why,
                         version=self.version)

    def grace_s(self) -> float:
        """Adaptive grace window: gamma * (phase - quorum wait - merge time), clamped to [0, cap]."""
        cfg = self.cfg.merger
        slack = self.ema["phase_s"] - self.ema["quorum_s"] - self.ema["merge_s"]
        return min(max(cfg.grace_gamma * slack, 0.0), cfg.grace_cap_s)

    def due(self) -> bool:
        """One look at the chain, never blocking (a HEAD of the next version, the control ops at most once a
        second, the listings after the cursors): whether its next merge should run now. The wait starts at the
        first look after a commit or a load; another merger's commit reloads (and the wait starts again), a
        pause ends it. Due once a quorum of eligible learners has deltas pending (or any has, quorum_timeout_s
        into the wait), then once the grace window after the quorum is over or every learner that may publish
        (the members, less the removed and quarantined) has a delta pending: nobody is left to wait for."""
        now, first = time.time(), self.wait is None
        if first:
            self.wait = Wait(now)
            self.refresh_policy()  # the guard state of the version just committed or loaded, the ops since
            self.stage_hook("listing")
        wait = self.wait
        if wait.ready is not None:
            return True
        if manifest_exists(self.ctx.store, self.ctx.keys, self.version + 1):
            self.load()  # another merger moved on: wait again, on top of its version
            return False
        policy, cfg = self.refresh_policy(force=False), self.cfg.merger
        if policy.state.paused:
            self._note_pause(wait, now)
            return False
        self._paused = False
        pending = self.pending(every_folder=first)  # the learners' folders listed again at a wait's start
        if wait.quorum_at is None:
            eligible = sum(1 for name, seqs in pending.ready.items() if seqs and policy.eligible(name))
            if not wait.quorum_reached(eligible, min(cfg.quorum, max(1, len(policy.state.members))),
                                       cfg.quorum_timeout_s, now):
                return False
            wait.grace_s = self.grace_s()
        state = policy.state
        expected = set(state.members or self.ctx.learners) - set(state.removed) - set(state.quarantined)
        if (expected and expected <= set(pending.ready)) or wait.grace_over(now):
            wait.end(pending, now)
            return True
        return False

    def _note_pause(self, wait: Wait, now: float) -> None:
        """Merges are paused (`diloco pause-merges`): said once per pause; the wait starts again after it."""
        wait.since, wait.quorum_at = now, None
        if not self._paused:
            self._paused = True
            log.info("merges of run %s are paused", self.ctx.run_id)
            self.events.emit("paused", version=self.version)

    def sleep_s(self) -> float:
        """How long to sleep before the next look at the chain."""
        poll_s = self.cfg.merger.poll_interval_s
        return poll_s if self.wait is None else self.wait.sleep_s(poll_s, time.time())

    def take_waiting(self) -> bool:
        """Make the deltas waiting now due at once, whatever the quorum and the grace window (a run's end: a
        cohort's last ships below the quorum); False if no eligible learner has any, or merges are paused."""
        if manifest_exists(self.ctx.store, self.ctx.keys, self.version + 1):
            self.load()
        policy = self.refresh_policy()
        if policy.state.paused:
            return False
        pending, now = self.pending(), time.time()
        if not any(seqs and policy.eligible(name) for name, seqs in pending.ready.items()):
            return False
        self.wait = wait = self.wait or Wait(now)
        wait.quorum_at = wait.quorum_at or now
        wait.end(pending, now)
        return True

    # ---- one merge -----------------------------------------------------------------------
    def merge_once(self, should_stop: Callable[[], bool] = lambda: False) -> Manifest | None:
        """Wait until the chain is due (due()), then one outer step; None when stopped, or when another merger
        committed first (reloaded). Called once the chain is due, it merges at once."""
        version = self.version
        while not should_stop():
            if self.due():
                return self._merge(self.wait)
            if self.version != version:
                return None
            time.sleep(self.sleep_s())
        return None

    def _merge(self, wait: Wait) -> Manifest | None:
        self.wait = None  # whatever happens next, the next merge waits anew
        # the ops read after the deltas were listed: a writer admitted just before its first delta (op, then
        # delta) is admitted in this merge, never rejected as unknown by a policy read before its op landed
        if self.refresh_policy().state.paused:
            return None
        t0 = time.time()
        policy = self.policy  # frozen for this merge: the ops it applies, the config it merges by
        decisions, stream, phase_times, judge = decide(self.ctx, self.version, self.state.layout(),
                                                       wait.ready, policy, self.keyring, self._strangers,
                                                       self.events, self.arenas)
        optimizer = outer_optimizer(policy.cfg, len(self.ctx.learners))
        judge.scratch.release()
        # the fp64 sums become the fp32 pseudo-gradient before the step, in the folded deltas' buffers
        finished = stream.finish(into=judge.reuse.tensor)
        judge.reuse = None  # what the pseudo-gradient did not take is let go before the step
        self.checkpoints.before_step(self.version + 1, self.state.snapshot)  # no checkpoint copying the state
        params, outer = self.state.take(judge.params)
        result = outer_step_in_place(params, outer, stream, self.ctx.fingerprint, optimizer, finished)
        # no malloc_trim here: the step's freed temporaries stay in the heap for the next merge's (a trim
        # after every chain's merge made each fault them in again: 400k page faults a round at P = 24)
        del params, outer, finished
        for d in decisions:
            if d.status == "merged":
                d.weight = result.weights.get(d.learner, 0.0)
        guard, newly = fold(policy.state, decisions, self.version + 1, policy.cfg, self.ctx.trust_rules)
        median = judge.median()
        stats = {} if median is None else {"outlier_median": median,
                                           "outlier_bound": median * policy.cfg.merger.outlier_threshold}
        plan = MergePlan(decisions=decisions, result=result, num_learners=len(stream.weights),
                         quorum_wait_s=wait.quorum_wait_s, grace_s=wait.grace_waited_s, started_at=t0,
                         phase_times=phase_times, guard=guard, controls=policy.entries, stats=stats,
                         merged_tokens=stream.tokens)
        manifest = self._write_and_commit(plan)
        if manifest is not None:
            for name in newly:
                self.events.emit("quarantine", learner=name, version=manifest.version,
                                 reason=guard.quarantined[name])
                log.warning("learner %s quarantined: %s", name, guard.quarantined[name])
            for entry in policy.entries:
                self.events.emit("control_applied", version=manifest.version, op=entry.name,
                                 op_kind=entry.kind, learner=entry.learner, values=entry.values, by=entry.by,
                                 refused=entry.refused)
        return manifest

    def _write_and_commit(self, plan: MergePlan) -> Manifest | None:
        """Write the version's update under a fresh nonce (read back first), then commit its manifest by
        exclusive create, naming the newest checkpoint landed; None (the winner's state rebuilt) when
        another merger committed the version first. The params and outer state are not written: they stay
        held for the next merge."""
        keys, store, version, result = self.ctx.keys, self.ctx.store, self.version + 1, plan.result
        update_key = keys.update(version, new_nonce())
        self.stage_hook("writing")
        try:
            update_bytes = len(result.update_bytes)
            update_sum = put_checksummed(store, update_key, result.update_bytes)
            # read back: what every learner installs
            verify_written(store, update_key, update_sum, f"version {version}'s update")
            result.update_bytes = b""
            merge_s = time.time() - plan.started_at
            ema = self._next_ema(plan.phase_times, plan.quorum_wait_s, merge_s)
            buffers = version_buffers(self.ctx, self.manifest, result.buffers, version, new_nonce())
            if self.ctx.window_apart:  # the window in its own object, unpublished
                plan.guard.window = write_window(store, keys, version, plan.guard, plan.stats, plan.decisions)
            self.stage_hook("before_manifest")
            objects = {"update_key": update_key, "update_checksum": update_sum, "ema": ema,
                       "checkpoint": self.checkpoints.ref_for(version), **buffers}
            manifest = plan.manifest(self.manifest, self.merger_id, objects, merge_s, update_bytes)
            commit(store, keys, manifest)
        except Conflict:
            log.info("merger %s lost the race for version %d of %s; rebuilding the winner's state from the "
                     "log", self.merger_id, version, self.chain)
            self.events.emit("commit_conflict", version=version)
            del result
            plan.result = None
            self.load()
            return None
        except StorageError:
            self._candidate = (version, update_key, result, self.ema)  # kept if the manifest landed after all
            raise
        self.stage_hook("after_manifest")
        self.manifest, self.ema = manifest, ema
        self.state.keep(manifest, result.params, result.outer, ema)
        self.checkpoints.after_commit(manifest, result.params, result.outer, ema)
        self.events.emit("merge", version=version, merged=[f"{d.learner}/{d.seq}" for d in manifest.merged()],
                         rejected=len(manifest.rejected()), tokens=plan.merged_tokens, merge_s=merge_s)
        return manifest

    def _next_ema(self, phase_times: list[float], quorum_wait: float, merge_s: float) -> dict[str, float]:
        ema = dict(self.ema)
        obs = {"quorum_s": quorum_wait, "merge_s": merge_s}
        if phase_times:
            obs["phase_s"] = sum(phase_times) / len(phase_times)
        for k, v in obs.items():
            ema[k] = v if ema[k] == 0.0 else (1 - EMA) * ema[k] + EMA * v
        return ema

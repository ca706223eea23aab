"""The evaluator: the held-out loss of committed versions, written to evals/<version>.json.

Contract: version 0 first, then the newest version on the eval cadence, and the final version at the end;
storage trouble skips an evaluation (it is tried again), never ends the loop. It follows each chain's
updates from the version it last evaluated (a checkpoint only when far behind): u bytes a version, not a
params read.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from diloco.configs import checkpoint_every
from diloco.run.buffers import install_run_buffers
from diloco.run.context import RunContext, RunError
from diloco.run.events import EventLog
from diloco.run.fragments import ChainWatch, chain_followers, read_run_version, run_version
from diloco.run.objects import CorruptObject
from diloco.run.spec import build_model, check_layout, load_run_spec
from diloco.storage import NotFound, StorageError
from diloco.storage.records import EvalRecord, RecordError, read_record, write_record
from diloco.training.inner import evaluate, pick_device
from diloco.training.model import set_params
from diloco.training.spec import SpecError, TrainSpec

log = logging.getLogger("diloco.evaluator")


class Evaluator:
    """Held-out loss of committed versions, written to evals/<version>.json."""

    def __init__(self, ctx: RunContext, spec: TrainSpec | None = None,
                 events: EventLog | None = None) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg
        torch.set_num_threads(1)
        self.spec = spec or load_run_spec(ctx)
        if self.spec.eval_batches is None:
            raise SpecError("the spec has no eval_batches: there is no held-out metric to evaluate")
        # on the learners' device too (bf16 autocast on CUDA); a host without CUDA (the supervisor's, scoring
        # what the evaluator did not reach) scores on its CPU rather than fail a run whose learners have GPUs
        self.device = pick_device(self.cfg.learner.device if torch.cuda.is_available() else "cpu")
        self.model = build_model(self.spec, self.cfg.data.seed).to(self.device)
        check_layout(ctx, self.model, "the evaluator")
        self.batches = list(self.spec.eval_batches())
        self.events = events or EventLog(None, None, "evaluator")
        self.done: set[int] = set()
        self.watch = ChainWatch(ctx)  # its 0.5 s poll lists what is new on each chain, not every version
        # each chain's params held and moved on by the updates since (u bytes a version, not a params read); a
        # version more than a checkpoint interval ahead is read from its checkpoint
        self.followers = chain_followers(ctx, reach=checkpoint_every(ctx.cfg))

    def evaluate_version(self, version: int) -> dict:
        # fragments: put together
        params, tokens_total, committed_at = read_run_version(self.ctx, version, self.followers)
        set_params(self.model, params)
        install_run_buffers(self.ctx, self.model, version)  # the merged running statistics (BatchNorm, ...)
        loss = evaluate(self.model, self.batches, self.device, loss=self.spec.loss)
        metric = self.spec.metric_name
        record = EvalRecord(version=version, loss=loss, metric=metric,
                            bits_per_byte=loss / math.log(2) if metric == "nats/byte" else None,
                            tokens_total=tokens_total, t=time.time(), committed_at=committed_at)
        write_record(self.ctx.store, self.ctx.keys.eval(version), record)
        self.done.add(version)
        return record.model_dump()

    def due(self, latest: int, final: bool = False) -> int | None:
        """The version to evaluate next: 0 first, then the newest on the cadence, the last at the end."""
        if 0 not in self.done:
            return 0
        if latest in self.done:
            return None
        if final or latest % self.cfg.eval.every_versions == 0:
            return latest
        return None

    def next_due(self, final: bool = False) -> int | None:
        """The version to evaluate now, if any (one listing; storage trouble means none yet)."""
        try:
            latest = self.watch.run_version()
        except StorageError as err:
            log.warning("evaluation skipped: %s", err)
            return None
        return None if latest is None else self.due(latest, final)


def read_evals(ctx: RunContext) -> list[dict]:
    """Every readable eval record of the run (EvalRecord fields), by version; unreadable ones are skipped."""
    out = []
    for key in ctx.store.list(ctx.keys.evals_prefix()):
        try:
            out.append(read_record(ctx.store, key, EvalRecord))
        except (StorageError, RecordError):
            continue
    return [r.model_dump() for r in sorted(out, key=lambda r: r.version)]


def run_evaluator(evaluator: Evaluator, *, should_stop: Callable[[], bool], poll_s: float = 0.5,
                  evaluate: Callable[[Evaluator, int], dict | None] | None = None) -> int:
    """Evaluate committed versions until stopped, then the final one; returns how many.
    `evaluate` (default Evaluator.evaluate_version) is the unit a Prefect flow wraps as a task:
    it runs only when a version is due, never per poll."""
    evaluate = evaluate or (lambda ev, version: ev.evaluate_version(version))
    count = 0

    def once(final: bool) -> bool:
        nonlocal count
        version = evaluator.next_due(final)
        if version is None:
            return False
        try:
            evaluate(evaluator, version)
            count += 1
        except (StorageError, NotFound) as err:
            log.warning("evaluation of version %d skipped: %s", version, err)
            return False
        # that version cannot be read, ever: an incident, and the next ones go on
        except CorruptObject as err:
            log.error("evaluation of version %d impossible: %s", version, err)
            evaluator.events.emit("corrupt_object", version=version, reason=str(err)[:500])
            evaluator.done.add(version)
        return True

    while not should_stop():
        if not once(False):
            time.sleep(poll_s)
    while once(True):  # version 0 and the final version, if still missing
        pass
    evaluator.events.flush()
    return count


def missing_evals(ctx: RunContext) -> list[int]:
    """Of version 0 and the newest version, those with no eval record (StorageError from the bucket)."""
    latest = run_version(ctx) or 0
    done = {e["version"] for e in read_evals(ctx)}
    return [v for v in sorted({0, latest}) if v not in done]


def evaluate_missing(ctx: RunContext, spec: TrainSpec | None = None) -> list[int]:
    """Score, in this process, version 0 and the newest version when the evaluator did not (a short run can
    end before the evaluator's first start); returns the versions scored. A spec without eval_batches:
    none."""
    try:
        wanted = missing_evals(ctx)
    except StorageError as err:
        log.warning("final evaluation skipped: %s", err)
        return []
    if not wanted:
        return []
    done = []
    try:
        evaluator = Evaluator(ctx, spec)
        for version in wanted:
            evaluator.evaluate_version(version)
            done.append(version)
    except (SpecError, RunError, StorageError) as err:  # the run has ended: only these scores are lost
        log.warning("final evaluation skipped: %s", err)
    return done

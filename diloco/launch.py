"""The one launch entry: run a role of a run (learner, merger, evaluator) in this process.

Contract: `run_role(role, storage, run_id, name, ...)` builds the role from (storage URL, run id, name) and
runs it until the run stops, the target version is committed, its count is done or (a learner) an operator
removed it; the config comes from run.json in the bucket, never from the caller, so every process of a run
agrees on it; a run with a chaos control object gets its faults here (diloco.chaos), outside the core, and a
local run's supervisor its chaos agent (chaos_agent).
The CLI, the zygote, the local supervisor (`python -m diloco.launch <role> ...`, an internal protocol, not
the CLI) and the Prefect flows (which pass their task-wrapped units) all start roles through it.
A warm standby (`--standby`) pays the imports first and reads nothing from the bucket until started.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

ROLES = ("learner", "merger", "evaluator")
log = logging.getLogger("diloco.launch")


@dataclass
class Units:
    """The units of work a Prefect flow wraps as tasks; None: the plain call."""

    join: Callable[..., Any] | None = None  # (learner) -> version
    phase: Callable[..., Any] | None = None  # (learner, should_stop) -> PhaseStats
    # (a chain's merger, should_stop) -> Manifest | None, once it is due
    merge: Callable[..., Any] | None = None
    evaluate: Callable[..., Any] | None = None  # (evaluator, version) -> record


def make_learner(storage: str, run_id: str, name: str, world=None):
    """The learner `name` of the run, and its stop signal (removal, control/stop, the target version, a lost
    supervisor: diloco.run.signals.RoleStop, whose `why` is the learner's final state); `world`: this process
    is rank 0 of the learner's process group (diloco.learner.world)."""
    from diloco.chaos.inprocess import apply_chaos
    from diloco.learner.learner import Learner
    from diloco.run.context import open_run
    from diloco.run.events import EventLog
    from diloco.run.signals import RoleStop
    from diloco.storage.keys import validate_learner_name
    from diloco.storage.traffic import CountingStore

    validate_learner_name(name)
    # torch's lazy imports (~3 s: the optimizer's first step pulls torch._dynamo) belong to the start,
    # before the join, not to the first phase's time (goodput counts phase time as compute); a warm
    # standby or a forked learner has paid them already and this is then a few milliseconds
    warm_up()
    ctx = open_run(storage, run_id)
    check_admitted(ctx, name)
    key = signing_key() if ctx.cfg.learner.sign else None
    control = apply_chaos(ctx)
    ctx = dataclasses.replace(ctx, store=CountingStore(ctx.store))  # its traffic, for the run's summary
    slowdown = control.slowdown.get(name) if control else None
    # events are kept and flushed again on failure: one quick retry, so an outage does not stall each phase
    events = EventLog(ctx.store.with_retries(1), ctx.keys, name)
    learner = Learner(ctx, name, events=events, slowdown=slowdown, world=world, signing_key=key)
    # watched: the training thread asks between phases and at every probe, and must never wait on the bucket
    return learner, RoleStop(ctx, ctx.cfg.run.num_versions, learner=name).watch()


def make_merger(storage: str, run_id: str, merger_id: str = "merger"):
    """The merger of the run and its context: the chains its id owns (diloco.merger.loop.ShardMerger) — the
    root chain of a whole-model run, or for a fragmented run the shard its id names (`merger` = 0,
    `merger-s<k>` = k); a chaos plan may order it to kill itself at a stage."""
    from diloco.chaos.inprocess import MergerSaboteur, apply_chaos
    from diloco.merger.loop import ShardMerger
    from diloco.run.context import open_run
    from diloco.run.events import EventLog
    from diloco.run.fragments import shard_of_id
    from diloco.storage.keys import validate_learner_name

    validate_learner_name(merger_id)
    ctx = open_run(storage, run_id)
    raw_store = ctx.store
    control = apply_chaos(ctx)
    events = EventLog(ctx.store, ctx.keys, merger_id)
    hook = MergerSaboteur(ctx, raw_store, merger_id, events) if control else None
    keyring = keyring_of_env() if ctx.cfg.learner.sign else None
    # one chain: every id is its merger's (races included)
    shard = shard_of_id(merger_id) if ctx.fragments else 0
    return ShardMerger(ctx, shard, merger_id, events=events, stage_hook=hook, keyring=keyring), ctx


def load_secret(block_name: str) -> str:
    """The value of a Prefect Secret block (a signing key, or a keyring's JSON), read only when a *_BLOCK
    variable names one, so a plain run never imports Prefect; never logged. A missing block is a
    SigningError."""
    import json

    from prefect.blocks.system import Secret

    from diloco.trust.signing import SigningError

    try:
        value = Secret.load(block_name).get()
    except ValueError as err:  # Prefect raises ValueError for a block that does not exist
        raise SigningError(f"Prefect Secret block {block_name!r}: {err}") from None
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def _block_loader():
    return load_secret


def signing_key() -> bytes:
    """This learner's signing key: DILOCO_SIGNING_KEY, or the Secret block DILOCO_SIGNING_KEY_BLOCK names."""
    from diloco.trust.signing import KEY_BLOCK_ENV, learner_key

    return learner_key(load_block=_block_loader() if os.environ.get(KEY_BLOCK_ENV) else None)


def keyring_of_env(required: bool = True) -> dict[str, list[bytes]] | None:
    """The merger's (or audit's) keyring: DILOCO_KEYRING, or the Secret block DILOCO_KEYRING_BLOCK names."""
    from diloco.trust.signing import KEYRING_BLOCK_ENV, load_keyring

    return load_keyring(load_block=_block_loader() if os.environ.get(KEYRING_BLOCK_ENV) else None,
                        required=required)


def check_admitted(ctx, name: str) -> None:
    """A learner that may not publish in the run stops before it trains (its deltas would be rejected)."""
    from diloco.run.context import RunError
    from diloco.run.controls import membership

    member = membership(ctx.store, ctx.keys, ctx.learners)
    if name in member.removed:
        raise RunError(f"learner {name} was removed from run {ctx.run_id}")
    if not member.admitted(name):
        raise RunError(f"learner {name} is not admitted to run {ctx.run_id} (its learners: "
                       f"{', '.join(member.members)}); admit it with `diloco admit-learner --learner {name}`")


def make_evaluator(storage: str, run_id: str):
    """The evaluator of the run, and its stop signal (control/stop, the target version, a lost supervisor)."""
    from diloco.chaos.inprocess import apply_chaos
    from diloco.evaluator.evaluator import Evaluator
    from diloco.run.context import open_run
    from diloco.run.events import EventLog
    from diloco.run.signals import RoleStop

    ctx = open_run(storage, run_id)
    apply_chaos(ctx)
    evaluator = Evaluator(ctx, events=EventLog(ctx.store, ctx.keys, "evaluator"))
    return evaluator, RoleStop(ctx, ctx.cfg.run.num_versions)


def run_role(role: str, storage: str, run_id: str, name: str | None = None, *, phases: int | None = None,
             merges: int | None = None, units: Units | None = None) -> int:
    """Run one role of a run in this process until it ends; returns the phases, merges or evaluations done."""
    units = units or Units()
    if role == "learner":
        started: list[int] = []  # phases done by this process: a user error before the first is fatal
        try:
            return _run_learner(storage, run_id, name or "", phases, units, started)
        except Exception as err:  # recorded (status "failed", the error's line, its log), then raised on
            record_learner_failure(storage, run_id, name or "", err, at_start=not started)
            raise
    if role == "merger":
        from diloco.merger.loop import run_merger
        from diloco.run.signals import RoleStop

        merger, ctx = make_merger(storage, run_id, name or "merger")
        return run_merger(merger, max_merges=merges, target_version=ctx.cfg.run.num_versions,
                          target_tokens=ctx.cfg.run.num_tokens, should_stop=RoleStop(ctx), merge=units.merge)
    if role == "evaluator":
        from diloco.evaluator.evaluator import run_evaluator

        evaluator, should_stop = make_evaluator(storage, run_id)
        return run_evaluator(evaluator, should_stop=should_stop, evaluate=units.evaluate)
    raise ValueError(f"role {role!r} is unknown: must be one of {', '.join(ROLES)}")


def _run_learner(storage: str, run_id: str, name: str, phases: int | None, units: Units,
                 started: list[int]) -> int:
    from diloco.learner.loop import learner_step, run_learner

    if learner_ranks(storage, run_id, name) > 1:
        run_world(storage, run_id, name, phases)  # the ranks never import Prefect: no task units
        return 0
    learner, should_stop = make_learner(storage, run_id, name)
    try:
        return run_learner(learner, phases=phases, should_stop=should_stop,
                           on_phase=lambda _: started.append(1),
                           step=units.phase or learner_step, join=units.join or type(learner).join,
                           why=lambda: should_stop.why)
    finally:
        should_stop.close()


def record_learner_failure(storage: str, run_id: str, name: str, err: Exception, at_start: bool) -> None:
    """The learner's status says `failed`, with the error's line and its log (diloco.run.failure), and a
    `failed` event; `fatal` (a restart cannot fix it) when a user error (the spec, the config, the run: not
    storage) stopped it before its first phase: its next start would run the same code on the same config.
    Never raises."""
    from diloco.run.events import EventLog
    from diloco.run.failure import error_line, log_location, write_failed_status
    from diloco.storage import RunKeys, StorageError, open_store
    from diloco.supervise.user_errors import USER_ERRORS, describe

    user = isinstance(err, USER_ERRORS)
    line = error_line(describe(err) if user else f"{type(err).__name__}: {err}")
    fatal = user and at_start and not isinstance(err, StorageError)
    try:
        store, keys = open_store(storage).with_retries(1), RunKeys(run_id)
    except (StorageError, ValueError) as problem:
        log.warning("learner %s: its failure could not be recorded: %s", name, problem)
        return
    if write_failed_status(store, keys, name, error=line, fatal=fatal, log_at=log_location()):
        events = EventLog(store, keys, name)
        events.emit("failed", learner=name, error=line, fatal=fatal, log=log_location())
        events.flush()


def learner_ranks(storage: str, run_id: str, name: str) -> int:
    from diloco.learner.ranks import ranks_of
    from diloco.run.context import open_run
    from diloco.storage.keys import validate_learner_name

    return ranks_of(open_run(storage, run_id), validate_learner_name(name))


def _rank(world, storage: str, run_id: str, name: str, phases: int | None) -> None:
    """One rank of a learner's world: rank 0 is the learner, the others follow it (diloco.learner.ranks)."""
    if world.leader:
        from diloco.learner.loop import run_learner

        learner, should_stop = make_learner(storage, run_id, name, world=world)
        try:
            run_learner(learner, phases=phases, should_stop=should_stop, why=lambda: should_stop.why)
        finally:
            should_stop.close()
        return
    from diloco.learner.ranks import follow
    from diloco.run.context import open_run

    follow(world, open_run(storage, run_id), name)


def run_world(storage: str, run_id: str, name: str, phases: int | None) -> None:
    """A learner of `learner.ranks` > 1 processes: launch its world with torch's launcher and wait; raises
    when any rank failed (one failure domain: the supervisor, or the train flow, restarts the learner as
    one)."""
    import functools

    import torch

    from diloco.learner.ranks import ranks_of
    from diloco.learner.world import launch_world
    from diloco.run.context import open_run
    from diloco.training.inner import uses_cuda
    from diloco.training.spec import SpecError

    ctx = open_run(storage, run_id)
    cfg, ranks = ctx.cfg.learner, ranks_of(ctx, name)
    cuda = uses_cuda(cfg.device)
    if cuda and ranks > torch.cuda.device_count():
        raise SpecError(f"learner {name}: learner.ranks = {ranks}, but there are {torch.cuda.device_count()} "
                        "GPUs")
    log.info("learner %s: a world of %d ranks (%s)", name, ranks, "nccl" if cuda else "gloo")
    launch_world(functools.partial(_rank, storage=storage, run_id=run_id, name=name, phases=phases), ranks,
                 cuda=cuda, timeout_s=cfg.collective_timeout_s, threads=cfg.num_threads)


_torch_warm = False  # the throwaway step ran in this process (a zygote's forks inherit it)


def check_chaos_plan(path: Any) -> None:
    """Validate a fault plan (ConfigError naming the problem) before anything of the run is created."""
    from diloco.chaos.plan import load_plan

    load_plan(path)


def chaos_agent(plan_path: str | None) -> Callable[[Any], Any] | None:
    """What a local run's supervisor gets attached (diloco.supervise.local.supervise_local's `attach`) for a
    fault plan: the chaos agent, which joins here, outside the core, as a role's faults do in run_role; None:
    no plan."""
    if not plan_path:
        return None
    from diloco.chaos.agent import attach_chaos

    return lambda supervisor: attach_chaos(supervisor, plan_path)


def warm_up() -> None:
    """Pay, without the bucket, what a role's process pays before it can work: torch's lazy imports (the
    optimizer's first step pulls torch._dynamo) on a throwaway model, and every role's modules. Once per
    process: again (a warm standby's or a forked learner's make_learner) it costs nothing."""
    global _torch_warm
    if _torch_warm:
        return
    import torch

    import diloco.evaluator.evaluator  # noqa: F401
    import diloco.learner.learner  # noqa: F401
    import diloco.learner.loop  # noqa: F401
    import diloco.merger.loop  # noqa: F401
    from diloco.configs import InnerConfig, ModelConfig
    from diloco.storage.codec import encode
    from diloco.training.inner import InnerTrainer
    from diloco.training.model import build_model

    cfg = ModelConfig(n_layer=1, n_head=1, d_model=8, ctx_len=4)
    trainer = InnerTrainer(build_model(cfg), InnerConfig())
    tokens = torch.zeros(1, cfg.ctx_len, dtype=torch.long)
    trainer.train_step(tokens, tokens)
    # the quantized codecs' zstd (pyarrow, ~25 MB of libraries) loaded now: a learner's baseline, not its
    # first delta
    encode({"w": trainer.model.lm_head.weight.detach().numpy()}, codec="int4", kind="delta",
           fingerprint="warm-up")
    _torch_warm = True


def wait_as_standby(stdin: TextIO | None = None) -> bool:
    """Block until a line arrives on stdin (the imports already paid): True to start now, False at end of
    input (the supervisor is gone or stopped this spare). sys.stdin is read when called, not when this
    module was imported (a default argument would keep whatever stdin was then)."""
    print("standby ready", file=sys.stderr, flush=True)
    return bool((stdin or sys.stdin).readline())


def parse_args(argv: list[str], prog: str = "diloco.launch") -> argparse.Namespace:
    """The internal launch protocol: `<role> --storage URL --run-id ID [--name NAME] [--phases N]
    [--merges N] [--standby]` (exit 2 with one line on a bad argument)."""
    parser = argparse.ArgumentParser(prog=prog, description="Run one role of a run in this process.")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--storage", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--name", default=None, help="the learner's name, or the merger's id")
    parser.add_argument("--phases", type=int, default=None)
    parser.add_argument("--merges", type=int, default=None)
    parser.add_argument("--standby", action="store_true", help="import everything, start on a line on stdin")
    parser.add_argument("--verbose", "-v", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """`python -m diloco.launch ...` (and a zygote's fork): run the role; user errors are one line, exit 2."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if args.standby:
        warm_up()
        if not wait_as_standby():
            return 0
    from diloco.supervise.user_errors import USER_ERRORS, describe

    try:
        run_role(args.role, args.storage, args.run_id, args.name, phases=args.phases, merges=args.merges)
    except USER_ERRORS as err:
        print(f"error: {describe(err)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

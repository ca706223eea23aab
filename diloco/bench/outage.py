"""`diloco bench outage`: the merger is down for some rounds while the learners keep shipping; how the
held-out loss behaves when the backlog is merged, under each `experimental.backlog_momentum` rule.

Contract: in one process per rule, deterministic: bench recipe, M learners, quorum M (every merge is one
round), no prefetcher (the probe fetches), H inner steps per phase; at round `--at` the merges stop for
`--down` rounds, then the next merge takes the whole backlog (`down + 1` rounds). Prints a table of the
held-out loss per round and writes JSON {rules: {rule: {curve: [[round, version, loss]], final_loss,
peak_after_outage, loss_before_outage}}}.
"""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Annotated, Any

from diloco.bench.harness import BenchResult, Opt, Table, benchmark
from diloco.configs import Config, ConfigError

RULES = ("whole", "round_rate")


def rule_config(base: Config, rule: str, rounds: int) -> Config:
    """The recipe as this bench runs it: quorum M, no grace, no local state, and no prefetcher (the probe
    fetches, so a run is the same to the last bit every time; a prefetcher's timing is not)."""
    return base.with_overrides({
        "learner.checkpoint": False, "learner.local_state_every_steps": 0, "learner.device": "cpu",
        "learner.prefetch": False, "merger.quorum": base.run.num_learners, "merger.grace_cap_s": 0.0,
        "inner.total_steps": base.inner.steps_per_phase * rounds, "experimental.backlog_momentum": rule,
    })


def run_rule(rule: str, at: int, down: int, rounds: int, config: str) -> dict[str, Any]:
    import torch

    from diloco.bench._quality_runs import HeldOut
    from diloco.configs import load_config
    from diloco.learner.learner import Learner
    from diloco.merger.merger import Merger
    from diloco.run.create import create_run
    from diloco.specs.gpt import load_corpus, make_spec
    from diloco.storage import open_store

    torch.set_num_threads(1)
    cfg = rule_config(load_config(config), rule, rounds)
    corpus = load_corpus(cfg.data)
    held = HeldOut(cfg, corpus)
    t0 = time.time()
    curve = []
    with tempfile.TemporaryDirectory(prefix="diloco-outage-") as tmp:
        ctx = create_run(open_store(f"file://{tmp}"), f"outage-{rule}", cfg)
        learners = [Learner(ctx, name, make_spec(ctx.cfg, corpus)) for name in ctx.learners]
        for learner in learners:
            learner.join()
        merger = Merger(ctx)
        merger.load()
        for r in range(rounds):
            for learner in learners:
                learner.publish(learner.run_phase())
            for learner in learners:
                learner.publisher.drain()
            if not at <= r < at + down:
                merger.merge_once()
            curve.append((r, merger.version, held.loss(merger.params)))
        for learner in learners:
            learner.close()
        merger.close()  # its checkpoint writer done before the directory goes (a late write: "not empty")
    before = curve[at - 1][2] if at > 0 else curve[0][2]
    after = [loss for r, _, loss in curve if r >= at + down]
    return {"curve": curve, "final_loss": curve[-1][2], "loss_before_outage": before,
            "peak_after_outage": max(after[:3]) if after else None, "wall_s": time.time() - t0}


@benchmark(config="bench")
def bench_outage(
    config: str = "bench",
    at: Annotated[int, Opt("--at", min=1, help="Round at which the merger goes down.")] = 8,
    down: Annotated[int, Opt("--down", min=1, help="Rounds without a merge.")] = 6,
    rounds: Annotated[int, Opt("--rounds", min=2, help="Rounds in all.")] = 24,
    jobs: Annotated[int, Opt("--jobs", min=1, help="Rules run side by side in this many processes.")] = 2,
) -> BenchResult:
    """Merger outage: the held-out loss around a backlog merge, momentum taking it whole vs at a round's
    rate."""
    if at + down >= rounds:
        raise ConfigError(f"--at {at} + --down {down} must be < --rounds {rounds}")
    with ProcessPoolExecutor(max_workers=min(jobs, len(RULES))) as pool:
        results = dict(zip(RULES, pool.map(run_rule, RULES, [at] * 2, [down] * 2, [rounds] * 2, [config] * 2),
                           strict=True))
    table = Table(f"held-out loss (nats/byte) per round; merger down for rounds {at}..{at + down - 1}",
                  ["round", *(f"{rule} (version)" for rule in RULES)])
    for r in range(rounds):
        table.rows.append([str(r), *[f"{results[rule]['curve'][r][2]:.3f} ({results[rule]['curve'][r][1]})"
                                     for rule in RULES]])
    notes = [f"{rule}: before outage {x['loss_before_outage']:.3f}, peak in the 3 rounds after "
             f"{x['peak_after_outage']:.3f}, final {x['final_loss']:.3f}" for rule, x in results.items()]
    out = {"at": at, "down": down, "rounds": rounds, "config": config, "rules": results}
    return BenchResult(out, [table], notes)

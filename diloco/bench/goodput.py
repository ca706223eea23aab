"""`diloco bench goodput`: the standard fault plan on the bench recipe next to the same run without
faults; goodput, availability, data-parallel goodput under the same faults, integrity and loss.

Contract: two supervised `--no-prefect` runs, one after the other, of equal wall time; prints a
table and writes JSON {decoupled_goodput, dp_goodput, availability, versions, deltas_lost,
deltas_applied_twice, audit_ok, final_eval_loss, no_fault_eval_loss, ...}; targets are reported, not assumed.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Annotated, Any

from diloco.bench.harness import BenchResult, Opt, Table, benchmark
from diloco.configs import ConfigError

PLANS = Path(__file__).resolve().parents[1] / "chaos" / "plans"
TARGETS = {"decoupled_goodput": 0.88, "vs_availability": 0.95, "loss_gap": 0.02}
LOSS_WINDOW = 5  # versions averaged around equal merged tokens


def _supervised_run(storage: str, run_id: str, cfg, plan_path: Path | None, log_root: Path):
    from diloco.chaos.agent import attach_chaos
    from diloco.run.create import create_run
    from diloco.storage import open_store
    from diloco.supervise.local import local_supervisor

    ctx = create_run(open_store(storage), run_id, cfg)
    supervisor = local_supervisor(ctx, prefect=False, log_dir=str(log_root / run_id),
                                  env={"OMP_NUM_THREADS": "1"})
    if plan_path is not None:
        attach_chaos(supervisor, plan_path)
    supervisor.run_to_end()
    return ctx


def _applied_twice(chain) -> int:
    seen: dict[tuple[str, int], int] = {}
    for m in chain:
        for d in m.merged():
            seen[(d.learner, d.seq)] = seen.get((d.learner, d.seq), 0) + 1
    return sum(n - 1 for n in seen.values() if n > 1)


def _median_startup(events: list[dict]) -> float:
    """Median seconds from a learner process start (or a warm standby's activation) to its join: what
    each restart costs on top of the planned delay."""
    started: dict[str, float] = {}
    delays = []
    for e in events:
        if e.get("source") == "supervisor" and e.get("kind") == "start" and e.get("role") == "learner":
            started[e["learner"]] = e["t"]
        elif e.get("kind") == "join" and e.get("source") in started:
            delays.append(e["t"] - started.pop(e["source"]))
    return statistics.median(delays) if delays else 0.0


def _loss_at_tokens(ctx, chain, tokens: int, k: int = LOSS_WINDOW) -> tuple[float, int, int]:
    """Mean held-out loss of the k versions whose merged tokens are closest to `tokens` (evaluated
    if needed): one version's loss jumps by ~0.1 nats from merge to merge; returns (loss, version, tokens)
    of the closest one alongside."""
    from diloco.evaluator.evaluator import Evaluator, read_evals

    nearest = sorted(chain[1:] or chain, key=lambda m: (abs(m.tokens_total - tokens), -m.version))[:k]
    done = {e["version"]: e for e in read_evals(ctx)}
    evaluator = None
    losses = []
    for m in nearest:
        if m.version not in done:
            evaluator = evaluator or Evaluator(ctx)
            done[m.version] = evaluator.evaluate_version(m.version)
        losses.append(float(done[m.version]["loss"]))
    return sum(losses) / len(losses), nearest[0].version, nearest[0].tokens_total


def local_save_cost_s(ctx, repeats: int = 5) -> float:
    """Median seconds of one learner local-state save for this run's model (what a learner pays every
    `learner.local_state_every_steps` steps): the cheapest checkpoint data-parallel could have too."""
    import tempfile

    import torch

    from diloco.learner.local_state import LocalState
    from diloco.training.inner import InnerTrainer
    from diloco.training.model import build_model, get_flat_params

    model = build_model(ctx.cfg.model)
    trainer = InnerTrainer(model, ctx.cfg.inner)
    x = torch.zeros(ctx.cfg.data.batch_size, ctx.cfg.model.ctx_len, dtype=torch.long)
    trainer.train_step(x, x)  # the AdamW state a learner saves exists after its first step
    opt, opt_meta = trainer.export_state()
    params = get_flat_params(model)
    times = []
    with tempfile.TemporaryDirectory() as root:
        local = LocalState(ctx.store.url, ctx.run_id, "bench", ctx.created_at, ctx.fingerprint,
                           root=Path(root))
        for _ in range(repeats):
            t0 = time.perf_counter()
            local.save({"theta": params, "ref": params, "glob": params, "opt": opt}, {"optimizer": opt_meta})
            local.flush()  # the save is encoded and written on the local-state thread: time all of it
            times.append(time.perf_counter() - t0)
        local.close()
    return statistics.median(times)


def measure(chaos_ctx, clean_ctx, checkpoint_cost_s: float) -> dict[str, Any]:
    from diloco.chaos.goodput import compute_goodput, per_learner
    from diloco.inspect.audit import audit_run
    from diloco.inspect.report import manifests
    from diloco.inspect.summary import traffic_figures
    from diloco.run.events import read_events
    from diloco.trust.outliers import guard_figures

    chain, clean_chain = manifests(chaos_ctx), manifests(clean_ctx)
    events = read_events(chaos_ctx.store, chaos_ctx.keys)
    g = compute_goodput(events, chain, chaos_ctx.learners, checkpoint_cost_s)
    clean = compute_goodput(read_events(clean_ctx.store, clean_ctx.keys), clean_chain, clean_ctx.learners,
                            checkpoint_cost_s)
    save_s = local_save_cost_s(chaos_ctx)
    cheap = compute_goodput(events, chain, chaos_ctx.learners, save_s)
    audit = audit_run(chaos_ctx)
    tokens = min(chain[-1].tokens_total, clean_chain[-1].tokens_total)
    loss, version, at_tokens = _loss_at_tokens(chaos_ctx, chain, tokens)
    clean_loss, clean_version, clean_tokens = _loss_at_tokens(clean_ctx, clean_chain, tokens)
    faults = [e for e in events if e.get("source") == "chaos" and e.get("kind") == "fault"]
    return {
        "decoupled_goodput": g.decoupled_goodput, "dp_goodput": g.dp_goodput, "availability": g.availability,
        "versions": chain[-1].version, "deltas_lost": audit.deltas_lost,
        "deltas_applied_twice": _applied_twice(chain), "audit_ok": audit.ok,
        "final_eval_loss": loss, "no_fault_eval_loss": clean_loss,
        "guard": {"chaos": guard_figures(chaos_ctx), "no_fault": guard_figures(clean_ctx)},
        # every object the learners moved (deltas, checkpoints, statuses, ...) against data-parallel, each run
        "traffic": {"chaos": traffic_figures(chaos_ctx, events),
                    "no_fault": traffic_figures(clean_ctx, read_events(clean_ctx.store, clean_ctx.keys))},
        "detail": {
            "chaos_run": chaos_ctx.run_id, "no_fault_run": clean_ctx.run_id, "wall_s": g.wall_s,
            "num_learner_failures": g.num_failures, "num_faults": len(faults),
            "merger_self_kills": sum(1 for e in events if e.get("kind") == "chaos_self_kill"),
            "ready_fraction": g.ready_fraction, "useful_s": g.useful_s, "provisioned_s": g.provisioned_s,
            "startup_s_median": _median_startup(events),
            "standby_activations": sum(1 for e in events if e.get("kind") == "start" and e.get("standby")),
            "standby_s": g.standby_s,
            "dp_checkpoint_cost_s": checkpoint_cost_s, "dp_checkpoint_interval_s": g.dp_checkpoint_interval_s,
            "local_save_s": save_s, "dp_goodput_at_local_save_cost": cheap.dp_goodput,
            "dp_checkpoint_interval_at_local_save_cost_s": cheap.dp_checkpoint_interval_s,
            "no_fault_goodput": clean.decoupled_goodput, "no_fault_versions": clean_chain[-1].version,
            "loss_version": version, "loss_tokens": at_tokens, "no_fault_loss_version": clean_version,
            "no_fault_loss_tokens": clean_tokens, "audit_problems": audit.problems[:10],
            "deltas_rejected": audit.deltas_rejected, "deltas_pending": audit.deltas_pending,
            "loss_gap": (loss - clean_loss) / clean_loss, "loss_window_versions": LOSS_WINDOW,
            "per_learner": per_learner(events, chain, chaos_ctx.learners),
            "no_fault_per_learner": per_learner(read_events(clean_ctx.store, clean_ctx.keys), clean_chain,
                                                clean_ctx.learners),
        },
    }


def targets_met(r: dict[str, Any]) -> dict[str, bool]:
    gap = abs(r["final_eval_loss"] - r["no_fault_eval_loss"]) / r["no_fault_eval_loss"]
    return {
        "decoupled_goodput >= 0.88": r["decoupled_goodput"] >= TARGETS["decoupled_goodput"],
        "decoupled_goodput >= 0.95 x availability":
            r["decoupled_goodput"] >= TARGETS["vs_availability"] * r["availability"],
        "dp_goodput well below": r["dp_goodput"] < r["decoupled_goodput"],
        "zero lost, zero applied twice": r["deltas_lost"] == 0 and r["deltas_applied_twice"] == 0,
        "audit ok": bool(r["audit_ok"]),
        "loss within 2% of no-fault": gap <= TARGETS["loss_gap"],
    }


def _table(r: dict[str, Any]) -> Table:
    detail = r["detail"]
    table = Table(f"goodput under the fault plan ({detail['wall_s']:.0f} s, "
                  f"{detail['num_learner_failures']} learner failures)", ["measure", "value"], labels=1)
    r = {**r, **{k: detail.get(k, 0) for k in ("ready_fraction", "startup_s_median", "standby_activations",
                                                "standby_s")}}
    r["dp_goodput_at_local_save_cost"] = detail.get("dp_goodput_at_local_save_cost", 0.0)
    for key in ("decoupled_goodput", "availability", "ready_fraction", "startup_s_median",
                "standby_activations",
                "standby_s", "dp_goodput", "dp_goodput_at_local_save_cost", "versions", "deltas_lost",
                "deltas_applied_twice", "audit_ok", "final_eval_loss", "no_fault_eval_loss"):
        value = r[key]
        table.rows.append([key, f"{value:.4f}" if isinstance(value, float) else str(value)])
    for name, ok in r["targets"].items():
        table.rows.append([f"target: {name}", "met" if ok else "NOT met"])
    for run, t in (r.get("traffic") or {}).items():
        if t.get("bytes_sent_per_learner") is not None:
            table.rows.append([f"traffic ({run}): sent / received MB per learner",
                               f"{t['bytes_sent_per_learner'] / 1e6:.2f} / "
                               f"{(t['bytes_received_per_learner'] or 0) / 1e6:.2f}"])
            table.rows.append([f"traffic ({run}) vs DP, every byte (deltas only)",
                               f"{t['traffic_ratio_vs_dp'] or 0:.0f}x / "
                               f"{t['received_ratio_vs_dp'] or 0:.0f}x "
                               f"({t['delta_traffic_ratio_vs_dp'] or 0:.0f}x)"])
    return table


@benchmark(quick="Smoke mode: the short plan (~90 s per run).")
def bench_goodput(
    quick: bool = False,
    storage: Annotated[str, Opt("--storage", help="Where both runs live.")] = "file://runs",
    plan: Annotated[Path | None, Opt("--plan", help="A fault plan (default: the standard plan).")] = None,
    checkpoint_cost_s: Annotated[float, Opt("--checkpoint-cost-s", min=0.0,
                                            help="Data-parallel checkpoint cost C for Young-Daly.")] = 5.0,
    measure_runs: Annotated[str | None, Opt("--measure", metavar="CHAOS_RUN,CLEAN_RUN",
                                            help="Measure two recorded runs in --storage instead of "
                                                 "running.")] = None,
) -> BenchResult:
    """Run the bench recipe under the standard fault plan and without faults; compare."""
    from diloco.chaos.plan import load_plan
    from diloco.configs import load_config

    plan_path = plan or PLANS / ("quick.yaml" if quick else "standard.yaml")
    duration = load_plan(plan_path).min_duration_s or 330.0
    cfg = load_config("bench").with_overrides({"run.num_versions": 1_000_000, "run.time_limit_s": duration})
    if measure_runs:
        from diloco.run.context import RunError, open_run

        names = measure_runs.split(",")
        if len(names) != 2:
            raise ConfigError("--measure takes CHAOS_RUN,CLEAN_RUN")
        try:
            chaos_ctx, clean_ctx = (open_run(storage, name) for name in names)
        except RunError as err:
            raise ConfigError(f"--measure: {err}") from None
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        logs = Path(".diloco") / "logs"
        chaos_ctx = _supervised_run(storage, f"goodput-chaos-{stamp}", cfg, plan_path, logs)
        clean_ctx = _supervised_run(storage, f"goodput-clean-{stamp}", cfg, None, logs)
    result = measure(chaos_ctx, clean_ctx, checkpoint_cost_s)
    result["targets"] = targets_met(result)
    result["plan"] = str(plan_path)
    return BenchResult(result, [_table(result)])

"""`diloco bench moments`: what a lost host's resume loses with each bucket checkpoint of its optimizer
moments — exact, int8 (block int8 exp_avg, sqrt-domain int8 exp_avg_sq), C phases old, or none (fresh
moments) — against the bytes each costs: the measurement behind learner.checkpoint_every and
learner.checkpoint_moments.

Contract: in-process and deterministic (one thread, fixed seed and batches): one learner trains `before` steps
on the recipe, keeping its optimizer state every phase; from the parameters at that step, each variant trains
`after` more steps on the same batches with its moments; prints a table and writes JSON {"rows": [{variant,
age_phases, encoding, bytes_per_param, train_loss_after, gap_nats, steps_lost, heldout_after}], "config"}.
steps_lost is the gap in mean training loss over the `after` steps divided by the exact run's loss decrease
per step before the cut (a least-squares line through its last 10 phases): how many steps of the learner's
progress the variant costs.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import torch

from diloco.bench.harness import BenchResult, Opt, Table, benchmark
from diloco.configs import Config, load_config
from diloco.learner.checkpoint import round_trip
from diloco.run.spec import build_model
from diloco.specs.gpt import load_corpus, make_spec
from diloco.training.inner import InnerTrainer, evaluate
from diloco.training.model import get_flat_params, set_params

AGES = (0, 1, 5, 20, 50)  # phases between the moments' checkpoint and the loss of the host


def _trainer(cfg: Config, spec) -> InnerTrainer:
    model = build_model(spec, cfg.data.seed)
    opt = spec.build_optimizer(list(model.parameters())) if spec.build_optimizer else None
    return InnerTrainer(model, cfg.inner, "cpu", optimizer=opt, lr_at_step=spec.lr_at, loss=spec.loss)


def _losses(trainer: InnerTrainer, batches: list) -> list[float]:
    return [trainer.train_step(batch) for batch in batches]


def _decrease_per_step(losses: list[float]) -> float:
    """Minus the least-squares slope of `losses` against their step."""
    n = len(losses)
    mean_x, mean_y = (n - 1) / 2, sum(losses) / n
    num = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(losses))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return -num / den if den else 0.0


def measure(cfg: Config, before: int, after: int, ages: tuple[int, ...] = AGES) -> dict[str, Any]:
    torch.set_num_threads(1)
    corpus = load_corpus(cfg.data)
    spec = make_spec(cfg, corpus)
    h = cfg.inner.steps_per_phase
    stream = iter(spec.batches(0, 1, 0))
    first = [next(stream) for _ in range(before)]
    then = [next(stream) for _ in range(after)]
    held = list(spec.eval_batches()) if spec.eval_batches is not None else None
    trainer = _trainer(cfg, spec)
    snapshots: dict[int, tuple[dict, dict]] = {}
    curve = []
    for i, batch in enumerate(first, start=1):
        curve.append(trainer.train_step(batch))
        if (before - i) % h == 0 and (before - i) // h in ages:
            snapshots[(before - i) // h] = trainer.export_state()
    theta, step = get_flat_params(trainer.model), trainer.step
    slope = _decrease_per_step(curve[-10 * h:])
    n = sum(v.numel() for v in theta.values())
    rows = []
    ages = tuple(a for a in ages if a in snapshots)  # older than the run: none
    variants = [("exact", 0, "fp32")]
    variants += [(f"{e} moments {a} phases old", a, e) for a in ages for e in ("fp32", "int8")
                 if a or e == "int8"]
    variants += [("fresh moments", None, "none")]
    for label, age, encoding in variants:
        run = _trainer(cfg, spec)
        set_params(run.model, theta)
        size = 0
        if age is not None:
            tensors, meta = snapshots[age]
            if encoding == "int8":
                back = round_trip(tensors, "int8")
                tensors, size = back["tensors"], back["bytes"]
            else:
                size = round_trip(tensors, "fp32")["bytes"]
            run.import_state(tensors, meta)
        run.step = step  # the schedule goes on where the host was (the pointer's step)
        losses = _losses(run, then)
        heldout = evaluate(run.model, held, "cpu", spec.loss) if held else None
        rows.append({"variant": label, "age_phases": age, "encoding": encoding, "bytes_per_param": size / n,
                     "train_loss_after": sum(losses) / len(losses), "heldout_after": heldout})
    exact = rows[0]["train_loss_after"]
    for row in rows:
        row["gap_nats"] = row["train_loss_after"] - exact
        row["steps_lost"] = row["gap_nats"] / slope if slope > 0 else None
    return {"rows": rows, "config": {"recipe": cfg.name, "params": n, "before": before, "after": after,
                                     "steps_per_phase": h, "beta1": cfg.inner.beta1, "beta2": cfg.inner.beta2,
                                     "loss_decrease_per_step": slope}}


@benchmark(config="bench", config_help="The recipe.")
def bench_moments(
    config: str = "bench",
    before: Annotated[int, Opt("--before", min=2, help="Steps trained before the host is lost.")] = 2400,
    after: Annotated[int, Opt("--after", min=1, help="Steps trained after the resume, each variant.")] = 80,
) -> BenchResult:
    """What a lost host's resume loses with exact, int8, C-phase-old or no checkpointed moments, per byte."""
    # a cosine horizon of 3x `before` steps: the learner is still improving at the cut (past the recipe's
    # horizon its lr is at the floor and no variant loses anything measurable)
    cfg = load_config(config).with_overrides({"inner.total_steps": 3 * before})
    t0 = time.time()
    result = measure(cfg, before, after)
    result["wall_s"] = time.time() - t0
    params = result["config"]["params"]
    table = Table(f"bench moments: a lost host resumes with ... ({params:,} params, {before} steps, then "
                  f"{after})",
                  ["moments", "B/param", "train loss after", "gap nats", "steps lost", "held-out after"])
    for r in result["rows"]:
        table.rows.append([r["variant"], f"{r['bytes_per_param']:.2f}", f"{r['train_loss_after']:.4f}",
                           f"{r['gap_nats']:+.4f}",
                           "-" if r["steps_lost"] is None else f"{r['steps_lost']:.1f}",
                           "-" if r["heldout_after"] is None else f"{r['heldout_after']:.4f}"])
    return BenchResult(result, [table])

"""What a run did, read back from the bucket: status of learners, the final summary, samples.

Contract: read-only; every figure is computed from stored manifests, evals and heartbeats.
"""

from __future__ import annotations

import math
import time

from diloco.evaluator.evaluator import read_evals
from diloco.inspect.model_out import num_params, sample
from diloco.run.context import RunContext
from diloco.run.fragments import fragment_context, manifests, num_fragments
from diloco.storage import Manifest, StorageError
from diloco.storage.records import LearnerStatus, RecordError, beat_age, read_record


def learner_status(ctx: RunContext) -> list[dict]:
    """Each learner's last status (LearnerStatus fields, plus age_s — or ahead_s for a beat from the future,
    which is ignored: records.beat_age), or state 'never reported'."""
    names = set(ctx.learners)
    for key in ctx.store.list(ctx.keys.learners_prefix()):
        parts = key.split("/")
        if len(parts) >= 3 and parts[-1] == "status.json":
            names.add(parts[-2])
    rows = []
    for name in sorted(names):
        try:
            record = read_record(ctx.store, ctx.keys.status(name), LearnerStatus)
        except (StorageError, RecordError):
            rows.append({"learner": name, "state": "never reported"})
            continue
        now = time.time()
        age = beat_age(record.t, now)
        rows.append({**record.model_dump(exclude_none=True), **({"age_s": age} if age is not None else
                                                                 {"ahead_s": record.t - now})})
    return rows


def dp_bytes(num_params_: int, steps_per_learner: float, num_learners: int) -> float:
    """Bytes a learner sends in ring all-reduce data-parallel: 2(M-1)/M x 4N per step."""
    if num_learners < 2:
        return 0.0
    return steps_per_learner * 2 * (num_learners - 1) / num_learners * 4 * num_params_


def fragment_chains(ctx: RunContext) -> list[list[Manifest]]:
    """Every fragment's committed manifests (one chain, the root's, without fragments)."""
    return [manifests(fragment_context(ctx, p)) for p in range(num_fragments(ctx))]


def slowest_chain(chains: list[list[Manifest]]) -> list[Manifest]:
    """The chain the run's version and progress are read from: the root's, or the fragment chain with the
    fewest versions (then tokens): what every fragment has merged (goodput counts its merged steps)."""
    return chains[0] if len(chains) == 1 else min(chains, key=lambda c: (c[-1].version, c[-1].tokens_total))


def summarize(ctx: RunContext) -> dict:
    chains = fragment_chains(ctx)
    chain = slowest_chain(chains)
    evals = read_evals(ctx)
    merged = [d for c in chains for m in c for d in m.merged()]
    rejected = [d for c in chains for m in c for d in m.rejected()]
    bytes_published = sum(d.bytes for d in merged) + sum(d.bytes for d in rejected if d.bytes)
    # a fragmented run's steps: its slowest fragment's
    steps = sum(d.steps for m in chain for d in m.merged())
    m_learners = max(1, len(ctx.learners))
    n = num_params(ctx)
    dp_total = dp_bytes(n, steps / m_learners, m_learners) * m_learners
    initial = next((e for e in evals if e["version"] == 0), None)
    final = evals[-1] if evals else None
    return {
        "run_id": ctx.run_id, "storage": ctx.store.url,
        "num_versions": (chain[-1].version if chain else 0), "num_learners": len(ctx.learners),
        "initial_eval_loss": initial["loss"] if initial else None,
        "final_eval_loss": final["loss"] if final else None,
        "final_eval_version": final["version"] if final else None,
        "metric": (final or {}).get("metric") or "nats/byte",
        "deltas_merged": len(merged), "deltas_rejected": len(rejected),
        "bytes_published": int(bytes_published), "dp_bytes_equivalent": int(dp_total),
        # the deltas only:
        "delta_traffic_ratio_vs_dp": (dp_total / bytes_published) if bytes_published else None,
        # the summary's headline, traffic_ratio_vs_dp, counts every byte
        # (diloco.inspect.summary.build_summary)
        "tokens_merged": int(chain[-1].tokens_total if chain else 0), "num_params": n,
        "rejections": sorted({d.reason.split(":")[0] for d in rejected}),
    }


JSON_KEYS = ("run_id", "storage", "num_versions", "num_learners", "initial_eval_loss", "final_eval_loss",
             "deltas_merged", "deltas_rejected", "bytes_published")


def summary_json(summary: dict) -> dict:
    """What `diloco run --json` prints last and diloco.train returns: the main keys, the rest under
    `extra`."""
    return {k: summary[k] for k in JSON_KEYS} | {"extra": {k: v for k, v in summary.items()
                                                           if k not in JSON_KEYS}}


def sample_text(ctx: RunContext, prompt: str | None = None) -> str | None:
    """Text the run's spec samples from its newest version (None when the spec has no sample)."""
    return sample(ctx, None, prompt)


def nats_to_bits(loss: float | None) -> float | None:
    return None if loss is None else loss / math.log(2)

"""`diloco bench size`: a GPT-2-small-shaped model (124M parameters) trained end to end by the real engine —
`diloco run` with its real processes (learners, merger, evaluator, supervisor), int4 deltas and updates, the
Shakespeare corpus — for a fixed token budget, one learner killed mid-run and restarted (a chaos plan), and
what it cost per parameter: each process's peak memory, the learners' uploads against their deltas, the
bucket's growth.

Contract: one row per fragment count; each row is one `diloco run` subprocess on a fresh file:// store (a temp
dir unless --storage), watched from here: every process of the run has its resident high-water mark (VmHWM)
read from /proc every second (psutil-free; a process forked from the zygote starts from the zygote's mark),
each learner also records its own in its phase events. Then everything is read from the bucket (summary,
events, audit). Prints a table, writes JSON {"rows": [...], "config", "load"}. `--device cuda` is the GPU
device check's row (scripts/device-check.sh): the learners on CUDA with bf16 autocast, tokens/s and device
memory reported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from diloco.bench.harness import BenchResult, Opt, Table, benchmark
from diloco.configs import ConfigError
from diloco.run.heap import status_bytes

# GPT-2 small's shape and vocabulary (tied embeddings) over byte-level data: 123.7M parameters at context 128
SIZES = {
    "124m": {"model.n_layer": 12, "model.n_head": 12, "model.d_model": 768, "model.vocab_size": 50257},
    "10m": {"model.n_layer": 4, "model.n_head": 8, "model.d_model": 448},
    "quick": {"model.n_layer": 2, "model.n_head": 2, "model.d_model": 64},  # the tests'
}
# what two CPU cores afford at 124M (~3-6 s a step each, beside the merger and the evaluator): context 128,
# batch 1
CTX, BATCH = 128, 1
STEPS_PER_PHASE = 8
STEPS_PER_LEARNER = 48  # the token budget: learners x this x CTX x BATCH tokens merged
RESTART_AFTER_S = 3.0  # the killed learner (the second): SIGKILLed a third of the way in, back this later
TARGET_LOSS_DROP = 0.5  # nats/byte from version 0
TARGET_LEARNER_B_PER_PARAM = 24.0
TARGET_UPLOAD_OVER_DELTA = 1.2
POLL_S = 1.0


def bench_overrides(size: str, learners: int, fragments: int, device: str, steps: int) -> dict[str, Any]:
    """The bench recipe at `size`: int4 deltas and updates (the recipe's), H = STEPS_PER_PHASE, a short
    warmup, GPT-2 small's lr, every learner in every merge (quorum = learners, no grace window), two held-out
    batches."""
    out = {**SIZES[size], "model.ctx_len": CTX, "data.batch_size": BATCH, "run.num_learners": learners,
           "inner.steps_per_phase": max(STEPS_PER_PHASE, fragments), "inner.warmup_steps": 4,
           "inner.total_steps": steps, "inner.lr": 6e-4 if size == "124m" else 3e-3,
           "learner.codec": "int4", "outer.update_codec": "int4", "learner.device": device,
           "merger.quorum": learners, "merger.quorum_timeout_s": 120.0, "merger.grace_cap_s": 0.0,
           "eval.num_batches": 2, "eval.batch_size": 4, "run.max_restarts": 2,
           "run.heartbeat_timeout_s": 300.0}
    if fragments > 1:
        out.update({"fragments.count": fragments, "merger.shards": 1})
    return out


def kill_version(steps: int) -> int:
    """The version at which a learner is killed: a third of the phases each learner runs (quorum = every
    learner, so the merges after it wait for the restarted learner: it must contribute again)."""
    return max(1, steps // STEPS_PER_PHASE // 3)


def _plan(path: Path, learner: int, version: int) -> Path:
    fault = (f"{{kind: kill_learner, learner: {learner}, at_version: {version}, "
             f"restart_after_s: {RESTART_AFTER_S}}}")
    path.write_text(f"name: size\nseed: 1\nfaults:\n  - {fault}\n")
    return path


class Watcher:
    """Every second: the resident high-water mark of every process under `root` (pid -> bytes, the largest
    seen)."""

    def __init__(self, root: int) -> None:
        self.root, self.peak, self._stop = root, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, name="size-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            for pid in _descendants(self.root):
                hwm = status_bytes("VmHWM", pid)
                if hwm is not None:
                    self.peak[pid] = max(self.peak.get(pid, 0), hwm)

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join(5)
        return dict(self.peak)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def run_row(size: str, learners: int, fragments: int, device: str, storage: str | None, steps: int,
            time_limit_s: float, workdir: Path, kill_at: int) -> dict[str, Any]:
    """One `diloco run` of the row, watched; its figures read back from the bucket."""
    run_id = f"size-{size}-p{fragments}-{time.strftime('%H%M%S')}"
    storage = storage or f"file://{workdir / 'runs'}"
    tokens = learners * steps * CTX * BATCH
    args = [sys.executable, "-m", "diloco.cli", "run", "--no-prefect", "--no-live", "--json",
            "--config", "bench",
            "--storage", storage, "--run-id", run_id, "--versions", "1000000", "--tokens", str(tokens),
            "--time-limit-s", str(time_limit_s), "--chaos",
            str(_plan(workdir / f"{run_id}.yaml", min(1, learners - 1), kill_at))]
    for key, value in bench_overrides(size, learners, fragments, device, steps).items():
        args += ["-o", f"{key}={value}"]
    env = {**os.environ, "DILOCO_LOCAL_DIR": str(workdir / "local"), "OMP_NUM_THREADS": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    t0 = time.time()
    with open(workdir / f"{run_id}.out", "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        watcher = Watcher(proc.pid)
        code = proc.wait()
        peaks = watcher.stop()
    wall = time.time() - t0
    if code != 0:
        tail = (workdir / f"{run_id}.out").read_text()[-3000:]
        raise RuntimeError(f"bench size: `diloco run` of {run_id} exited {code}:\n{tail}")
    from diloco.bench.size_figures import figures

    return {"fragments": fragments, "learners": learners, "device": device, "run_id": run_id, "wall_s": wall,
            "token_budget": tokens, **figures(storage, run_id, peaks, wall)}


def _load() -> dict[str, Any]:
    one, five, fifteen = os.getloadavg()
    return {"loadavg_1m": one, "loadavg_5m": five, "loadavg_15m": fifteen, "cpus": os.cpu_count()}


@benchmark()
def bench_size(
    params: Annotated[str, Opt("--params", help="124m (GPT-2 small's shape), 10m or quick.")] = "124m",
    learners: Annotated[int, Opt("--learners", min=1, help="Learners (one is killed and restarted).")] = 2,
    fragments: Annotated[str, Opt("--fragments", help="Fragment counts, one row each (e.g. 1,4).")] = "1,4",
    device: Annotated[str, Opt("--device",
                               help="The learners' device: cpu, or cuda (the GPU check).")] = "cpu",
    steps: Annotated[int, Opt("--steps", min=8,
                              help="Inner steps per learner: the token budget.")] = STEPS_PER_LEARNER,
    storage: Annotated[str | None, Opt("--storage",
                                       help="Where the runs live (default: a temp dir).")] = None,
    time_limit_s: Annotated[float, Opt("--time-limit-s", min=30.0, help="Each run's time limit.")] = 900.0,
    kill_at: Annotated[int | None, Opt("--kill-at-version", min=1, help=(
        "Kill a learner once this version is committed (default: a third in)."))] = None,
    progress: Callable[[BenchResult], None] | None = None,
) -> BenchResult:
    """A 124M model end to end through `diloco run`: memory per parameter, uploads against deltas, bucket
    growth."""
    kill_at = kill_at or kill_version(steps)
    if params not in SIZES:
        raise ConfigError(f"--params {params!r}: one of {', '.join(SIZES)}")
    counts = [int(c) for c in fragments.split(",") if c.strip()]
    if not counts or any(c < 1 for c in counts) or learners < 1:
        raise ConfigError("--fragments takes counts >= 1 (e.g. 1,4), --learners >= 1")
    result: dict[str, Any] = {"rows": [], "load": {"before": _load()},
                              "config": {"params": params, "learners": learners, "device": device,
                                         "steps_per_learner": steps, "ctx": CTX, "batch": BATCH,
                                         "overrides": bench_overrides(params, learners, 1, device, steps),
                                         "kill": {"learner": min(1, learners - 1), "at_version": kill_at,
                                                  "restart_after_s": RESTART_AFTER_S}}}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="diloco-size-") as tmp:
        for count in counts:
            row = run_row(params, learners, count, device, storage, steps, time_limit_s, Path(tmp), kill_at)
            row["load_after"] = _load()
            result["rows"].append(row)
            if progress is not None:  # each row's table, and the JSON so far: a row takes minutes
                progress(_shown(result))
    result["wall_s"] = time.time() - t0
    result["load"]["after"] = _load()
    result["targets"] = targets(result["rows"])
    return _shown(result)


def targets(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """The issue's targets, over every row (CPU: the learner's peak memory; every device: the rest)."""
    cpu = [r for r in rows if r["device"] == "cpu"]
    return {
        "learner peak RSS <= 24 B/param (CPU)":
            all(r["learner_peak_rss_bytes_per_param"] <= TARGET_LEARNER_B_PER_PARAM for r in cpu)
            if cpu else None,
        "learner upload per phase <= 1.2x its deltas":
            all((r["upload_over_delta"] or 99) <= TARGET_UPLOAD_OVER_DELTA for r in rows),
        "held-out loss falls >= 0.5 nats/byte": all((r["loss_drop"] or 0) >= TARGET_LOSS_DROP for r in rows),
        "killed learner rejoins and contributes again": all(r["rejoined_contributed"] for r in rows),
        "audit OK": all(r["audit_ok"] for r in rows),
    }


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else str(value) if isinstance(value, bool) else format(value, spec)


def _shown(result: dict[str, Any]) -> BenchResult:
    """One column per row (P), one line per figure; the targets after the table."""
    rows = result["rows"]
    r0, kill = rows[0], result["config"]["kill"]
    table = Table(f"bench size: {r0['model_params']:,} params, {r0['learners']} learners, int4, "
                  f"{r0['device']}; learner {kill['learner']} killed at version {kill['at_version']}, "
                  "restarted",
                  ["figure", *(f"P = {r['fragments']}" for r in rows)], labels=1)
    table.rows = [[name, *[_fmt(r.get(key), spec) for r in rows]] for name, key, spec in FIGURES]
    notes = [f"target {name}: {'-' if ok is None else 'met' if ok else 'NOT met'}"
             for name, ok in (result.get("targets") or {}).items()]
    return BenchResult(result, [table], notes)


FIGURES = (("wall s", "wall_s", ".0f"), ("versions", "versions", "d"),
           ("held-out, version 0", "initial_eval_loss", ".3f"),
           ("held-out, final", "final_eval_loss", ".3f"),
           ("learner peak RSS B/param", "learner_peak_rss_bytes_per_param", ".1f"),
           ("  beyond its baseline", "learner_peak_rss_beyond_baseline_bytes_per_param", ".1f"),
           ("merger peak RSS B/param", "merger_peak_rss_bytes_per_param", ".1f"),
           ("learner upload MB / phase", "learner_upload_mb_per_phase", ".2f"),
           ("delta MB / phase", "delta_mb_per_phase", ".2f"), ("upload / delta", "upload_over_delta", ".3f"),
           ("bucket B/param/version", "bucket_bytes_per_param_per_version", ".2f"),
           ("merge s / round", "merge_s_per_round", ".1f"), ("rejoin s (start to join)", "rejoin_s", ".1f"),
           ("killed learner merged again", "rejoined_contributed", ""),
           ("tokens/s merged", "tokens_per_s", ".0f"),
           ("device peak B/param", "device_peak_bytes_per_param", ".1f"), ("audit OK", "audit_ok", ""))

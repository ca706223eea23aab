#!/usr/bin/env bash
# The GPU check, for a machine with CUDA (docs/RANKS.md, "The GPU path"; figures in docs/bench/gpu.md):
#  1. the demo recipe trained on one GPU (learners and evaluator on the device, bf16 autocast; merger on the
#     CPU), audited, the held-out loss must fall;
#  2. `diloco bench size --device cuda`: the 124M row of the CPU benchmark (docs/bench/size.md) on the GPU — a
#     GPT-2-small-shaped model (12 layers, d_model 768, vocabulary 50257) trained end to end by `diloco run`
#     with two GPU learners (bf16 autocast) sharing the device, int4 deltas and updates, one learner killed
#     and restarted, as whole-model deltas and in 4 fragments (FRAGMENTS), each audited; it prints tokens/s,
#     each learner's peak host memory (and beyond its baseline: the target is <= 8 B/param), the device's peak
#     allocation and the merger's, per parameter, and writes $DIR/size.json; the GPU's utilisation and memory
#     (nvidia-smi) beside;
#  3. with >= 2 GPUs, `diloco bench ranks` with a 2-rank NCCL learner (skipped on one GPU).
# Prints the figures and exits non-zero on any failure. About 6 minutes on one H200 (before step 3 existed).
# Run from the repository root after `make setup` with a CUDA build of torch, or with PY=python3 where torch,
# the project's other dependencies and the repo (PYTHONPATH) are importable: prefect and s3fs are not needed.
# Knobs: DEVICE_CHECK_DIR (where the bucket and the figures go), DEMO_S (the demo's time limit), BIG_S (each
# 124M run's), FRAGMENTS (the 124M rows' fragment counts, default 1,4), SIZE_STEPS (inner steps per learner).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DIR=${DEVICE_CHECK_DIR:-out/device-check}
DEMO_S=${DEMO_S:-150}
BIG_S=${BIG_S:-600}
FRAGMENTS=${FRAGMENTS:-1,4}
SIZE_STEPS=${SIZE_STEPS:-96}
mkdir -p "$DIR"
STORE="file://$(cd "$DIR" && pwd)/runs"
"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("device check: torch sees no CUDA device (torch %s)" % torch.__version__)
print("device check:", torch.cuda.device_count(), "x", torch.cuda.get_device_name(0), "torch", torch.__version__)
PYEOF

SMI_PID=
if command -v nvidia-smi >/dev/null; then  # the GPU's load over both runs, every 2 s
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 2 > "$DIR/gpu.csv" &
    SMI_PID=$!
fi
trap '[ -n "$SMI_PID" ] && kill "$SMI_PID" 2>/dev/null || true' EXIT

summarise() {  # $1: the run's JSON summary, $2: what it was, $3: its wall seconds
    "$PY" - "$1" "$2" "$3" <<'PYEOF'
import json, sys
s, what, wall = json.load(open(sys.argv[1])), sys.argv[2], float(sys.argv[3])
e = s["extra"]
assert s["final_eval_loss"] is not None and s["final_eval_loss"] < s["initial_eval_loss"], s
print(f"{what}: {e['num_params']:,} parameters, held-out {s['initial_eval_loss']:.3f} -> {s['final_eval_loss']:.3f} "
      f"nats/byte at version {e['final_eval_version']}, {s['num_versions']} versions, {s['deltas_merged']} deltas "
      f"merged, {e['tokens_merged']:,} tokens merged in {wall:.0f} s ({e['tokens_merged'] / wall:,.0f} tokens/s "
      f"merged), traffic vs data-parallel {e['traffic_ratio_vs_dp']:.0f}x")
busy = [f"{r['learner']} {r['busy']:.2f}" for r in e.get("learners", []) if r.get("busy") is not None]
print(f"{what}: learners busy (inner steps / wall time): {', '.join(busy) or 'not recorded'}")
PYEOF
}

run_and_audit() {  # $1: run id, $2: time limit, $3: label, then the run's own options
    local run=$1 limit=$2 label=$3 start end
    shift 3
    start=$(date +%s)
    if ! "$PY" -m diloco.cli run --no-prefect --no-live --json --storage "$STORE" --run-id "$run" \
        -o learner.device=cuda -o run.max_restarts=2 --time-limit-s "$limit" "$@" > "$DIR/$run.out"; then
        tail -n 30 "$DIR/$run.out"
        for log in .diloco/logs/"$run"/*.log; do echo "== $log"; tail -n 25 "$log"; done
        echo "device check: $label failed"
        exit 1
    fi
    end=$(date +%s)
    tail -n 1 "$DIR/$run.out" > "$DIR/$run.json"
    "$PY" -m diloco.cli audit --storage "$STORE" --run-id "$run"
    summarise "$DIR/$run.json" "$label" $((end - start))
}

STAMP=$(date +%Y%m%d-%H%M%S)
run_and_audit "demo-$STAMP" "$DEMO_S" "demo on GPU" --config demo --versions 20

# the 124M rows: the same command as the CPU benchmark, its learners on CUDA; it exits non-zero if a run fails
if ! "$PY" -m diloco.cli bench size --device cuda --fragments "$FRAGMENTS" --steps "$SIZE_STEPS" \
        --time-limit-s "$BIG_S" --storage "$STORE" --json "$DIR/size.json"; then
    for log in .diloco/logs/size-*/*.log; do echo "== $log"; tail -n 25 "$log"; done
    echo "device check: bench size --device cuda failed"
    exit 1
fi
"$PY" - "$DIR/size.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
for row in r["rows"]:
    def f(key, spec=".1f"):
        return "-" if row.get(key) is None else format(row[key], spec)
    beyond = row.get("learner_peak_rss_beyond_baseline_bytes_per_param")
    print(f"124M on GPU, P = {row['fragments']}: {row['model_params']:,} parameters, held-out "
          f"{f('initial_eval_loss', '.3f')} -> {f('final_eval_loss', '.3f')}, {f('tokens_per_s', '.0f')} "
          f"tokens/s merged; learner host peak {f('learner_peak_rss_bytes_per_param')} B/param "
          f"({f('learner_peak_rss_beyond_baseline_bytes_per_param')} beyond its baseline, target <= 8), "
          f"device peak {f('device_peak_bytes_per_param')} B/param, merger "
          f"{f('merger_peak_rss_bytes_per_param')} B/param; upload / delta {f('upload_over_delta', '.3f')}; "
          f"rejoin {f('rejoin_s')} s; audit {'OK' if row['audit_ok'] else 'FAILED'}")
    assert row["audit_ok"] and (row["loss_drop"] or 0) > 0, row
    if beyond is not None and beyond > 8:
        print(f"device check: the learner's host memory beyond its baseline is {beyond:.1f} B/param "
              "(target <= 8)")
PYEOF

if [ -s "$DIR/gpu.csv" ]; then
    "$PY" - "$DIR/gpu.csv" <<'PYEOF'
import sys
rows = [line.split(", ") for line in open(sys.argv[1]) if line.count(",") == 2]
util = [float(r[1].split()[0]) for r in rows]
mem = [float(r[2].split()[0]) for r in rows]
print(f"GPU over both runs ({len(rows)} samples, 2 s apart): utilisation mean {sum(util) / len(util):.0f}%, "
      f"max {max(util):.0f}%; memory used max {max(mem):,.0f} MiB")
PYEOF
fi
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ]; then
    "$PY" -m diloco.cli bench ranks --config demo --phases 6 --json "$DIR/ranks.json"
else
    echo "one GPU: the 2-rank NCCL learner needs two; skipped"
fi
echo "device check: ok ($DIR)"

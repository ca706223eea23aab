#!/usr/bin/env bash
# The GPU check (issue #16), for a machine with CUDA: (1) the demo recipe trained on one GPU (learners and
# evaluator on the device, bf16 autocast; merger on the CPU), audited; (2) one learner's tokens/s at 1 and
# 2 ranks (`diloco bench ranks`: a 2-rank NCCL world when there are >= 2 GPUs, else 1 vs 2 ranks sharing the
# GPU is skipped). Prints the figures and exits non-zero on any failure. About 3-5 minutes.
# Run from the repository root after `make setup` (a CUDA build of torch is needed: see README).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-out/device-check}
mkdir -p "$OUT"
"$PY" - <<'PYEOF'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("device check: torch sees no CUDA device (torch %s)" % torch.__version__)
print("device check:", torch.cuda.device_count(), "x", torch.cuda.get_device_name(0), "torch", torch.__version__)
PYEOF
STORE="file://$PWD/$OUT/runs"
RUN="device-$(date +%Y%m%d-%H%M%S)"
"$PY" -m diloco.cli run --config demo --no-prefect --no-live --json --storage "$STORE" --run-id "$RUN" \
    -o learner.device=cuda --versions 20 --time-limit-s 240 | tail -n 1 | tee "$OUT/demo.json"
"$PY" -m diloco.cli audit --storage "$STORE" --run-id "$RUN"
"$PY" - "$OUT/demo.json" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["final_eval_loss"] is not None and s["final_eval_loss"] < s["initial_eval_loss"], s
print(f"demo on GPU: held-out {s['initial_eval_loss']:.3f} -> {s['final_eval_loss']:.3f} nats/byte, "
      f"{s['num_versions']} versions, {s['deltas_merged']} deltas merged")
PYEOF
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ]; then
    "$PY" -m diloco.cli bench ranks --config demo --phases 6 --json "$OUT/ranks.json"
else
    echo "one GPU: the 2-rank NCCL learner needs two; skipped"
fi
echo "device check: ok ($OUT)"

"""`diloco bench goodput` bookkeeping: targets are judged from the numbers, a delta merged in two
versions counts as applied twice, restart cost is the median start-to-join delay.
Run: `.venv/bin/pytest tests/unit/test_chaos_bench.py`.
"""

from __future__ import annotations

from diloco.bench.goodput import _applied_twice, _median_startup, targets_met
from diloco.storage import DeltaDecision, Manifest


def _manifest(version: int, merged: list[tuple[str, int]]) -> Manifest:
    return Manifest(run_id="r", version=version, created_at=float(version), params_key="k",
                    params_checksum="x",
                    decisions=[DeltaDecision(learner=n, seq=s, status="merged") for n, s in merged])


def test_applied_twice_counts_repeats() -> None:
    chain = [_manifest(1, [("a", 0), ("b", 0)]), _manifest(2, [("a", 0), ("a", 1)]), _manifest(3, [("a", 0)])]
    assert _applied_twice(chain) == 2
    assert _applied_twice(chain[:1]) == 0


def test_median_startup() -> None:
    events = [
        {"t": 0.0, "source": "supervisor", "kind": "start", "role": "learner", "learner": "a"},
        {"t": 3.0, "source": "a", "kind": "join"},
        {"t": 10.0, "source": "supervisor", "kind": "start", "role": "learner", "learner": "a"},
        {"t": 19.0, "source": "a", "kind": "join"},
        {"t": 20.0, "source": "supervisor", "kind": "start", "role": "learner", "learner": "b"},
        {"t": 25.0, "source": "b", "kind": "join"},
    ]
    assert _median_startup(events) == 5.0


def test_targets_are_judged_from_the_numbers() -> None:
    result = {"decoupled_goodput": 0.9, "availability": 0.93, "dp_goodput": 0.3, "deltas_lost": 0,
              "deltas_applied_twice": 0, "audit_ok": True, "final_eval_loss": 2.02, "no_fault_eval_loss": 2.0}
    assert all(targets_met(result).values())
    worse = {**result, "decoupled_goodput": 0.8, "final_eval_loss": 2.1, "deltas_lost": 1}
    met = targets_met(worse)
    assert not met["decoupled_goodput >= 0.88"] and not met["decoupled_goodput >= 0.95 x availability"]
    assert not met["loss within 2% of no-fault"] and not met["zero lost, zero applied twice"]

"""The merge's guard, as pure functions: control ops applied to the guard state (admit, remove, readmit,
pause, set — a bad op refused, never applied), the fold of a merge's decisions (streaks, quarantine, the
window of norms), the outlier rule (reject, clip, off; silent while warming up) and its determinism, and
manifests written before the guard still parse.

Run: .venv/bin/pytest tests/unit/test_guard.py -q
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from diloco.configs import ConfigError, load_config
from diloco.run.objects import encode_tensors
from diloco.storage import DeltaDecision, Manifest
from diloco.storage.manifest import ControlEntry
from diloco.storage.records import ControlOp, RecordError
from diloco.trust.guard import (
    LIVE_SETTINGS,
    check_settings,
    entry_of,
    fold,
    gate,
    initial_state,
    policy_after,
    window_median,
)
from diloco.trust.judge import Judge, delta_norm

CFG = load_config("tiny")


def op(kind: str, n: int, **fields) -> ControlEntry:
    return entry_of(f"{n:020d}-0000000{n % 10}", ControlOp(kind=kind, t=float(n), by="ann@host", **fields))


def test_ops_change_membership_pause_and_settings_in_order() -> None:
    state = initial_state(["a", "b"])
    entries = [op("admit", 1, learner="c"), op("pause-merges", 2), op("remove", 3, learner="b"),
               op("set", 4, values={"merger.quorum": 2, "outer.lr": 0.5}), op("admit", 5, learner="b")]
    policy = policy_after(state, entries, CFG)
    assert policy.state.members == ["a", "c"] and policy.state.removed == ["b"]
    assert policy.state.paused and policy.state.settings == {"merger.quorum": 2, "outer.lr": 0.5}
    assert policy.cfg.merger.quorum == 2 and policy.cfg.outer.lr == 0.5
    assert [e.refused for e in policy.entries][:4] == ["", "", "", ""]
    assert "removal is for good" in policy.entries[4].refused  # a removed name is never admitted again
    assert policy.state.ops_cursor == entries[-1].name
    assert state.members == ["a", "b"], "the input state is never modified"
    assert policy_after(policy.state, [op("resume-merges", 6)], CFG).state.paused is False


def test_a_bad_op_is_recorded_as_refused_and_changes_nothing() -> None:
    state = initial_state(["a"])
    bad = [op("set", 1, values={"model.d_model": 64}), op("set", 2, values={"merger.quorum": 0}),
           op("admit", 3, learner="Not_A_Name"),
           entry_of("00000000000000000004-00000004", RecordError("junk"))]
    policy = policy_after(state, bad, CFG)
    assert all(e.refused for e in policy.entries), policy.entries
    assert "cannot change during a run" in policy.entries[0].refused
    assert policy.entries[3].kind == "invalid"
    assert policy.state.settings == {} and policy.state.members == ["a"]
    assert policy.state.ops_cursor == "00000000000000000004-00000004"  # decided: never looked at again


def test_live_settings_are_validated_by_the_config() -> None:
    assert check_settings(CFG, {"merger.grace_cap_s": 1.5}).merger.grace_cap_s == 1.5
    with pytest.raises(ConfigError, match="run.num_learners cannot change"):
        check_settings(CFG, {"run.num_learners": 9})
    with pytest.raises(ConfigError, match="outer.lr"):
        check_settings(CFG, {"outer.lr": -1})
    assert "merger.quorum" in LIVE_SETTINGS and "outer.lr" in LIVE_SETTINGS


def _d(learner: str, seq: int, status: str = "merged", check: str = "", norm: float = 10.0, steps: int = 10,
       clip: float | None = None) -> DeltaDecision:
    return DeltaDecision(learner=learner, seq=seq, status=status, check=check, norm=norm, steps=steps,
                         clip_scale=clip, reason="" if status == "merged" else f"{check}: x")


def test_integrity_rejections_in_a_row_quarantine_and_a_merge_resets_the_streak() -> None:
    state = initial_state(["a", "b"])
    state, newly = fold(state, [_d("a", 0, "rejected", "outlier"), _d("a", 1, "rejected", "codec"),
                                _d("b", 0, "rejected", "outlier"), _d("b", 1)], 1, CFG)
    assert newly == [] and state.streaks == {"a": 2}
    state, newly = fold(state, [_d("a", 2, "rejected", "stale"), _d("a", 3, "rejected", "signature"),
                                _d("a", 4, "rejected", "size")], 2, CFG)
    # neither stale, a bad signature nor a size counts, nor breaks it
    assert newly == [] and state.streaks == {"a": 2}
    state, newly = fold(state, [_d("a", 5, "rejected", "invalid")], 2, CFG)
    assert newly == ["a"] and "since version 2" in state.quarantined["a"]
    policy = policy_after(state, [], CFG)
    rejected = gate(policy, "a", 6)
    assert rejected is not None and rejected.check == "quarantine" and "diloco readmit" in rejected.reason
    assert gate(policy, "b", 2) is None
    assert gate(policy, "stranger", 0).check == "admission"
    readmitted = policy_after(state, [op("readmit", 1, learner="a")], CFG).state
    assert "a" not in readmitted.quarantined and "a" not in readmitted.streaks


def test_the_window_keeps_the_last_merged_unclipped_norms_per_step() -> None:
    cfg = CFG.with_overrides({"merger.outlier_window": 4, "merger.outlier_min_samples": 3})
    state = initial_state(["a"])
    state, _ = fold(state, [_d("a", i, norm=float(i + 1) * 10, steps=10) for i in range(6)], 1, cfg)
    assert state.norms == [3.0, 4.0, 5.0, 6.0]
    state, _ = fold(state, [_d("a", 6, norm=1e6, clip=0.01),
                            _d("a", 7, "rejected", "outlier", norm=1e6)], 2, cfg)
    assert state.norms == [3.0, 4.0, 5.0, 6.0] and state.streaks == {"a": 2}
    assert window_median(state, cfg) == 4.5
    assert window_median(initial_state(["a"]), cfg) is None


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 4, generator=gen), "b": torch.randn(4, generator=gen)}


def _delta_bytes(params, scale: float, learner: str = "a", seq: int = 0) -> bytes:
    delta = {k: v * scale for k, v in params.items()}
    meta = {"learner": learner, "seq": seq, "base_version": 3, "tokens": 100, "steps": 10}
    return encode_tensors(delta, codec_name="fp32", kind="delta", fingerprint="f" * 16, meta=meta)


def _judge(rule: str, norms: list[float]) -> Judge:
    cfg = CFG.with_overrides({"merger.outlier_rule": rule, "merger.outlier_threshold": 10.0})
    state = initial_state(["a"]).model_copy(update={"norms": norms})
    return Judge("r", "f" * 16, 3, _params(), policy_after(state, [], cfg))


@pytest.mark.parametrize("rule", ["reject", "clip", "off"])
def test_the_outlier_rule(rule: str) -> None:
    params = _params()
    honest_per_step = delta_norm(params) / 10
    judge = _judge(rule, [honest_per_step] * 8)
    data = _delta_bytes(params, 1000.0)
    d, _, delta = judge.judge("a", 0, len(data), data)
    if rule == "off":
        assert d.status == "merged" and d.clip_scale is None
    elif rule == "reject":
        assert d.status == "rejected" and d.check == "outlier"
        assert d.reason.startswith("outlier: norm per step") and "1000x the median" in d.reason
    else:
        assert d.status == "merged" and d.check == "outlier" and d.reason.startswith("clipped:")
        assert d.clip_scale == pytest.approx(10 / 1000)
        assert delta_norm(delta) / 10 == pytest.approx(10 * honest_per_step, rel=1e-5)  # at the bound
    honest = _delta_bytes(params, 1.5, seq=1)
    assert judge.judge("a", 1, len(honest), honest)[0].status == "merged"
    again = _judge(rule, [honest_per_step] * 8).judge("a", 0, len(data), data)[0]
    assert again == d, "the same inputs give the same decision, bit for bit"


def test_the_rule_is_silent_until_the_window_has_min_samples() -> None:
    params = _params()
    data = _delta_bytes(params, 1000.0)
    d, _, _ = _judge("reject", [delta_norm(params) / 10] * 7).judge("a", 0, len(data), data)
    assert d.status == "merged" and d.norm == pytest.approx(1000 * delta_norm(params), rel=1e-6)


def test_a_manifest_written_before_the_guard_still_parses() -> None:
    old = {"schema_version": 1, "run_id": "r", "version": 3, "parent": 2, "created_at": 1.0, "merger_id": "m",
           "params_key": "r/global/x.params", "params_checksum": "c", "update_key": "", "update_checksum": "",
           "outer_key": "", "outer_checksum": "", "cursors": {"a": 1}, "tokens_total": 5, "timing": {},
           "stats": {},
           "decisions": [{"learner": "a", "seq": 1, "status": "rejected", "reason": "stale: x",
                          "base_version": 0, "staleness": 9, "tokens": 0, "steps": 0, "weight": 0.0,
                          "bytes": 10, "checksum": "k"}]}
    m = Manifest.from_bytes(json.dumps(old).encode())
    assert m.guard is None and m.controls == [] and m.decisions[0].check == "" and m.decisions[0].norm is None


def test_the_last_eligible_members_are_never_quarantined_the_merges_pause() -> None:
    """Trust rules 2 (issue #44, invariant 6): a quarantine that would leave nobody to merge pauses the merges
    instead (an operator looks), and the window takes one sample per learner per merge with its owner."""
    state = initial_state(["a", "b"])
    state.quarantined["b"] = "since version 1: a test"
    for seq in range(2):
        state, newly = fold(state, [_d("a", seq, "rejected", "invalid")], 2, CFG, rules=2)
    state, newly = fold(state, [_d("a", 2, "rejected", "invalid")], 3, CFG, rules=2)
    assert newly == [] and "a" not in state.quarantined and state.paused
    state, _ = fold(initial_state(["a", "b"]), [_d("a", 0), _d("a", 1, norm=30.0), _d("b", 0, norm=20.0)],
                    1, CFG, rules=2)
    assert state.norms == [3.0, 2.0] and state.norm_learners == ["a", "b"]  # a's last, then b's


def test_a_window_kept_apart_leaves_the_manifest_and_an_inline_one_stays():
    """Trust rules 3 (storage/window.py): a manifest naming its window object stores no norms, owners or
    outlier stats; one that names none (runs made before) stores them as before and is read as it is."""
    from diloco.storage.keys import RunKeys
    from diloco.storage.manifest import GuardState, WindowRef
    from diloco.storage.window import with_window

    guard = GuardState(members=["a"], norms=[1.0], norm_learners=["a"])
    inline = Manifest(run_id="r", version=1, parent=0, created_at=0.0, params_key="k", guard=guard,
                      stats={"outlier_median": 1.0, "outlier_bound": 10.0})
    raw = inline.to_bytes()
    assert b'"norms"' in raw and b"outlier_median" in raw and b'"window"' not in raw
    assert with_window(None, RunKeys("r"), Manifest.from_bytes(raw)) == inline  # no read: inline values
    ref = WindowRef(key=RunKeys("r").guard_window(1, "ab" * 8), checksum="x")
    kept = inline.model_copy(update={"guard": guard.model_copy(update={"window": ref})})
    stored = Manifest.from_bytes(kept.to_bytes())
    assert stored.guard.norms == [] and stored.guard.norm_learners == [] and stored.guard.window == ref
    assert "outlier_median" not in stored.stats and "outlier_bound" not in stored.stats


@pytest.mark.parametrize("rule", ["reject", "clip", "off"])
def test_a_judge_with_a_worker_thread_decides_the_same_bits(rule: str) -> None:
    """The merger's judge computes the norms' squares and the checksum on a second thread while it decodes:
    the decision (norm, checksum, clip scale, reason) and the delta are bit for bit the one-thread judge's
    (audit judges on one thread and compares)."""
    from concurrent.futures import ThreadPoolExecutor

    from diloco.merger.decide import FoldGate

    gen = torch.Generator().manual_seed(0)  # tensors of very different sizes and scales: an order would show
    params = {f"t{i}": torch.randn(n, generator=gen) * 10.0 ** e
              for i, (n, e) in enumerate([(3, 9), (300, 0), (1, 1), (257, 0), (64, 0)])}
    honest_per_step = delta_norm(params) / 10
    cfg = CFG.with_overrides({"merger.outlier_rule": rule, "merger.outlier_threshold": 10.0})

    def judge() -> Judge:
        state = initial_state(["a"]).model_copy(update={"norms": [honest_per_step] * 8})
        return Judge("r", "f" * 16, 3, params, policy_after(state, [], cfg))

    assert delta_norm(dict(reversed(params.items()))) != delta_norm(params)  # the order would show
    for scale, seq in ((1000.0, 0), (1.5, 1), (float("nan"), 2)):
        data = _delta_bytes(params, scale, seq=seq)
        one = judge().judge("a", seq, len(data), data)
        with ThreadPoolExecutor(1) as worker:
            two = dataclasses.replace(judge(), worker=worker, gate=FoldGate()).judge("a", seq, len(data),
                                                                                      data)
        assert two[0] == one[0] and two[0].checksum and (scale == scale) == (two[0].norm is not None)
        assert (one[2] is None) == (two[2] is None)
        for name in one[2] or {}:
            assert torch.equal(one[2][name], two[2][name])


def test_the_fold_gate_lets_a_decode_pass_once_the_fold_freed_that_tensor() -> None:
    import threading

    from diloco.merger.decide import FoldGate

    gate, passed = FoldGate(), []
    gate.wait(5)  # no fold pending: no wait
    gate.started()
    waiter = threading.Thread(target=lambda: (gate.wait(1), passed.append(1)))
    waiter.start()
    gate.folded(0)
    waiter.join(0.2)
    assert not passed, "tensor 1 of the fold is not freed yet"
    gate.folded(1)
    waiter.join(5)
    assert passed == [1]
    gate.started()
    waiter = threading.Thread(target=lambda: (gate.wait(7), passed.append(7)))
    waiter.start()
    gate.finished()  # a fold that ends (or fails) lets every waiter go
    waiter.join(5)
    assert passed == [1, 7]

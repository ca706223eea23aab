"""Typed bucket records (storage/records.py): each round-trips, a learner's NaN loss survives, bad bytes
raise RecordError naming the object and the field, write_record's exclusive create is exclusive, and the
control flags (stop, removed) are written as records and seen by their signals.
Run: `.venv/bin/pytest tests/unit/test_records.py`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from diloco.run.signals import RemovedSignal, request_remove, request_stop
from diloco.storage import Conflict, NotFound, RunKeys, open_store
from diloco.storage.records import (
    EvalRecord,
    LearnerStatus,
    RecordError,
    RemovedMark,
    RunRecord,
    StopRequest,
    read_record,
    write_record,
)

STATUS = {"learner": "a-0", "state": "training", "t": 12.5, "pid": 7, "seq": 3, "base_version": 2, "step": 40,
          "cursor": 640, "loss": 4.25, "bytes_published": 1000}


@pytest.mark.parametrize("record", [
    RunRecord(run_id="r", created_at=1.0, created_by="host", diloco_version="0.1", fingerprint="f",
              learners=["a-0", "b-0"], config={"run": {"num_versions": 3}}),
    LearnerStatus(**STATUS),
    LearnerStatus(**STATUS, tokens_per_phase=2560, stall_s=0.0, steps_per_s=9.5),
    EvalRecord(version=4, loss=3.5, bits_per_byte=5.05, tokens_total=10240, t=3.0, committed_at=2.0),
    StopRequest(reason="operator", t=5.0),
    RemovedMark(reason="operator", t=6.0),
])
def test_records_round_trip(record) -> None:
    assert type(record).from_bytes(record.to_bytes()) == record


def test_status_keeps_a_nan_loss_and_leaves_unset_figures_out() -> None:
    data = LearnerStatus(**{**STATUS, "loss": float("nan")}).to_bytes()
    obj = json.loads(data)  # what the supervisor and the CLI read
    assert math.isnan(obj["loss"]) and b"NaN" in data
    assert "steps_per_s" not in obj and "tokens_per_phase" not in obj
    assert math.isnan(LearnerStatus.from_bytes(data).loss)


@pytest.mark.parametrize("data, needle", [
    (b"{", "not valid JSON"),
    (b"\xff", "not valid JSON"),
    (b"[1]", "must be a JSON object"),
    (json.dumps({**STATUS, "pid": "seven"}).encode(), "pid"),
    (json.dumps({k: v for k, v in STATUS.items() if k != "t"}).encode(), "t: Field required"),
    (json.dumps({**STATUS, "surprise": 1}).encode(), "surprise"),
])
def test_bad_bytes_name_the_object_and_the_field(data: bytes, needle: str) -> None:
    with pytest.raises(RecordError, match="learner status 'r/learners/a-0/status.json'") as info:
        LearnerStatus.from_bytes(data, key="r/learners/a-0/status.json")
    assert needle in str(info.value)


def test_run_record_refuses_an_unknown_schema() -> None:
    with pytest.raises(RecordError, match="schema_version 2 is unknown"):
        RunRecord.from_bytes(b'{"schema_version": 2}')
    with pytest.raises(RecordError, match="schema_version None"):
        RunRecord.from_bytes(b'{"run_id": "r"}')


def test_eval_record_defaults_what_older_writers_left_out() -> None:
    record = EvalRecord.from_bytes(b'{"version": 1, "loss": 2.0, "bits_per_byte": 2.9}')
    assert record.tokens_total == 0 and record.t == 0.0 and record.committed_at == 0.0


def test_read_and_write_record(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}")
    stop = StopRequest(reason="done", t=1.0)
    write_record(store, "r/control/stop", stop, exclusive=True)
    assert read_record(store, "r/control/stop", StopRequest) == stop
    with pytest.raises(Conflict):
        write_record(store, "r/control/stop", StopRequest(reason="other", t=2.0), exclusive=True)
    write_record(store, "r/control/stop", StopRequest(reason="again", t=3.0))  # put overwrites
    assert read_record(store, "r/control/stop", StopRequest).reason == "again"
    with pytest.raises(NotFound):
        read_record(store, "r/control/none", StopRequest)
    with pytest.raises(RecordError, match="eval record 'r/control/stop'"):
        read_record(store, "r/control/stop", EvalRecord)


def test_control_flags_are_records_and_signals_see_them(tmp_path: Path) -> None:
    ctx = SimpleNamespace(store=open_store(f"file://{tmp_path}"), keys=RunKeys("r"))
    removed = RemovedSignal(ctx, "a-0", every_s=0.0)  # type: ignore[arg-type]
    assert not removed()
    request_remove(ctx, "a-0", "broken host")  # type: ignore[arg-type]
    assert removed()
    assert read_record(ctx.store, "r/control/removed-a-0", RemovedMark).reason == "broken host"
    request_stop(ctx, "operator")  # type: ignore[arg-type]
    assert read_record(ctx.store, ctx.keys.stop(), StopRequest).reason == "operator"

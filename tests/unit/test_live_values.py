"""Issue #44: a value an operator types is read by its config field's type (configs.values) and must be
finite; a live setting that would reject what the run sends is refused unless forced (trust.settings); an op
file holding inf or nan is unusable (records.ControlOp); a heartbeat far ahead of the reader's clock is no
sign of life (records.beat_age). The live runs these guard: tests/integration/test_live_settings.py,
test_policy_inputs.py.

Run: .venv/bin/pytest tests/unit/test_live_values.py -q
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from diloco.configs import ConfigError, load_config, parse_overrides, parse_value, typed_value
from diloco.run.create import create_run
from diloco.storage import open_store
from diloco.storage.records import CLOCK_SKEW_S, ControlOp, RecordError, beat_age
from diloco.trust.guard import initial_state, policy_after
from diloco.trust.settings import check_live

PARSED = [  # (key, text, value): each by the field's type
    ("merger.outlier_rule", "off", "off"), ("merger.quorum", "3", 3), ("outer.lr", "1", 1.0),
    ("merger.poll_interval_s", "0.05", 0.05), ("learner.sign", "true", True),
    ("learner.encode_in_background", "auto", "auto"), ("learner.encode_in_background", "false", False),
    ("data.corpus", "null", None), ("data.corpus", "plays.txt", "plays.txt"),
    ("data.heldout", "[a, b]", ["a", "b"]),
    ("spec_args.width", "64", 64), ("run.learner_prefix", "007", "007"),
]
REFUSED = [  # (key, text, what the error says)
    ("merger.quorum", "true", "must be an integer"), ("merger.quorum", "2.0", "must be an integer"),
    ("merger.poll_interval_s", ".inf", "finite"), ("merger.poll_interval_s", "1e400", "finite"),
    ("outer.lr", "nan", "finite"), ("outer.lr", "-inf", "finite"), ("merger.outlier_rule", "false", "one of"),
    ("learner.sign", "1", "true or false"), ("spec_args.x", ".inf", "finite"),
]


@pytest.mark.parametrize(("key", "text", "value"), PARSED)
def test_a_typed_value_is_read_by_its_fields_type(key: str, text: str, value: object) -> None:
    got = parse_value(key, text)
    assert got == value and type(got) is type(value)
    assert parse_overrides([f"{key}={text}"]) == {key: value}


@pytest.mark.parametrize(("key", "text", "why"), REFUSED)
def test_a_wrong_type_or_a_value_not_finite_is_refused_naming_the_field(key: str, text: str, why: str):
    with pytest.raises(ConfigError, match=why) as err:
        parse_value(key, text)
    assert str(err.value).startswith(f"{key}=")


def test_python_values_are_checked_not_coerced() -> None:
    assert typed_value("outer.lr", 1) == 1.0 and typed_value("merger.quorum", "4") == 4
    for key, value in (("merger.quorum", True), ("merger.quorum", 2.0), ("outer.lr", math.inf),
                       ("merger.outlier_rule", False), ("merger.gap_timeout_s", math.nan)):
        with pytest.raises(ConfigError, match=key):
            typed_value(key, value)
    yaml_off = load_config("tiny").with_overrides({"merger.outlier_rule": False})  # a recipe's bare `off`
    assert yaml_off.merger.outlier_rule == "off"


def test_an_op_file_with_inf_or_nan_is_unusable() -> None:
    for text in (b'{"kind": "set", "t": 1, "by": "x", "values": {"outer.lr": Infinity}}',
                 b'{"kind": "set", "t": 1, "by": "x", "values": {"outer.lr": 1e400}}',
                 b'{"kind": "resume", "t": 1, "by": "x", "values": {"a": [NaN]}}'):
        with pytest.raises(RecordError, match="not a finite value"):
            ControlOp.from_bytes(text)


def test_a_beat_far_ahead_of_the_readers_clock_is_ignored() -> None:
    now = 1_000_000.0
    assert beat_age(now - 30, now) == 30 and beat_age(now + 5, now) == 0.0
    assert beat_age(now + CLOCK_SKEW_S + 1, now) is None and beat_age(math.inf, now) is None


def test_a_threshold_below_the_honest_windows_ratios_needs_force(tmp_path: Path) -> None:
    ctx = create_run(open_store(f"file://{tmp_path}/b"), "w", load_config("tiny"))
    state = initial_state(ctx.learners).model_copy(update={"norms": [1.0] * 10 + [2.5, 3.0]})
    policy = policy_after(state, [], ctx.cfg)
    assert check_live(ctx, policy, {"merger.outlier_threshold": 5}) == {"merger.outlier_threshold": 5.0}
    with pytest.raises(ConfigError, match=r"2 of the 12 honest deltas .*up to 3x the median.*--force"):
        check_live(ctx, policy, {"merger.outlier_threshold": 2})
    forced = check_live(ctx, policy, {"merger.outlier_threshold": 2}, force=True)
    assert forced == {"merger.outlier_threshold": 2.0}
    with pytest.raises(ConfigError, match="cannot change during a run"):
        check_live(ctx, policy, {"run.num_learners": 3}, force=True)

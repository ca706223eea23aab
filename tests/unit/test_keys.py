"""The bucket layout: exact key formats, lexical order of padded numbers, validation, parsing.

Property-based: no name the validators accept can produce a key outside `<run>/`.
Run: `.venv/bin/pytest tests/unit/test_keys.py`.
"""

from __future__ import annotations

import posixpath
import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from diloco.storage.heads import encode_heads, parse_heads
from diloco.storage.keys import (
    InvalidName,
    RunKeys,
    new_nonce,
    parse_delta_key,
    parse_heads_key,
    parse_manifest_key,
    validate_learner_name,
    validate_run_id,
)
from diloco.storage.store import check_key

K = RunKeys("run-1")
NONCE = "0123456789abcdef"


def test_layout_formats() -> None:
    assert K.run_json() == "run-1/run.json"
    assert K.versions_prefix() == "run-1/versions/"
    assert K.manifest(7) == "run-1/versions/00000000000000000007.json"
    assert K.params(7, NONCE) == "run-1/global/00000000000000000007-0123456789abcdef.params"
    assert K.update(7, NONCE) == "run-1/global/00000000000000000007-0123456789abcdef.update"
    assert K.outer(7, NONCE) == "run-1/global/00000000000000000007-0123456789abcdef.outer"
    assert K.deltas_prefix() == "run-1/deltas/"
    assert K.deltas_prefix("us-east-0") == "run-1/deltas/us-east-0/"
    assert K.delta("us-east-0", 42) == "run-1/deltas/us-east-0/000000000042.delta"
    assert K.learners_prefix() == "run-1/learners/"
    assert K.status("eu-1") == "run-1/learners/eu-1/status.json"
    assert K.checkpoint("eu-1", "inner.state") == "run-1/learners/eu-1/checkpoint/inner.state"
    assert K.eval(3) == "run-1/evals/00000000000000000003.json"
    assert K.evals_prefix() == "run-1/evals/"
    assert K.event("merger", "part-000001") == "run-1/events/merger/part-000001.jsonl"
    assert K.events_prefix() == "run-1/events/"
    assert K.stop() == "run-1/control/stop"
    assert K.control("pause") == "run-1/control/pause"


def test_every_key_is_a_valid_store_key() -> None:
    keys = [K.run_json(), K.manifest(0), K.params(0, NONCE), K.delta("a", 0), K.status("a"),
            K.checkpoint("a", "x"), K.eval(0), K.event("a", "b"), K.stop()]
    for key in keys:
        assert check_key(key) == key


@given(st.lists(st.integers(min_value=0, max_value=10**20 - 1), min_size=2, max_size=20))
def test_padded_versions_sort_lexically_in_numeric_order(versions: list[int]) -> None:
    assert sorted(K.manifest(v) for v in versions) == [K.manifest(v) for v in sorted(versions)]
    assert sorted(K.eval(v) for v in versions) == [K.eval(v) for v in sorted(versions)]


@given(st.lists(st.integers(min_value=0, max_value=10**12 - 1), min_size=2, max_size=20))
def test_padded_seqs_sort_lexically_in_numeric_order(seqs: list[int]) -> None:
    assert sorted(K.delta("a", s) for s in seqs) == [K.delta("a", s) for s in sorted(seqs)]


@pytest.mark.parametrize(
    "name",
    ["../x", "a/b", "A", "", "x" * 49, "é", "ü-1", ".", "..", "a_b", "a.b", "a b", "a\n", "a\\b",
     "١٢", None, 3, b"abc"],
)
def test_hostile_learner_names_are_rejected(name: object) -> None:
    with pytest.raises(InvalidName, match="learner name"):
        validate_learner_name(name)  # type: ignore[arg-type]
    with pytest.raises(InvalidName):
        K.delta(name, 0)  # type: ignore[arg-type]
    with pytest.raises(InvalidName):
        K.status(name)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["a", "us-east-0", "0", "-", "x" * 48])
def test_good_learner_names_are_accepted(name: str) -> None:
    assert validate_learner_name(name) == name


@pytest.mark.parametrize(
    "run_id", ["", ".", "..", "a..b", "-a", ".a", "_a", "A", "a/b", "a\\b", "r" * 65, "é", "a\n", "a b", None]
)
def test_bad_run_ids_are_rejected(run_id: object) -> None:
    with pytest.raises(InvalidName, match="run id"):
        validate_run_id(run_id)  # type: ignore[arg-type]
    with pytest.raises(InvalidName):
        RunKeys(run_id)  # type: ignore[arg-type]


@pytest.mark.parametrize("run_id", ["a", "run-1", "2026.05.01_x", "r" * 64, "a.b"])
def test_good_run_ids_are_accepted(run_id: str) -> None:
    assert RunKeys(run_id).run_id == run_id


@pytest.mark.parametrize("bad", [-1, 10**20, True, 1.0, "3", None])
def test_bad_versions_are_rejected(bad: object) -> None:
    for build in (K.manifest, K.eval, lambda v: K.params(v, NONCE)):
        with pytest.raises(InvalidName, match="version"):
            build(bad)


@pytest.mark.parametrize("bad", [-1, 10**12, False, 2.0, "1"])
def test_bad_seqs_are_rejected(bad: object) -> None:
    with pytest.raises(InvalidName, match="seq"):
        K.delta("a", bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("nonce", ["", "abc", "0123456G", "ABCDEF01", "a" * 33, "../../x", "0123abcd/"])
def test_bad_nonces_are_rejected(nonce: str) -> None:
    with pytest.raises(InvalidName, match="nonce"):
        K.params(1, nonce)


@pytest.mark.parametrize("name", ["", ".hidden", "..", "a/b", "A", "x" * 65, "a b", "é"])
def test_bad_names_are_rejected(name: str) -> None:
    for build in (lambda n: K.checkpoint("a", n), lambda n: K.event(n, "x"), lambda n: K.event("a", n),
                  K.control):
        with pytest.raises(InvalidName):
            build(name)


def test_parse_manifest_key() -> None:
    assert parse_manifest_key(K.manifest(0)) == 0
    assert parse_manifest_key(K.manifest(12345)) == 12345
    assert parse_manifest_key("versions/00000000000000000009.json") == 9
    for bad in ["run-1/versions/7.json", "run-1/versions/00000000000000000007.json.tmp",
                "run-1/evals/00000000000000000007.json", "run-1/versions/0000000000000000000x.json",
                "run-1/versions/" + "١" * 20 + ".json", K.delta("a", 1), ""]:
        assert parse_manifest_key(bad) is None, bad


def test_parse_delta_key() -> None:
    assert parse_delta_key(K.delta("us-east-0", 17)) == ("us-east-0", 17)
    assert parse_delta_key("deltas/a/000000000000.delta") == ("a", 0)
    for bad in ["run-1/deltas/us-east-0/17.delta", "run-1/deltas/US/000000000001.delta",
                "run-1/deltas/a/b/000000000001.delta", "run-1/deltas/a/000000000001.delta.part",
                "run-1/deltas/000000000001.delta", K.manifest(1), ""]:
        assert parse_delta_key(bad) is None, bad


def test_new_nonce_is_fresh_and_valid() -> None:
    nonces = {new_nonce() for _ in range(100)}
    assert len(nonces) == 100
    assert all(re.fullmatch(r"[0-9a-f]{16}", n) for n in nonces)
    assert K.params(0, new_nonce()).startswith("run-1/global/")


def _inside(run_id: str, key: str) -> bool:
    normal = posixpath.normpath(key)
    return normal == key and key.startswith(run_id + "/") and ".." not in key.split("/")


def _names(pattern: str) -> st.SearchStrategy[str]:
    """The accepted pattern, short strings of path-ish characters, hostile characters, any text."""
    return st.one_of(
        st.from_regex(pattern, fullmatch=True),
        st.text(alphabet="a0-._/", max_size=12),
        st.text(alphabet="a0-./\\\n\x00Aé:~", max_size=12),
        st.text(max_size=70),
    )


@settings(max_examples=400)
@given(
    run_id=_names(r"[a-z0-9][a-z0-9._-]{0,63}"),
    learner=_names(r"[a-z0-9-]{1,48}"),
    name=_names(r"[a-z0-9._-]{1,64}"),
    seq=st.integers(min_value=-2, max_value=10**13),
    version=st.integers(min_value=-2, max_value=10**21),
    nonce=_names(r"[0-9a-f]{8,32}"),
)
@example(run_id="r", learner="../x", name="../x", seq=0, version=0, nonce="/../../../../x")
@example(run_id="r", learner="a/b", name="a/b", seq=0, version=0, nonce="0123abcd/")
@example(run_id="r", learner="..", name="..", seq=-1, version=-1, nonce="..")
def test_no_accepted_input_escapes_the_run(
    run_id: str, learner: str, name: str, seq: int, version: int, nonce: str
) -> None:
    try:
        keys = RunKeys(run_id)
    except InvalidName:
        return
    builders = [
        lambda: keys.delta(learner, seq), lambda: keys.status(learner), lambda: keys.deltas_prefix(learner),
        lambda: keys.checkpoint(learner, name), lambda: keys.event(learner, name), lambda: keys.control(name),
        lambda: keys.manifest(version), lambda: keys.params(version, nonce), lambda: keys.eval(version),
    ]
    for build in builders:
        try:
            key = build()
        except InvalidName:
            continue
        assert _inside(run_id, key.rstrip("/")), key
        check_key(key.rstrip("/"))


@given(st.from_regex(r"[a-z0-9-]{1,48}", fullmatch=True), st.integers(0, 10**12 - 1))
def test_delta_keys_roundtrip_through_the_parser(learner: str, seq: int) -> None:
    assert parse_delta_key(K.delta(learner, seq)) == (learner, seq)


@given(st.integers(0, 9999))
def test_heads_keys_roundtrip_and_stay_in_the_runs_global(shard: int) -> None:
    key = K.for_fragment(3).heads(shard)  # any chain's keys: the run's root global/
    assert key == f"{K.run_id}/global/heads-{shard:04d}.json" and parse_heads_key(key) == shard
    assert parse_heads_key(K.params(1, "0123abcd")) is None


def test_heads_objects_that_are_not_heads_are_no_news() -> None:
    assert parse_heads(encode_heads("merger", {0: 3, 7: 2})) == {0: 3, 7: 2}
    for bad in [b"", b"\x00", b"[]", b'{"format": 2, "versions": {}}', b'{"format": 1, "versions": []}',
                b'{"format": 1, "versions": {"x": 1}}', b'{"format": 1, "versions": {"0": -1}}',
                b'{"format": 1, "versions": {"0": 1.5}}', b'{"format": 1, "versions": {"0": true}}',
                b'{"format": 1, "versions": {"10000": 1}}', b"[" * 100_000,
                b'{"format": 1, "versions": {"0": 1}, "pad": "' + b"x" * (1 << 20) + b'"}']:
        assert parse_heads(bad) is None, bad[:40]

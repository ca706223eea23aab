"""Signing (HMAC-SHA256 over run, learner, seq and the delta's bytes; keys from the environment, never the
bucket; a forged, replayed, unsigned or junk signature refused with its reason) and the least-privilege bucket
policies (each role's allowed and denied requests, for an s3:// run only).

Run: .venv/bin/pytest tests/unit/test_signing_and_policy.py -q
"""

from __future__ import annotations

import fnmatch
import json

import pytest

from diloco.run.context import RunError
from diloco.storage.keys import RunKeys, parse_delta_key, parse_op_key
from diloco.trust.bucket_policy import DELETE, LIST, READ, ROLES, WRITE, allows, policy_for
from diloco.trust.signing import SigningError, learner_key, load_keyring, new_key, parse_keyring, sign, verify

KEY, OTHER = new_key().encode(), new_key().encode()
DATA = b"DLCO a delta's bytes"


def test_a_signature_verifies_and_every_forgery_is_refused_with_a_reason() -> None:
    sig = sign(KEY, "r", "a-0", 3, DATA)
    assert verify([KEY], "r", "a-0", 3, DATA, sig) == ""
    assert verify([OTHER, KEY], "r", "a-0", 3, DATA, sig) == ""  # a rotated keyring holds both keys
    assert "does not match" in verify([OTHER], "r", "a-0", 3, DATA, sig)  # another key
    assert "does not match" in verify([KEY], "r", "a-0", 3, DATA + b"!", sig)  # other bytes
    assert "does not match" in verify([KEY], "r", "a-0", 4, DATA, sig)  # replayed under another seq
    assert "does not match" in verify([KEY], "fork", "a-0", 3, DATA, sig)  # replayed into another run
    assert verify([KEY], "r", "a-0", 3, DATA, None).startswith("unsigned")
    assert "no key for learner" in verify([], "r", "a-0", 3, DATA, sig)
    assert "not valid JSON" in verify([KEY], "r", "a-0", 3, DATA, b"\x80junk")
    assert "not an hmac-sha256" in verify([KEY], "r", "a-0", 3, DATA, b'{"alg": "none", "mac": ""}')
    assert "not a signature" in verify([KEY], "r", "a-0", 3, DATA, b"x" * 5000)


def test_keys_come_from_the_environment_and_must_be_long_enough() -> None:
    assert learner_key({"DILOCO_SIGNING_KEY": KEY.decode()}) == KEY
    with pytest.raises(SigningError, match="DILOCO_SIGNING_KEY"):
        learner_key({})
    with pytest.raises(SigningError, match="at least 16"):
        learner_key({"DILOCO_SIGNING_KEY": "short"})
    with pytest.raises(SigningError, match="Secret blocks cannot be read here"):
        learner_key({"DILOCO_SIGNING_KEY_BLOCK": "k"})
    assert learner_key({"DILOCO_SIGNING_KEY_BLOCK": "k"}, load_block=lambda name: f"key-of-{name}-" * 2)
    ring = load_keyring({"DILOCO_KEYRING": json.dumps({"a-0": KEY.decode(),
                                                       "b-0": [KEY.decode(), OTHER.decode()]})})
    assert ring == {"a-0": [KEY], "b-0": [KEY, OTHER]}
    assert load_keyring({}, required=False) is None
    with pytest.raises(SigningError, match="no keyring"):
        load_keyring({})
    for bad, why in (("[1]", "JSON object"), ("{", "not valid JSON"), ('{"a": 3}', "key or a list"),
                     ('{"a": "short"}', "at least 16")):
        with pytest.raises(SigningError, match=why):
            parse_keyring(bad)


def test_the_signature_key_sits_beside_the_delta_and_is_never_listed_as_one() -> None:
    keys = RunKeys("r")
    assert keys.signature("a-0", 7) == "r/deltas/a-0/000000000007.sig"
    assert parse_delta_key(keys.signature("a-0", 7)) is None
    name = "00000001700000000000-0123abcd"
    assert keys.op(name) == f"r/control/ops/{name}.json" and parse_op_key(keys.op(name)) == name
    assert parse_op_key("r/control/stop") is None


URL, B = "s3://bkt/runs", "bkt"


def test_a_learner_writes_only_its_own_prefixes() -> None:
    p = policy_for(URL, "r", learner="us-east-0")
    delta = "runs/r/deltas/us-east-0/000000000001.delta"
    own = [delta, "runs/r/deltas/us-east-0/000000000001.sig",
           "runs/r/learners/us-east-0/status.json", "runs/r/learners/us-east-0/checkpoint/state",
           "runs/r/events/us-east-0/123.jsonl"]
    assert all(allows(p, WRITE, B, k, if_none_match=True) for k in own)
    assert all(allows(p, WRITE, B, k) for k in own[1:])  # a signature, a heartbeat, a checkpoint: plain puts
    for k in ("runs/r/deltas/eu-west-0/000000000001.delta", "runs/r/versions/00000000000000000001.json",
              "runs/r/global/x.params", "runs/r/control/stop", "runs/r/control/ops/x.json", "runs/r/run.json",
              "runs/r/learners/eu-west-0/status.json", "runs/other/deltas/us-east-0/000000000001.delta",
              "runs/r/deltas/us-east-00/000000000001.delta"):
        assert not allows(p, WRITE, B, k) and not allows(p, WRITE, B, k, if_none_match=True), k

    assert allows(p, READ, B, "runs/r/global/x.params") and allows(p, READ, B, "runs/r/control/stop")
    assert not allows(p, READ, B, "runs/r/deltas/eu-west-0/000000000001.delta")
    assert not allows(p, DELETE, B, own[0])
    old_moments = "runs/r/learners/us-east-0/checkpoint/m000000000004-0a1b2c3d.p0000"
    assert allows(p, DELETE, B, old_moments)
    assert not allows(p, DELETE, B, "runs/r/learners/us-east-0/status.json")
    assert not allows(p, DELETE, B, "runs/r/learners/eu-west-0/checkpoint/m000000000004-0a1b2c3d.p0000")
    assert allows(p, LIST, B, "runs/r/versions/") and allows(p, LIST, B, "runs/r/deltas/us-east-0/")
    assert not allows(p, LIST, B, "runs/r/deltas/")

def test_published_deltas_and_committed_manifests_cannot_be_overwritten() -> None:
    """A learner's delta and the merger's manifest are written only by an exclusive create (If-None-Match: *,
    which S3 answers 412 when the key exists): a PutObject without the header is not allowed on them; the
    parts of a multipart upload (they take no header) are, its completion needs the header again (AWS's
    example)."""
    learner, merger = policy_for(URL, "r", learner="us-east-0"), policy_for(URL, "r", role="merger")
    delta, manifest = ("runs/r/deltas/us-east-0/000000000001.delta",
                       "runs/r/versions/00000000000000000001.json")
    assert allows(learner, WRITE, B, delta, if_none_match=True) and not allows(learner, WRITE, B, delta)
    assert allows(merger, WRITE, B, manifest, if_none_match=True) and not allows(merger, WRITE, B, manifest)
    assert allows(learner, WRITE, B, delta, part=True) and allows(merger, WRITE, B, manifest, part=True)
    # nonce'd: a plain put
    assert allows(merger, WRITE, B, "runs/r/global/00000000000000000001-abcdef12.params")
    once = [st for st in learner["Statement"] if st["Sid"] == "CreateOnce"]
    assert once and once[0]["Condition"] == {"Null": {"s3:if-none-match": "false"}}
    plain = [r for st in learner["Statement"] if st["Sid"] == "PutObject" for r in st["Resource"]]
    # else it would allow it
    assert not any(fnmatch.fnmatchcase(f"arn:aws:s3:::{B}/{delta}", r) for r in plain)
    with pytest.raises(ValueError, match="StringEquals"):
        allows({"Statement": [{"Effect": "Allow", "Action": [WRITE], "Resource": ["*"],
                               "Condition": {"StringEquals": {"s3:if-none-match": "*"}}}]}, WRITE, B, delta)


def test_the_merger_evaluator_and_operator() -> None:
    m = policy_for(URL, "r", role="merger")
    assert allows(m, WRITE, B, "runs/r/versions/00000000000000000001.json", if_none_match=True)
    assert allows(m, READ, B, "runs/r/deltas/a/1")
    assert allows(m, WRITE, B, "runs/r/events/merger-2/1.jsonl") and allows(m, LIST, B, "runs/r/deltas/")
    assert not allows(m, WRITE, B, "runs/r/deltas/a/000000000001.delta", if_none_match=True)
    assert not allows(m, WRITE, B, "runs/r/control/stop")
    e = policy_for(URL, "r", role="evaluator")
    assert allows(e, WRITE, B, "runs/r/evals/00000000000000000001.json")
    assert not allows(e, WRITE, B, "runs/r/versions/00000000000000000001.json")
    o = policy_for("s3://bkt", "r", role="operator")
    assert allows(o, DELETE, B, "r/control/stop") and not allows(o, WRITE, B, "other/control/stop")
    with pytest.raises(RunError, match="s3://"):
        policy_for("file://runs", "r", role="merger")
    with pytest.raises(RunError, match="--role"):
        policy_for(URL, "r", role="root")


def test_history_is_written_once_and_kept_by_every_role() -> None:
    """Issue #44: run.json, the manifests and the deltas (every fragment's too) are written only by an
    exclusive create, whatever a role's grants say (a Deny on a whole object's creation without
    If-None-Match), and the operator, who may delete, never deletes them; a stop flag and gc's orphans it
    still may."""
    history = ["runs/r/run.json", "runs/r/versions/00000000000000000001.json",
               "runs/r/deltas/us-east-0/000000000001.delta",
               "runs/r/fragments/0001/versions/00000000000000000001.json",
               "runs/r/fragments/0001/deltas/us-east-0/000000000001.delta"]
    policies = [policy_for(URL, "r", learner="us-east-0"), *(policy_for(URL, "r", role=r) for r in ROLES)]
    for policy, role in zip(policies, ["learner", *ROLES], strict=True):
        assert not any(allows(policy, WRITE, B, k) for k in history)
        kept = history if role != "gc" else [k for k in history if "/deltas/" not in k]  # retention: below
        assert not any(allows(policy, DELETE, B, k) for k in kept)
    operator = policies[1 + ROLES.index("operator")]
    assert all(allows(operator, WRITE, B, k, if_none_match=True) for k in history)  # creating the run, a fork
    assert all(allows(operator, WRITE, B, k, part=True) for k in history)  # a large object's parts
    for key in ("runs/r/control/stop", "runs/r/global/x.params"):  # a stop cleared, gc's orphans
        assert allows(operator, DELETE, B, key) and allows(operator, WRITE, B, key)
    assert allows(policies[0], READ, B, "runs/r/learners/eu-west-0/status.json")  # DyLU: its peers' speeds
    assert not allows(policies[0], READ, B, "runs/r/learners/eu-west-0/checkpoint/state")
    merger = policies[1]
    assert allows(merger, WRITE, B, "runs/r/events/merger/1.jsonl")
    assert allows(merger, WRITE, B, "runs/r/events/merger-s1/1.jsonl")
    assert not allows(merger, WRITE, B, "runs/r/events/mergers-0/1.jsonl")  # a learner's, not the merger's


def test_learners_and_the_evaluator_read_the_spec_files_and_the_merger_does_not() -> None:
    """A spec's files (a trained tokenizer, under <run>/spec/) are read by every process that builds the spec;
    the merger runs no user code and is not granted them; no role but the operator writes them."""
    key = "runs/r/spec/tokenizer.json"
    learner, evaluator = policy_for(URL, "r", learner="us-east-0"), policy_for(URL, "r", role="evaluator")
    merger = policy_for(URL, "r", role="merger")
    assert (allows(learner, READ, B, key) and allows(evaluator, READ, B, key)
            and not allows(merger, READ, B, key))
    assert not any(allows(p, WRITE, B, key) for p in (learner, evaluator, merger))


def test_the_gc_role_deletes_only_what_retention_removes() -> None:
    """Issue #41: retention (`diloco gc --keep-versions`) removes old checkpoints, updates and decided deltas
    (every fragment's too) and writes the chains' retention records, by the gc role's key; it never deletes
    or overwrites run.json or a manifest, and no other role may delete a delta."""
    gc = policy_for(URL, "r", role="gc")
    for key in ("runs/r/deltas/us-east-0/000000000001.delta", "runs/r/deltas/us-east-0/000000000001.sig",
                "runs/r/global/00000000000000000003-0123abcd.update",
                "runs/r/fragments/0002/deltas/a/000000000001.delta",
                "runs/r/checkpoints/00000000000000000010-0123abcd/part-00000",
                "runs/r/fragments/0002/checkpoints/00000000000000000010-0123abcd/checkpoint.json"):
        assert allows(gc, DELETE, B, key) and allows(gc, READ, B, key), key
    for key in ("runs/r/run.json", "runs/r/versions/00000000000000000001.json",
                "runs/r/fragments/0001/versions/00000000000000000001.json", "runs/r/control/stop",
                "other/r/global/x"):
        assert not allows(gc, DELETE, B, key) and not allows(gc, WRITE, B, key), key
    assert allows(gc, WRITE, B, "runs/r/retention.json")
    assert allows(gc, WRITE, B, "runs/r/fragments/0003/retention.json")
    assert allows(gc, LIST, B, "runs/r/checkpoints/")
    merger = policy_for(URL, "r", role="merger")
    assert allows(merger, WRITE, B, "runs/r/checkpoints/00000000000000000010-0123abcd/part-00003")
    assert not allows(merger, DELETE, B, "runs/r/checkpoints/00000000000000000010-0123abcd/part-00003")
    for role in ("operator", "merger", "evaluator"):
        delta = "runs/r/deltas/us-east-0/000000000001.delta"
        assert not allows(policy_for(URL, "r", role=role), DELETE, B, delta)

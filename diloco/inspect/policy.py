"""Least-privilege S3 policies for the roles of a run (`diloco bucket-policy`): a learner writes only its own
deltas/<name>/, learners/<name>/ and events/<name>/ and reads what it needs; the merger writes versions/,
global/ and its events (and never reads the spec's files: it runs no user code); the evaluator evals/ and its
events; the operator everything of the run.

Contract: plain IAM policy JSON (AWS IAM and MinIO read the same language); every key a role touches is
built by RunKeys, so the prefixes here follow storage/keys.py; `allows(policy, action, bucket, key)` is the
small evaluator the tests use to check a real run's requests against the policies (Allow statements only).
"""

from __future__ import annotations

import fnmatch
from typing import Any

from diloco.run.context import RunError
from diloco.storage.keys import RunKeys, validate_learner_name

ROLES = ("merger", "evaluator", "operator")
READ, WRITE, DELETE, LIST = "s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket"


def split_s3(storage: str) -> tuple[str, str]:
    """s3://bucket/prefix -> (bucket, "prefix/" or ""); RunError for any other URL."""
    if not storage.startswith("s3://") or not storage[5:].split("/")[0]:
        raise RunError(f"--storage {storage!r}: bucket policies are for s3://bucket/prefix storage")
    bucket, _, prefix = storage[5:].partition("/")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def _grants(role: str, learner: str | None, run: str) -> dict[str, list[str]]:
    """action -> the run-relative key patterns it applies to."""
    reads = ["run.json", "versions/*", "global/*", "control/*"]
    if learner is not None:
        own = [f"deltas/{learner}/*", f"learners/{learner}/*", f"events/{learner}/*"]
        return {READ: reads + own[:2] + ["spec/*"], WRITE: own,
                LIST: ["versions/*", f"deltas/{learner}/*", "control/*", f"learners/{learner}/*"]}
    if role == "merger":
        return {READ: reads + ["deltas/*"], WRITE: ["versions/*", "global/*", "events/merger*"],
                LIST: ["versions/*", "deltas/*", "control/*", "global/*"]}
    if role == "evaluator":
        return {READ: reads + ["evals/*", "spec/*"], WRITE: ["evals/*", "events/evaluator/*"],
                LIST: ["versions/*", "control/*", "evals/*"]}
    return {READ: ["*"], WRITE: ["*"], DELETE: ["*"], LIST: ["*"]}


def policy_for(storage: str, run_id: str, *, learner: str | None = None, role: str | None = None) -> dict[str, Any]:
    """The IAM policy document of one learner (`learner`) or one role (merger, evaluator, operator)."""
    keys = RunKeys(run_id)
    if learner is not None:
        validate_learner_name(learner)
    elif role not in ROLES:
        raise RunError(f"--role {role!r} must be one of {', '.join(ROLES)} (or give --learner NAME)")
    bucket, prefix = split_s3(storage)
    run = f"{prefix}{keys.run_id}/"
    grants = _grants(role or "learner", learner, run)
    statements: list[dict[str, Any]] = []
    for action in (READ, WRITE, DELETE):
        if action in grants:
            statements.append({"Sid": action.split(":")[1], "Effect": "Allow", "Action": [action],
                               "Resource": [f"arn:aws:s3:::{bucket}/{run}{p}" for p in grants[action]]})
    statements.append({"Sid": "ListTheRun", "Effect": "Allow", "Action": [LIST], "Resource": [f"arn:aws:s3:::{bucket}"],
                       "Condition": {"StringLike": {"s3:prefix": [f"{run}{p}" for p in grants[LIST]]}}})
    return {"Version": "2012-10-17", "Statement": statements}


def allows(policy: dict[str, Any], action: str, bucket: str, key: str) -> bool:
    """Whether an Allow statement grants `action` on `key` (for ListBucket: `key` is the listed prefix)."""
    for st in policy["Statement"]:
        if st["Effect"] != "Allow" or action not in st["Action"]:
            continue
        if action == LIST:
            if f"arn:aws:s3:::{bucket}" in st["Resource"] and any(
                    fnmatch.fnmatchcase(key, p) for p in st["Condition"]["StringLike"]["s3:prefix"]):
                return True
        elif any(fnmatch.fnmatchcase(f"arn:aws:s3:::{bucket}/{key}", r) for r in st["Resource"]):
            return True
    return False

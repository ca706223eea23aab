"""Least-privilege S3 policies for the roles of a run (`diloco bucket-policy`): a learner writes only its own
deltas/<name>/, learners/<name>/ and events/<name>/ and reads what it needs (its peers' statuses too: DyLU
paces itself by their speed); the merger writes versions/, global/, checkpoints/, guard/ and its events (and
never reads the spec's files: it runs no user code; guard/, the outlier window it judges by, is read by no
learner or evaluator); the evaluator evals/ and its events; the operator everything of the run; `gc`
(retention, `diloco gc --keep-versions`) deletes old checkpoints, updates and deltas, and orphans (a race
loser's update or window), and writes the chains' retention records, nothing else. What is history —
run.json, the manifests, the deltas — is written once, by every role's key: only by a PutObject carrying
If-None-Match (the `s3:if-none-match` condition key, as AWS enforces conditional writes), and never deleted —
but the deltas by the gc role, whose retention removes those no kept version needs — so a leaked key cannot
overwrite what was created, published or committed.

Contract: plain IAM policy JSON (AWS IAM and MinIO read the same language), generated only from validated
input (an S3 bucket name, a prefix without IAM's wildcards or variables, a run id, a learner name that is
no role's); every key a role touches is built by RunKeys, so the prefixes here follow storage/keys.py;
`allows(policy, action, bucket, key, if_none_match=...)` is the small evaluator the tests use to check a
real run's requests against the policies (Allow and Deny statements, a Deny winning; the condition
operators StringLike, Null and Bool).
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

from diloco.run.context import RunError
from diloco.storage.keys import RunKeys, validate_new_learner_name

ROLES = ("merger", "evaluator", "operator", "gc")
READ, WRITE, DELETE, LIST = "s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket"
CREATE = "create"  # in _grants: PutObject only as an exclusive create (the keys are history, written once)
# AWS's conditional-write enforcement: a PutObject (or CompleteMultipartUpload) without If-None-Match is
# denied; a multipart upload's parts (CreateMultipartUpload, UploadPart) take no conditional header, so they
# are allowed apart (s3:ObjectCreationOperation is false for them), and the upload's completion needs the
# header again
ONCE = {"Null": {"s3:if-none-match": "false"}}
PARTS = {"Bool": {"s3:ObjectCreationOperation": "false"}}
# what is history, for every role: a whole object's creation (not a multipart part) without If-None-Match is
# denied
NOT_ONCE = {"Null": {"s3:if-none-match": "true"}, "Bool": {"s3:ObjectCreationOperation": "true"}}
HISTORY = ["run.json", "versions/*", "deltas/*.delta", "fragments/*/versions/*", "fragments/*/deltas/*.delta"]
# what retention removes (gc role): a chain's old checkpoints, its updates (global/) and its decided deltas
RETIRED = ["global/*", "checkpoints/*", "deltas/*", "fragments/*/global/*", "fragments/*/checkpoints/*",
           "fragments/*/deltas/*"]
# the merger's own objects of each chain's guard (RunKeys.guard_prefix): the outlier window, never published
GUARD = ["guard/*", "fragments/*/guard/*"]
# S3's bucket names (3-63 of a-z 0-9 . -, a letter or digit at each end); a prefix's segments: no IAM wildcard
# (* ?), no policy variable ($), no `.` or `..`, nothing a key of the run would not hold
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9._=+@,-]+")


def split_s3(storage: str) -> tuple[str, str]:
    """s3://bucket/prefix -> (bucket, "prefix/" or ""); RunError for any other URL, and for a bucket or prefix
    that would make an ARN match more than the run (`s3://rt*/runs` would grant every bucket starting with
    `rt`)."""
    if not storage.startswith("s3://") or not storage[5:].split("/")[0]:
        raise RunError(f"--storage {storage!r}: bucket policies are for s3://bucket/prefix storage")
    bucket, _, prefix = storage[5:].partition("/")
    if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
        raise RunError(f"--storage {storage!r}: {bucket!r} is not an S3 bucket name (3-63 of a-z 0-9 . -, "
                       "no `..`, no wildcard): a policy names exactly one bucket")
    prefix = prefix.strip("/")
    for segment in prefix.split("/") if prefix else []:
        if not _SEGMENT_RE.fullmatch(segment) or segment in (".", ".."):
            bad = next((c for c in segment if not _SEGMENT_RE.fullmatch(c)), segment)
            raise RunError(f"--storage {storage!r}: the prefix segment {segment!r} may not hold {bad!r} "
                           "(no * ? $, no empty, . or .. segment: its ARNs name exactly the run's keys)")
    return bucket, f"{prefix}/" if prefix else ""


def _grants(role: str, learner: str | None, run: str) -> dict[str, list[str]]:
    """action -> the run-relative key patterns it applies to."""
    reads = ["run.json", "versions/*", "global/*", "checkpoints/*", "control/*", "retention.json"]
    if learner is not None:
        own = [f"deltas/{learner}/*", f"learners/{learner}/*", f"events/{learner}/*"]
        # learners/*/status.json: its peers' speeds (inner.dylu paces the learner by the fastest)
        return {READ: reads + own[:2] + ["spec/*", "learners/*/status.json"],
                CREATE: [f"deltas/{learner}/*.delta"],
                WRITE: [f"deltas/{learner}/*.sig", *own[1:]],  # a signature lands first, by a plain put
                # its own checkpoint's old moments (a pointer names the newest two generations; nothing else)
                DELETE: [f"learners/{learner}/checkpoint/*"],
                LIST: ["versions/*", f"deltas/{learner}/*", "control/*", f"learners/{learner}/*",
                       "checkpoints/*"]}
    if role == "merger":
        # guard/: the outlier window it judges by (storage/window.py), its own: no learner's or evaluator's
        return {READ: reads + ["deltas/*", "checkpoints/*", *GUARD], CREATE: ["versions/*", *GUARD],
                # events/merger-*: its shards' (merger-s<k>)
                WRITE: ["global/*", "checkpoints/*", "events/merger/*", "events/merger-*"],
                LIST: ["versions/*", "deltas/*", "control/*", "global/*", "checkpoints/*", *GUARD]}
    if role == "gc":
        # guard/: its orphans only (a race loser's window); a committed version's is history, kept
        return {READ: ["*"], WRITE: ["retention.json", "fragments/*/retention.json"], DELETE: RETIRED + GUARD,
                LIST: ["*"]}
    if role == "evaluator":
        return {READ: reads + ["evals/*", "spec/*"], WRITE: ["evals/*", "events/evaluator/*"],
                LIST: ["versions/*", "control/*", "evals/*", "checkpoints/*"]}
    return {READ: ["*"], WRITE: ["*"], DELETE: ["*"], LIST: ["*"]}


def policy_for(storage: str, run_id: str, *, learner: str | None = None,
               role: str | None = None) -> dict[str, Any]:
    """The IAM policy document of one learner (`learner`) or one role (merger, evaluator, operator)."""
    keys = RunKeys(run_id)
    if learner is not None:
        validate_new_learner_name(learner)  # a role's name would share the role's events and grants
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
    if CREATE in grants:  # disjoint from the plain writes above, or those would allow an overwrite
        once = [f"arn:aws:s3:::{bucket}/{run}{p}" for p in grants[CREATE]]
        statements.append({"Sid": "CreateOnce", "Effect": "Allow", "Action": [WRITE], "Resource": once,
                           "Condition": ONCE})
        statements.append({"Sid": "CreateOnceParts", "Effect": "Allow", "Action": [WRITE], "Resource": once,
                           "Condition": PARTS})
    statements.append({"Sid": "ListTheRun", "Effect": "Allow", "Action": [LIST],
                       "Resource": [f"arn:aws:s3:::{bucket}"],
                       "Condition": {"StringLike": {"s3:prefix": [f"{run}{p}" for p in grants[LIST]]}}})
    history = [f"arn:aws:s3:::{bucket}/{run}{p}" for p in HISTORY]  # whatever the grants above say
    statements.append({"Sid": "HistoryWrittenOnce", "Effect": "Deny", "Action": [WRITE], "Resource": history,
                       "Condition": NOT_ONCE})
    if DELETE in grants:  # the gc role's retention deletes decided deltas: its Deny keeps the rest
        kept = [r for r, p in zip(history, HISTORY, strict=True) if role != "gc" or "deltas" not in p]
        statements.append({"Sid": "HistoryKept", "Effect": "Deny", "Action": [DELETE], "Resource": kept})
    return {"Version": "2012-10-17", "Statement": statements}


def allows(policy: dict[str, Any], action: str, bucket: str, key: str, *, if_none_match: bool = False,
           part: bool = False) -> bool:
    """Whether an Allow statement and no Deny statement matches `action` on `key` (for ListBucket: `key` is
    the listed prefix) for a request that carries If-None-Match or not, and is a multipart upload's part
    (`part`) or a whole object's creation."""
    context = {"s3:prefix": key if action == LIST else None,
               "s3:if-none-match": "*" if if_none_match else None,
               "s3:ObjectCreationOperation": None if action != WRITE else "false" if part else "true"}
    resource = f"arn:aws:s3:::{bucket}" if action == LIST else f"arn:aws:s3:::{bucket}/{key}"
    def matches(st: dict[str, Any]) -> bool:
        return action in st["Action"] and any(fnmatch.fnmatchcase(resource, r) for r in st["Resource"]) and \
            _holds(st.get("Condition", {}), context)

    statements = policy["Statement"]
    return any(st["Effect"] == "Allow" and matches(st) for st in statements) and \
        not any(st["Effect"] == "Deny" and matches(st) for st in statements)


def _holds(condition: dict[str, dict[str, Any]], context: dict[str, str | None]) -> bool:
    """IAM's condition block on a request's keys: every operator's every key must hold (a missing key fails
    all but Null); an operator this evaluator does not know is an error, never a silent allow."""
    for operator, tests in condition.items():
        for name, wanted in tests.items():
            have, values = context.get(name), wanted if isinstance(wanted, list) else [wanted]
            if operator == "StringLike":
                ok = have is not None and any(fnmatch.fnmatchcase(have, v) for v in values)
            elif operator == "Null":
                ok = (have is None) == (str(values[0]).lower() == "true")
            elif operator == "Bool":
                ok = have is not None and have == str(values[0]).lower()
            else:
                raise ValueError(f"condition operator {operator!r} is not evaluated here")
            if not ok:
                return False
    return True

"""The bucket: object store over fsspec, key layout, manifests and the commit protocol.

Contract: the bucket is the system of record; a version exists iff its manifest was exclusively
created. The delta codec lives in diloco.storage.codec and is imported from there.
"""

from diloco.storage.errors import (
    BadRequest,
    Conflict,
    NotFound,
    PermissionDenied,
    StorageError,
    TransientError,
)
from diloco.storage.keys import (
    InvalidName,
    RunKeys,
    new_nonce,
    parse_delta_key,
    parse_manifest_key,
    validate_learner_name,
    validate_run_id,
)
from diloco.storage.manifest import (
    DeltaDecision,
    Manifest,
    ManifestError,
    chain_problems,
    commit,
    latest_version,
    list_versions,
    manifest_exists,
    read_latest,
    read_manifest,
)
from diloco.storage.store import ObjectStore, Store, open_store

__all__ = [
    "BadRequest",
    "Conflict",
    "DeltaDecision",
    "InvalidName",
    "Manifest",
    "ManifestError",
    "NotFound",
    "ObjectStore",
    "PermissionDenied",
    "RunKeys",
    "StorageError",
    "Store",
    "TransientError",
    "chain_problems",
    "commit",
    "latest_version",
    "list_versions",
    "manifest_exists",
    "new_nonce",
    "open_store",
    "parse_delta_key",
    "parse_manifest_key",
    "read_latest",
    "read_manifest",
    "validate_learner_name",
    "validate_run_id",
]

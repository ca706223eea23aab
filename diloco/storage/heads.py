"""A merger shard's heads: the newest version of each chain it owns, rewritten after each of its commits, so
that a fragmented learner learns which of its lanes moved from one small GET a poll instead of one request per
lane (diloco.learner.heads).

Contract: a hint, never the truth: readers act on it only by polling the chain it names (its manifests
decide); a heads object that is missing, stale, malformed or hostile is read as no news (None), never
raised; writing one that fails is the writer's to log. Key: `<run>/global/heads-<shard:04d>.json`
(RunKeys.heads), which `gc` keeps; mergers racing on a shard overwrite each other's (the last commit's view
wins until the next).
"""

from __future__ import annotations

from collections.abc import Mapping

from diloco.storage.errors import StorageError
from diloco.storage.keys import RunKeys
from diloco.storage.records import HeadsRecord, RecordError, write_record
from diloco.storage.store import Store

MAX_HEADS_BYTES = 1 << 20  # a heads object of every fragment (10,000) is ~0.3 MB


def encode_heads(merger_id: str, versions: Mapping[int, int]) -> bytes:
    """The heads object `merger_id` writes: chain index -> its newest committed version."""
    return HeadsRecord(merger=merger_id, versions=dict(versions)).to_bytes()


def write_heads(store: Store, keys: RunKeys, shard: int, merger_id: str, versions: Mapping[int, int]) -> None:
    """Overwrite shard `shard`'s heads object. StorageError from the bucket."""
    write_record(store, keys.heads(shard), HeadsRecord(merger=merger_id, versions=dict(versions)))


def parse_heads(data: bytes) -> dict[int, int] | None:
    """chain index -> version from a heads object's bytes (HeadsRecord); None when it is not one (malformed,
    oversized, another format, out-of-range numbers)."""
    if len(data) > MAX_HEADS_BYTES:
        return None
    try:
        return HeadsRecord.from_bytes(data).versions
    except RecordError:
        return None


def read_heads(store: Store, keys: RunKeys, shard: int) -> dict[int, int] | None:
    """Shard `shard`'s heads (parse_heads), or None when there are none yet or the bucket failed."""
    try:
        return parse_heads(store.get(keys.heads(shard)))
    except StorageError:  # NotFound included: no commit yet
        return None

"""One object-store interface over fsspec for any URL: file://, memory://, s3://bucket/prefix, gs://...

Contract: keys are '/'-separated relative paths under the store root; listings are never served
from a cache; put_if_absent is a true atomic exclusive create; errors are translated in one place.
"""
# STUB — to be implemented (see docstrings). Signatures are the contract other modules rely on.

from __future__ import annotations

from collections.abc import Iterator


class ObjectStore:
    """A bucket (or folder) addressed by URL. Thread-safe; one instance per process is enough."""

    url: str

    def __init__(self, url: str, *, storage_options: dict | None = None, max_retries: int = 5) -> None:
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        """The object's bytes. NotFound if absent."""
        raise NotImplementedError

    def get_size(self, key: str) -> int:
        """The object's size in bytes without reading it. NotFound if absent."""
        raise NotImplementedError

    def put(self, key: str, data: bytes) -> None:
        """Write (or overwrite) an object; atomic for readers (they see old or new, never a part)."""
        raise NotImplementedError

    def put_if_absent(self, key: str, data: bytes) -> None:
        """Exclusive create. Conflict if the key exists — exactly one of N racing writers wins."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def list(self, prefix: str) -> list[str]:
        """All keys under prefix (recursively), sorted, relative to the store root. Never cached."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Remove an object; absent is not an error."""
        raise NotImplementedError

    def iter_list(self, prefix: str) -> Iterator[str]:
        yield from self.list(prefix)


def open_store(url: str, **storage_options: object) -> ObjectStore:
    """The store for a URL; a bare path means file://. s3 honours AWS_ENDPOINT_URL and AWS_* vars."""
    raise NotImplementedError

"""Storage errors: the one vocabulary every backend's failures are translated into.

Contract: callers catch these, never botocore/OSError details. Transient is retried (bounded);
the rest never are.
"""


class StorageError(Exception):
    """Base class of every storage failure."""


class NotFound(StorageError, KeyError):
    """The object does not exist."""


class Conflict(StorageError):
    """An exclusive create lost: the object already exists (HTTP 412 / 409, EEXIST)."""


class TransientError(StorageError):
    """Worth retrying: throttling, 5xx, timeouts, connection resets."""


class PermissionDenied(StorageError):
    """Credentials are missing or not allowed (HTTP 401/403). Never retried."""


class BadRequest(StorageError):
    """The request itself is wrong (bad key, bad bucket, HTTP 400). Never retried."""
